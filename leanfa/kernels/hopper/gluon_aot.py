"""Ahead-of-time compilation of the Hopper kernel for sm90 without a GPU.

``compile_variant`` builds the same argument list as a real launch (descriptors over small CPU
tensors: a descriptor's *type* depends only on dtype, box and layout), turns it into a Triton
signature, and runs the full pipeline (Gluon -> TTGIR -> LLVM -> PTX -> ptxas cubin) for
``GPUTarget("cuda", 90, 32)``. Used by ``scripts/hopper_compile_check.py`` and the tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from unittest import mock

import torch
import triton

from ..triton_aot import ptxas_perf_warnings, ptxas_usage
from . import launch as L
from .gluon_compat import GluonASTSource, GPUTarget, mangle_type
from . import varlen_tiles
from ..paged_v import KEY_BLOCK
from ..varlen_v import repacked_tokens

TARGET = GPUTarget("cuda", 90, 32)


@dataclass
class Variant:
    dtype: str = "fp8"  # "fp8" | "bf16" | "mixed" (FP8 Q and K, a BF16 V: attention(precision="fp8qk"))
    dqk: int = 128
    dv: int = 128
    causal: bool = True
    return_lse: bool = False
    k_mean: bool = False
    v_kmajor: bool | None = None  # default: True for fp8, False for bf16 and mixed
    out_dtype: torch.dtype = torch.bfloat16
    env: tuple = ()  # ((name, value), ...) LEANFA_HOPPER_* knobs set while planning
    varlen: bool = False  # packed (total, H, D) inputs with cu_seqlens
    sink: bool = False  # FP8 with the first 128 keys attended from BF16 inputs (sink.py)
    page_size: int = 0  # paged K/V: caches (num_pages, page_size, H, D) through a page table (0: contiguous)
    window: tuple = (-1, -1)  # flash-attn's window_size as Problem stores it (-1: unbounded; causal: right -1)
    softcap: float = 0.0  # flash-attn's softcap (0: off)
    seqused_k: bool = False  # FA3's seqused_k (paged varlen: read as the key lengths' cu_seqlens_k)
    seqused_q: bool = False  # FA3's seqused_q (the used query rows attend; the others are written as 0, LSE -inf)

    @property
    def name(self) -> str:
        vk = self.v_kmajor if self.v_kmajor is not None else self.dtype == "fp8"
        tag = "".join(f"[{k.replace('LEANFA_HOPPER_', '').lower()}={x}]" for k, x in self.env) + (":" if self.env else "")
        return (f"{tag}{self.dtype}-d{self.dqk}/{self.dv}-{'causal' if self.causal else 'full'}"
                f"{'-lse' if self.return_lse else ''}{'-kmean' if self.k_mean else ''}"
                f"{'-vT' if vk else ''}{'-varlen' if self.varlen else ''}{'-sink' if self.sink else ''}"
                f"{f'-paged{self.page_size}' if self.page_size else ''}"
                f"{'-window%d,%d' % self.window if self.window != (-1, -1) else ''}"
                f"{'-softcap%g' % self.softcap if self.softcap else ''}{'-usedk' if self.seqused_k else ''}{'-usedq' if self.seqused_q else ''}")


def _fake_problem(v: Variant):
    dt = torch.float8_e4m3fn if v.dtype in ("fp8", "mixed") else torch.bfloat16  # Q and K
    v_dt = torch.float8_e4m3fn if v.dtype == "fp8" else torch.bfloat16
    kmajor = v.v_kmajor if v.v_kmajor is not None else v.dtype == "fp8"
    B, S, H = 1, 256, 2
    q = torch.zeros(B, S, H, v.dqk, dtype=dt)
    k = torch.zeros(B, S, H, v.dqk, dtype=dt)
    if kmajor:
        v_ = torch.zeros(B, H, v.dv, S, dtype=v_dt).permute(0, 3, 1, 2)
    else:
        v_ = torch.zeros(B, S, H, v.dv, dtype=v_dt)
    out = torch.zeros(B, S, H, v.dv, dtype=v.out_dtype)
    lse = torch.zeros(B, H, S, dtype=torch.float32)
    ones = torch.ones(1, 1, 1, dtype=torch.float32)
    qs = ones.expand(B, H, 2)
    ks = ones.expand(B, H, 2)
    vs = ones.expand(B, H, v.dv)
    km = torch.zeros(B, H, v.dqk, dtype=torch.float32) if v.k_mean else None
    sixteen = [torch.zeros(B, S, H, d, dtype=torch.bfloat16) for d in (v.dqk, v.dqk, v.dv)]  # the sink's inputs
    varlen = {}
    if v.varlen:  # the same tokens as two packed sequences
        q, k, v_, out = (t[0] for t in (q, k, v_, out))
        lse = lse[0]
        cu = torch.tensor([0, 100, S], dtype=torch.int32)
        varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156)
        qs, ks, vs = ones.expand(2, H, 2), ones.expand(2, H, 2), ones.expand(2, H, v.dv)
        km = torch.zeros(2, H, v.dqk, dtype=torch.float32) if v.k_mean else None
        sixteen = [t[0] for t in sixteen]
        # the tile table is a kernel launch too: a stand-in (its count, pairs and scratch; only its type matters)
        varlen["tile_table"] = torch.zeros(1 + varlen_tiles.capacity(S, 2, L.BLOCK_M) + 3, dtype=torch.int32)
        if v.dtype == "fp8":  # launch.prepare_v's re-pack is a kernel launch (needs a driver): a stand-in of its
            room = repacked_tokens(S, 2)  # result's shape, with the starts it would write for lengths 100 and 156
            varlen["prepared_v"] = (torch.zeros(H, v.dv, room, dtype=dt).permute(2, 0, 1),
                                    torch.tensor([0, 112, 272], dtype=torch.int32))
    if v.sink:
        varlen["sink"] = (128, *sixteen)
    if v.page_size:  # the keys in caches of S pages (a stand-in table: only its type matters; dense: S keys each)
        k = torch.zeros(S, v.page_size, H, v.dqk, dtype=dt)
        v_ = torch.zeros(S, v.page_size, H, v.dv, dtype=v_dt)
        varlen["page_table"] = torch.zeros(2 if v.varlen else B, -(-S // v.page_size), dtype=torch.int32)
        if v.dtype == "fp8":  # launch.prepare_v's gather of the V pages is a kernel launch: a stand-in of its result
            room = varlen["page_table"].shape[1] * v.page_size
            alloc = -(-room // KEY_BLOCK) * KEY_BLOCK
            varlen["prepared_v"] = (torch.zeros(varlen["page_table"].shape[0], H, v.dv, alloc,
                                                dtype=dt)[..., :room].permute(0, 3, 1, 2), None)
    if v.seqused_k:
        varlen["seqused_k"] = torch.zeros(2 if v.varlen else B, dtype=torch.int32)
    if v.seqused_q:
        varlen["seqused_q"] = torch.zeros(2 if v.varlen else B, dtype=torch.int32)
    with mock.patch.dict(os.environ, {k: str(x) for k, x in v.env}):  # restored on exit
        return L.make_plan(q, k, v_, out, lse if v.return_lse else None, qs, ks, vs, km, causal=v.causal,
                           softmax_scale=v.dqk ** -0.5, return_lse=v.return_lse, window=v.window, **varlen,
                           softcap=v.softcap)


def _signature(fn, args, constexprs):
    names = list(fn.arg_names)
    sig, consts = {}, {}
    it = iter(args)
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
            consts[n] = constexprs[n]
        else:
            a = next(it)
            sig[n] = mangle_type(a)
    return sig, consts


@dataclass
class Compiled:
    name: str
    regs: int
    spill_stores: int
    spill_loads: int
    shared: int
    wgmma_ptx: int
    ptx: str
    ttgir: str
    perf_warnings: list  # ptxas "Potential Performance Loss" lines (C7512: wgmmas serialized)


def compile_variant(v: Variant) -> Compiled:
    plan = _fake_problem(v)
    c = dict(plan.constexprs)
    sig, consts = _signature(plan.kernel, plan.args, c)
    src = GluonASTSource(plan.kernel, sig, constexprs=consts)
    ck = triton.compile(src, target=TARGET, options={"num_warps": c["num_warps"]})
    ptx = ck.asm["ptx"]
    regs, ss, sl = ptxas_usage(ptx)
    return Compiled(v.name, regs, ss, sl, ck.metadata.shared, ptx.count("wgmma.mma_async"), ptx,
                    ck.asm["ttgir"], ptxas_perf_warnings(ptx))
