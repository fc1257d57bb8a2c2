"""Registry of attention implementations the benchmark compares, all on the same BF16 inputs.

Each :class:`Impl` turns a case's inputs into a :class:`Prepared` call: ``run()`` is what
is timed, ``output(result)`` gives the attention output as a tensor in the input layout
(``(B, S, Hq, Dv)``, or packed ``(total, Hq, Dv)``) for the accuracy check. Anything that
costs time but is not part of the measured call (building a cuDNN graph, quantizing inputs
for a "kernel" row) happens in ``prepare``.

Rows:

* ``leanfa-<backend>-fp8``: :func:`leanfa.attention` with ``precision="fp8"``: BF16 in, BF16
  out, the quantization (per-block Q/K scales, K smoothing, per-channel V) inside the timing;
* ``leanfa-<backend>-fp8qk``: :func:`leanfa.attention` with ``precision="fp8qk"`` (the mixed mode: Q and K
  quantized as above, V left in BF16, P·V in BF16), end to end; an FP8 row (compared to cuDNN FP8);
* ``leanfa-<backend>-fp8-kernel``: ``flash_attn_func(quantize_fp8(q, k, v))``, the kernel
  alone on inputs quantized beforehand;
* ``leanfa-<backend>-bf16``: ``flash_attn_func`` on the BF16 inputs;
* paged K/V (opt-in: ``--impl`` must name them, e.g. ``'leanfa-*-paged*'``; packed batches only):
  ``leanfa-<backend>-bf16-paged<P>`` is ``flash_attn_varlen_func(q, k_cache, v_cache, ..., page_table=)`` with
  the same K/V copied into caches of ``P``-token pages (``P`` in :data:`PAGE_SIZES`) in a shuffled order
  (:func:`leanfa.bench.inputs.paged_kv`, built before the timing); ``leanfa-<backend>-fp8-paged<P>-kernel`` the
  same on e4m3 Q and caches with FA3's per-(sequence, KV head) descales (a KV cache's FP8 format), and
  ``leanfa-<backend>-fp8-kvhead-kernel`` those FP8 inputs with contiguous K/V (the paged FP8 rows' baseline).
  The ``hopper`` paged rows run the Hopper kernel (BF16 beside ``leanfa-hopper-bf16``, the same batch contiguous:
  the paged target is >= 0.95x of it); its FP8 paged call includes a transposed copy of the V pages per call
  (:func:`leanfa.kernels.paged_v.gather_paged_v`), and ``leanfa-hopper-fp8-paged<P>-launch`` times the Hopper launch
  alone with that copy made before the timing (the difference is the copy's time); a ``-vllm`` suffix
  (``leanfa-<backend>-bf16-paged<P>-vllm``, ``leanfa-<backend>-fp8-paged<P>-vllm``) makes the same paged call as vLLM's
  FA3 prefill backend does, the key lengths as ``seqused_k`` with ``cu_seqlens_k=None``;
* ``cudnn-bf16``: torch SDPA forced to ``SDPBackend.CUDNN_ATTENTION`` (varlen: cuDNN
  frontend graph with ragged offsets; a chunked-prefill batch, ``Sq < Sk``, with the
  bottom-right causal mask) — the BF16 baseline;
* ``cudnn-fp8``: cuDNN frontend ``sdpa_fp8`` on per-tensor-quantized inputs (the kernel
  alone, FP8 output) — the FP8 baseline; ``cudnn-fp8-e2e`` adds the per-tensor
  quantization of Q/K/V and the dequantization of the output to the timing;
* ``sdpa-flash-bf16``: torch SDPA ``FLASH_ATTENTION`` (FlashAttention-2; varlen through
  ``torch.nn.attention.varlen.varlen_attn``);
* ``fa3-bf16`` / ``fa3-fp8``: FlashAttention-3 (``fa3_fwd_interface``, else
  ``flash_attn_interface``; :mod:`leanfa.bench.fa3`), FP8 on inputs quantized beforehand with
  one scale per (sequence, KV head) — the kernel alone;
* ``flashinfer-bf16``, ``fa4-bf16`` (``flash_attn.cute``) when importable.

Every varlen call passes the queries' and the keys' ``cu_seqlens``/``max_seqlen`` separately
(:meth:`Inputs.varlen_kw`): they differ in the serving sweep's chunked-prefill batches.

Each row's ``available()`` says whether it can run here and why not: the Hopper, cuDNN and FA3
rows need a CUDA GPU (Hopper and FA3 one of compute capability 9.x); the portable leanfa rows
also run on CPU tensors under Triton's interpreter. The peers a row is compared with are in
:mod:`leanfa.bench.peers`.

A case an implementation cannot run raises :class:`NotApplicable` (reported "n/a" with
the reason); so does a ``ValueError`` from leanfa (e.g. ``backend="hopper"`` on a shape the
Hopper kernel does not cover).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..kernels.device import capability
from . import cudnn_graphs, fa3
from .inputs import Inputs, PagedKV, paged_kv
from .shapes import Case

FP8 = torch.float8_e4m3fn
LEANFA_BACKENDS = ("hopper", "portable")


class NotApplicable(Exception):
    """This implementation cannot run this case (reason in the message)."""


@dataclass
class Prepared:
    run: Callable[[], Any]
    output: Callable[[Any], torch.Tensor] = field(default=lambda r: r)
    note: str = ""


@dataclass(frozen=True)
class Impl:
    name: str
    family: str  # leanfa | cudnn | sdpa-flash | fa3 | flashinfer | fa4
    precision: str  # fp8 | bf16
    variant: str  # "kernel": inputs already in the kernel's format; "e2e": BF16 in, BF16 out
    description: str
    prepare: Callable[[Case, Inputs], Prepared]
    available: Callable[[], tuple[bool, str]] = field(default=lambda: (True, ""))
    #: the row that same-precision rows are compared to (cuDNN)
    baseline: bool = False
    #: in the default selection (no ``--impl``); False: only when ``--impl`` names it (a pattern matches it)
    default: bool = True

    def to_dict(self) -> dict:
        return {"impl": self.name, "family": self.family, "precision": self.precision,
                "variant": self.variant}


def _module_available(name: str) -> tuple[bool, str]:
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    return (True, "") if found else (False, f"python module {name!r} not installed")


# ---------------------------------------------------------------------------------- leanfa
def _leanfa():
    from leanfa import api

    return api


def _leanfa_available() -> tuple[bool, str]:
    try:
        _leanfa()
    except Exception as e:
        return False, f"leanfa.api not importable ({type(e).__name__}: {e})"
    return True, ""


def _varlen_kw(x: Inputs) -> dict:
    """Queries and keys each with their own lengths (they differ in a chunked-prefill batch)."""
    return x.varlen_kw()


def _leanfa_call(fn: Callable[[], Any]) -> Callable[[], Any]:
    """leanfa raises ValueError for a call a backend does not cover: that is 'n/a'."""
    def run():
        try:
            return fn()
        except ValueError as e:
            raise NotApplicable(str(e)) from e
    return run


def _window_kw(case: Case) -> dict:
    """The case's sliding window and softcap as leanfa's (and flash-attn's) keywords (none without them)."""
    kw = {"window_size": case.window_size} if case.window_left >= 0 else {}
    if case.softcap > 0:
        kw["softcap"] = case.softcap
    return kw


def _no_window(case: Case, what: str) -> None:
    if case.window_left >= 0:
        raise NotApplicable(f"{what}: not wired for sliding windows")
    if case.softcap > 0:
        raise NotApplicable(f"{what}: not wired for softcap")


def _leanfa_bf16(backend: str):
    def prepare(case: Case, x: Inputs) -> Prepared:
        lf = _leanfa()
        if x.varlen:
            return Prepared(_leanfa_call(lambda: lf.flash_attn_varlen_func(
                x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens_k, x.max_seqlen, x.max_seqlen_k,
                causal=case.causal, backend=backend, **_window_kw(case))))
        return Prepared(_leanfa_call(lambda: lf.flash_attn_func(x.q, x.k, x.v, causal=case.causal,
                                                                backend=backend, **_window_kw(case))))
    return prepare


def _leanfa_fp8_e2e(backend: str, precision: str = "fp8"):
    """attention(precision="fp8"), or "fp8qk" (the mixed mode: FP8 Q·K, BF16 P·V)."""
    def prepare(case: Case, x: Inputs) -> Prepared:
        lf = _leanfa()
        kw = {**(_varlen_kw(x) if x.varlen else {}), **_window_kw(case)}
        return Prepared(_leanfa_call(lambda: lf.attention(x.q, x.k, x.v, causal=case.causal,
                                                          precision=precision, backend=backend, **kw)))
    return prepare


def _leanfa_fp8_sink(backend: str, prefix: int = 128):
    """attention(precision="fp8", bf16_sink_keys=128): first keys of each sequence in BF16
    (in the portable kernel; backend="hopper" runs the dense-only split)."""
    def prepare(case: Case, x: Inputs) -> Prepared:
        lf = _leanfa()
        if x.varlen and backend == "hopper":
            raise NotApplicable("bf16_sink_keys with backend='hopper' is the dense-only split")
        _no_window(case, "bf16_sink_keys")
        kw = _varlen_kw(x) if x.varlen else {}
        return Prepared(_leanfa_call(lambda: lf.attention(x.q, x.k, x.v, causal=case.causal, precision="fp8",
                                                          backend=backend, bf16_sink_keys=prefix, **kw)))
    return prepare


def _leanfa_fp8_kernel(backend: str):
    def prepare(case: Case, x: Inputs) -> Prepared:
        lf = _leanfa()
        if x.varlen:
            quant = lf.quantize_fp8(x.q, x.k, x.v, granularity="block", smooth_k=True, **_varlen_kw(x))
            return Prepared(_leanfa_call(lambda: lf.flash_attn_varlen_func(
                quant, None, None, x.cu_seqlens, x.cu_seqlens_k, x.max_seqlen, x.max_seqlen_k,
                causal=case.causal, backend=backend, **_window_kw(case))))
        quant = lf.quantize_fp8(x.q, x.k, x.v, granularity="block", smooth_k=True)
        return Prepared(_leanfa_call(lambda: lf.flash_attn_func(quant, causal=case.causal,
                                                                backend=backend, **_window_kw(case))))
    return prepare


#: page sizes of the paged rows
PAGE_SIZES = (64, 128)


def _paged(case: Case, x: Inputs, k: torch.Tensor, v: torch.Tensor, page_size: int) -> PagedKV:
    if not x.varlen:
        raise NotApplicable("paged K/V rows run on packed (varlen) batches")
    return paged_kv(k, v, case.key_seqlens, page_size, seed=page_size)


def _key_lengths(x: Inputs, vllm: bool) -> dict:
    """How a paged call is told its key lengths: ``cu_seqlens_k``, or (``vllm``) vLLM's FA3 prefill call's
    ``seqused_k`` with ``cu_seqlens_k=None`` (the lengths made on the device before the timing)."""
    if not vllm:
        return dict(cu_seqlens_k=x.cu_seqlens_k)
    return dict(cu_seqlens_k=None, seqused_k=x.cu_seqlens_k.diff().to(torch.int32))


def _leanfa_bf16_paged(backend: str, page_size: int, vllm: bool = False):
    """flash_attn_varlen_func over paged BF16 caches holding the case's K/V (pages shuffled), with the case's
    sliding window if it has one; ``vllm``: the key lengths as ``seqused_k`` (:func:`_key_lengths`)."""
    def prepare(case: Case, x: Inputs) -> Prepared:
        lf = _leanfa()
        paged = _paged(case, x, x.k, x.v, page_size)
        lengths = _key_lengths(x, vllm)
        return Prepared(_leanfa_call(lambda: lf.flash_attn_varlen_func(
            x.q, paged.k_cache, paged.v_cache, x.cu_seqlens, max_seqlen_q=x.max_seqlen, max_seqlen_k=x.max_seqlen_k,
            causal=case.causal, backend=backend, page_table=paged.page_table, **lengths, **_window_kw(case))),
            note=f"paged K/V, {page_size}-token pages in a shuffled order" + ("; seqused_k" if vllm else ""))
    return prepare


def _fp8_per_kv_head(case: Case, x: Inputs):
    """Q, K, V in e4m3 with FA3's descales, one per (sequence, KV head) (:func:`fa3.quantize_per_kv_head`)."""
    cu_q = x.cu_seqlens if x.varlen else None
    cu_k = x.cu_seqlens_k if x.varlen else None
    q8, dq = fa3.quantize_per_kv_head(x.q, case.kv_heads, cu_q)
    k8, dk = fa3.quantize_per_kv_head(x.k, case.kv_heads, cu_k)
    v8, dv = fa3.quantize_per_kv_head(x.v, case.kv_heads, cu_k)
    return q8, k8, v8, dict(q_descale=dq, k_descale=dk, v_descale=dv)


def _leanfa_hopper_fp8_paged_launch(page_size: int):
    """The Hopper kernel's launch alone on the FP8 paged call of :func:`_leanfa_fp8_kvhead_kernel`: its plan (with the
    per-call transposed copy of the V pages, :func:`leanfa.kernels.paged_v.gather_paged_v`) made once before the
    timing, so that the row beside ``leanfa-hopper-fp8-paged<P>-kernel`` (the whole call) shows the copy's time."""
    def prepare(case: Case, x: Inputs) -> Prepared:
        api = _leanfa()
        _no_window(case, "per-KV-head descale rows")
        if not x.varlen:
            raise NotApplicable("paged K/V rows run on packed (varlen) batches")
        from leanfa.kernels import dispatch, hopper
        from leanfa.kernels.hopper import launch as hopper_launch

        q8, k8, v8, desc = _fp8_per_kv_head(case, x)
        paged = _paged(case, x, k8, v8, page_size)
        problem = api._build_problem(q8, paged.k_cache, paged.v_cache, varlen=True, cu_seqlens_q=x.cu_seqlens,
                                     cu_seqlens_k=x.cu_seqlens_k, max_seqlen_q=x.max_seqlen,
                                     max_seqlen_k=x.max_seqlen_k, softmax_scale=None, causal=case.causal,
                                     k_mean=None, return_lse=False, out_dtype=None, page_table=paged.page_table,
                                     **desc)
        ok, why = dispatch.hopper_applies(problem)
        if not ok:
            raise NotApplicable(why)
        plan, out, _ = hopper.plan(problem)

        def run():
            with torch.cuda.device(out.device):
                hopper_launch.launch(plan)
            return out
        return Prepared(run, note=f"{page_size}-token pages; the Hopper launch alone, V's pages copied once before")
    return prepare


def _leanfa_fp8_kvhead_kernel(backend: str, page_size: int | None = None, vllm: bool = False):
    """The kernel alone on e4m3 inputs with per-(sequence, KV head) descales, K/V contiguous or (``page_size``)
    in paged caches (``vllm``: the key lengths as ``seqused_k``, :func:`_key_lengths`)."""
    def prepare(case: Case, x: Inputs) -> Prepared:
        lf = _leanfa()
        _no_window(case, "per-KV-head descale rows")
        if page_size is not None and not x.varlen:
            raise NotApplicable("paged K/V rows run on packed (varlen) batches")
        q8, k8, v8, desc = _fp8_per_kv_head(case, x)
        note = "e4m3 with one descale per (sequence, KV head)"
        if page_size is not None:
            paged = _paged(case, x, k8, v8, page_size)
            lengths = _key_lengths(x, vllm)
            return Prepared(_leanfa_call(lambda: lf.flash_attn_varlen_func(
                q8, paged.k_cache, paged.v_cache, x.cu_seqlens, max_seqlen_q=x.max_seqlen,
                max_seqlen_k=x.max_seqlen_k, causal=case.causal, backend=backend, page_table=paged.page_table,
                **lengths, **desc)),
                note=f"{note}; paged K/V, {page_size}-token pages in a shuffled order" + ("; seqused_k" if vllm else ""))
        if x.varlen:
            return Prepared(_leanfa_call(lambda: lf.flash_attn_varlen_func(
                q8, k8, v8, x.cu_seqlens, x.cu_seqlens_k, x.max_seqlen, x.max_seqlen_k, causal=case.causal,
                backend=backend, **desc)), note=note)
        return Prepared(_leanfa_call(lambda: lf.flash_attn_func(q8, k8, v8, causal=case.causal, backend=backend,
                                                                **desc)), note=note)
    return prepare


# ------------------------------------------------------------------------------ torch SDPA
def _no_kernel(e: Exception) -> bool:
    msg = str(e).lower()
    return any(s in msg for s in ("no available kernel", "not supported", "unsupported",
                                  "only support", "head_dim"))


def _sdpa(backend_name: str):
    """torch SDPA forced to one backend; GQA via enable_gqa, else K/V heads repeated.
    For cuDNN, a shape SDPA has no kernel for (and varlen) goes to the cuDNN frontend."""
    def prepare(case: Case, x: Inputs) -> Prepared:
        try:
            return _sdpa_prepare(backend_name, case, x)
        except NotApplicable as e:
            if backend_name != "CUDNN_ATTENTION" or x.varlen or not cudnn_graphs.available()[0]:
                raise
            p = _cudnn_graph_prepare(case, x, fp8=False, e2e=False)
            p.note = f"cuDNN frontend graph ({e})"[:300]
            return p
    return prepare


def _sdpa_prepare(backend_name: str, case: Case, x: Inputs) -> Prepared:
    """SDPA on (B, H, S, D) views of the inputs; a trial call picks enable_gqa or repeated heads."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    if x.varlen:
        if backend_name == "CUDNN_ATTENTION":
            return _cudnn_graph_prepare(case, x, fp8=False, e2e=False)
        return _varlen_flash(case, x)
    backend = getattr(SDPBackend, backend_name)
    q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))  # (B, H, S, D) views

    def make(kk, vv, gqa):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=case.causal,
                                                      enable_gqa=gqa)
        return run

    gqa = case.heads != case.kv_heads
    run, note = make(k, v, gqa), ""
    try:
        run()
    except RuntimeError as e:
        if not gqa:
            if _no_kernel(e):
                raise NotApplicable(f"SDPA {backend_name}: {str(e).splitlines()[0]}") from e
            raise
        group = case.heads // case.kv_heads
        k2, v2 = (t.repeat_interleave(group, dim=1) for t in (k, v))
        run, note = make(k2, v2, False), "K/V heads repeated for GQA"
        try:
            run()
        except RuntimeError as e2:
            if _no_kernel(e2):
                raise NotApplicable(f"SDPA {backend_name}: {str(e2).splitlines()[0]}") from e2
            raise
    return Prepared(run, lambda o: o.transpose(1, 2), note)


def _varlen_flash(case: Case, x: Inputs) -> Prepared:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise NotApplicable("torch.nn.attention.varlen.varlen_attn not in this torch") from e
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {}
    if "is_causal" in params:
        kw["is_causal"] = case.causal
    elif case.causal:
        kw["window_size"] = (-1, 0)
    k, v, note = x.k, x.v, ""
    if case.heads != case.kv_heads:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            group = case.heads // case.kv_heads
            k, v = (t.repeat_interleave(group, dim=1) for t in (x.k, x.v))
            note = "K/V heads repeated for GQA"
    # FlashAttention-2's causal mask (window (-1, 0)) is aligned bottom-right, as flash-attn's
    return Prepared(lambda: varlen_attn(x.q, k, v, x.cu_seqlens, x.cu_seqlens_k, x.max_seqlen,
                                        x.max_seqlen_k, **kw), note=note)


# ----------------------------------------------------------------------- cuDNN frontend
def _cudnn_graph_prepare(case: Case, x: Inputs, *, fp8: bool, e2e: bool) -> Prepared:
    """cuDNN frontend SDPA on these inputs (see :mod:`leanfa.bench.cudnn_graphs`)."""
    cg = cudnn_graphs
    dev = x.q.device
    scale = case.head_dim ** -0.5
    ragged = x.varlen
    b = len(case.seqlens) if ragged else case.batch
    s = x.max_seqlen if ragged else case.seqlen
    s_k = x.max_seqlen_k if ragged else case.seqlen
    # a chunked-prefill batch (Sq < Sk) needs flash-attn's bottom-right causal alignment; cuDNN's
    # plain causal mask is top-left (the same only where Sq == Sk)
    bottom_right = case.causal and case.chunked
    try:
        graph = cg.get_graph(fp8=fp8, batch=b, heads=case.heads, kv_heads=case.kv_heads, seqlen=s,
                             seqlen_k=s_k, head_dim=case.head_dim, head_dim_v=case.head_dim_v,
                             causal=case.causal, bottom_right=bottom_right, softmax_scale=scale,
                             ragged=ragged, device=dev)
    except cg.Unsupported as e:
        why = "chunked batch (Sq < Sk) needs bottom-right causal: " if bottom_right else ""
        raise NotApplicable(why + str(e)) from e
    named: dict = {}
    if ragged:
        named.update(cg.ragged_tensors(x.cu_seqlens, case.heads, case.kv_heads, case.head_dim,
                                       case.head_dim_v, cu_seqlens_k=x.cu_seqlens_k))
    out_shape = x.q.shape[:-1] + (case.head_dim_v,)
    if not fp8:
        o = torch.empty(out_shape, dtype=torch.bfloat16, device=dev)
        named.update(q=x.q, k=x.k, v=x.v, o=o)
        pack = graph.variant_pack(named)

        def run_bf16():
            graph.execute(pack)
            return o
        return Prepared(run_bf16)

    q8, dq = cg.quantize_per_tensor(x.q)
    k8, dk = cg.quantize_per_tensor(x.k)
    v8, dv = cg.quantize_per_tensor(x.v)
    o8 = torch.empty(out_shape, dtype=FP8, device=dev)
    scale_o = cg.scalar(1.0, dev)
    amax_s, amax_o = cg.scalar(0.0, dev), cg.scalar(0.0, dev)
    named.update(q=q8, k=k8, v=v8, o=o8, descale_q=dq, descale_k=dk, descale_v=dv,
                 descale_s=cg.scalar(1.0 / cg.SCALE_S, dev), scale_s=cg.scalar(cg.SCALE_S, dev),
                 scale_o=scale_o, amax_s=amax_s, amax_o=amax_o)
    pack = graph.variant_pack(named)
    graph.execute(pack)  # calibration: amax(O) before scale_o, as delayed scaling would have it
    amax = float(amax_o.reshape(()))
    note = "per-tensor scales, FP8 output; scale_o from a calibration call's amax_o"
    if not (amax > 0 and amax < float("inf")):  # no usable amax: |O| <= max|V| always holds
        amax = float(x.v.abs().amax())
        note = "per-tensor scales, FP8 output; amax_o unusable, scale_o from amax(V)"
    scale_o.fill_(cg.FP8_MAX / max(amax, 1e-12))

    if not e2e:
        def run_kernel():
            graph.execute(pack)
            return o8
        return Prepared(run_kernel, lambda o: o.float() / scale_o.reshape(()), note)

    def run_e2e():
        for src, dst, desc in ((x.q, q8, dq), (x.k, k8, dk), (x.v, v8, dv)):
            x8, d = cg.quantize_per_tensor(src)
            dst.copy_(x8)
            desc.copy_(d)
        graph.execute(pack)
        return (o8.float() / scale_o.reshape(())).to(torch.bfloat16)
    return Prepared(run_e2e, note=note + "; quantization and dequantization timed")


def _cudnn_fp8(e2e: bool):
    def prepare(case: Case, x: Inputs) -> Prepared:
        return _cudnn_graph_prepare(case, x, fp8=True, e2e=e2e)
    return prepare


# -------------------------------------------------------------------- flash-attn 3 / 4, FlashInfer
def _fa3(fp8: bool):
    """FlashAttention-3 (see :mod:`leanfa.bench.fa3`): BF16, or FP8 quantized beforehand with
    per-(sequence, KV head) descales; dense and varlen."""
    def prepare(case: Case, x: Inputs) -> Prepared:
        try:
            run, note = fa3.call(case, x, fp8)
        except ImportError as e:
            raise NotApplicable(str(e)) from e

        def guarded():
            try:
                return run()
            except RuntimeError as e:
                if fa3.unsupported(e):
                    raise NotApplicable(f"FA3: {str(e).splitlines()[0]}") from e
                raise
        return Prepared(guarded, note=note)
    return prepare


def _fa4(case: Case, x: Inputs) -> Prepared:
    from flash_attn.cute import interface as fa4

    if x.varlen:
        raise NotApplicable("varlen not wired for flash-attn 4 here")
    return Prepared(lambda: fa4.flash_attn_func(x.q, x.k, x.v, causal=case.causal)[0])


def _flashinfer(case: Case, x: Inputs) -> Prepared:
    import flashinfer

    dev = x.q.device
    if x.varlen:
        indptr, kv_indptr = x.cu_seqlens, x.cu_seqlens_k  # FlashInfer's causal is bottom-right too
        q, k, v = x.q, x.k, x.v
    else:
        b, s = case.batch, case.seqlen
        indptr = kv_indptr = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
        q, k, v = (t.reshape(b * s, t.shape[2], t.shape[3]) for t in (x.q, x.k, x.v))
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, kv_indptr, case.heads, case.kv_heads, case.head_dim, head_dim_vo=case.head_dim_v,
           causal=case.causal, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    shape = x.q.shape[:-1] + (case.head_dim_v,)
    return Prepared(lambda: w.run(q, k, v), lambda o: o.reshape(shape))


# ---------------------------------------------------------------------------- registry
def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None on a machine without one."""
    try:
        if torch.cuda.is_available():
            return capability(torch.device("cuda"))
    except Exception:
        pass
    return None


def _needs_gpu(hopper: bool = False, then: Callable[[], tuple[bool, str]] | None = None):
    """An ``available`` check: a CUDA GPU (``hopper``: of compute capability 9.x, what
    wgmma/TMA kernels need), then ``then()`` (a module or library check)."""
    def available() -> tuple[bool, str]:
        cap = cuda_capability()
        if cap is None:
            return False, "needs a CUDA GPU; none found"
        if hopper and cap[0] != 9:
            return False, f"needs a Hopper GPU (sm90); this one is sm{cap[0]}{cap[1]}"
        return then() if then is not None else (True, "")
    return available


_cuda_sdpa_available = _needs_gpu()


def all_impls() -> list[Impl]:
    impls: list[Impl] = []
    for b in LEANFA_BACKENDS:
        # the portable kernel also runs on CPU tensors under Triton's interpreter (the CPU tests)
        ok = _needs_gpu(hopper=True, then=_leanfa_available) if b == "hopper" else _leanfa_available
        impls += [
            Impl(f"leanfa-{b}-fp8", "leanfa", "fp8", "e2e",
                 f"leanfa.attention(precision='fp8', backend='{b}'): quantization + kernel",
                 _leanfa_fp8_e2e(b), ok),
            Impl(f"leanfa-{b}-fp8-sink", "leanfa", "fp8", "e2e",
                 f"leanfa.attention(precision='fp8', bf16_sink_keys=128, backend='{b}'): "
                 + ("sink keys inside the FP8 kernel" if b == "portable" else "BF16 and FP8 calls merged by LSE"),
                 _leanfa_fp8_sink(b), ok),
            Impl(f"leanfa-{b}-fp8qk", "leanfa", "fp8", "e2e",
                 f"leanfa.attention(precision='fp8qk', backend='{b}'): FP8 Q·K, BF16 P·V (the mixed mode)",
                 _leanfa_fp8_e2e(b, "fp8qk"), ok),
            Impl(f"leanfa-{b}-fp8-kernel", "leanfa", "fp8", "kernel",
                 f"flash_attn_func(quantize_fp8(q, k, v), backend='{b}'): kernel alone",
                 _leanfa_fp8_kernel(b), ok),
            Impl(f"leanfa-{b}-bf16", "leanfa", "bf16", "kernel",
                 f"flash_attn_func(bf16, backend='{b}')", _leanfa_bf16(b), ok),
            Impl(f"leanfa-{b}-fp8-kvhead-kernel", "leanfa", "fp8", "kernel",
                 f"flash_attn_(varlen_)func on e4m3 Q/K/V, descales per (sequence, KV head), backend='{b}': "
                 "kernel alone (the paged FP8 rows' contiguous baseline; opt-in)",
                 _leanfa_fp8_kvhead_kernel(b), ok, default=False),
        ]
        for ps in PAGE_SIZES:
            impls += [
                Impl(f"leanfa-{b}-bf16-paged{ps}", "leanfa", "bf16", "kernel",
                     f"flash_attn_varlen_func(bf16, page_table=, backend='{b}'): K/V in shuffled {ps}-token pages "
                     "(packed batches; opt-in)", _leanfa_bf16_paged(b, ps), ok, default=False),
                Impl(f"leanfa-{b}-fp8-paged{ps}-kernel", "leanfa", "fp8", "kernel",
                     f"as leanfa-{b}-fp8-kvhead-kernel with K/V in shuffled {ps}-token pages (packed batches; "
                     "opt-in; hopper: the per-call transposed copy of the V pages included)",
                     _leanfa_fp8_kvhead_kernel(b, ps), ok, default=False),
                Impl(f"leanfa-{b}-bf16-paged{ps}-vllm", "leanfa", "bf16", "kernel",
                     f"leanfa-{b}-bf16-paged{ps} as vLLM calls it: seqused_k, cu_seqlens_k=None (opt-in)",
                     _leanfa_bf16_paged(b, ps, vllm=True), ok, default=False),
                Impl(f"leanfa-{b}-fp8-paged{ps}-vllm", "leanfa", "fp8", "kernel",
                     f"leanfa-{b}-fp8-paged{ps}-kernel as vLLM calls it: seqused_k, cu_seqlens_k=None (opt-in)",
                     _leanfa_fp8_kvhead_kernel(b, ps, vllm=True), ok, default=False),
            ]
            if b == "hopper":
                impls.append(Impl(f"leanfa-hopper-fp8-paged{ps}-launch", "leanfa", "fp8", "kernel",
                                  f"leanfa-hopper-fp8-paged{ps}-kernel's Hopper launch alone, its V pages' transposed "
                                  "copy made before the timing (packed batches; opt-in)",
                                  _leanfa_hopper_fp8_paged_launch(ps), ok, default=False))
    impls += [
        Impl("cudnn-bf16", "cudnn", "bf16", "kernel", "torch SDPA, CUDNN_ATTENTION backend",
             _sdpa("CUDNN_ATTENTION"), _cuda_sdpa_available, baseline=True),
        Impl("cudnn-fp8", "cudnn", "fp8", "kernel",
             "cuDNN frontend sdpa_fp8, per-tensor scales, FP8 output (kernel alone)",
             _cudnn_fp8(False), _needs_gpu(then=cudnn_graphs.available), baseline=True),
        Impl("cudnn-fp8-e2e", "cudnn", "fp8", "e2e",
             "cudnn-fp8 plus per-tensor quantization of Q/K/V and dequantized BF16 output",
             _cudnn_fp8(True), _needs_gpu(then=cudnn_graphs.available)),
        Impl("sdpa-flash-bf16", "sdpa-flash", "bf16", "kernel",
             "torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)", _sdpa("FLASH_ATTENTION"),
             _cuda_sdpa_available),
        Impl("fa3-bf16", "fa3", "bf16", "kernel",
             "FlashAttention-3 flash_attn_func / flash_attn_varlen_func (fa3_fwd_interface)",
             _fa3(False), _needs_gpu(hopper=True, then=fa3.available)),
        Impl("fa3-fp8", "fa3", "fp8", "kernel",
             "FlashAttention-3 on e4m3 inputs, descales per (sequence, KV head) (kernel alone)",
             _fa3(True), _needs_gpu(hopper=True, then=fa3.available)),
        Impl("flashinfer-bf16", "flashinfer", "bf16", "kernel",
             "flashinfer BatchPrefillWithRaggedKVCacheWrapper", _flashinfer,
             _needs_gpu(then=lambda: _module_available("flashinfer"))),
        Impl("fa4-bf16", "fa4", "bf16", "kernel", "flash_attn.cute.interface.flash_attn_func (FA4)",
             _fa4, _needs_gpu(then=lambda: _module_available("flash_attn.cute"))),
    ]
    return impls


def select(impls: list[Impl], patterns=None, precisions=None) -> list[Impl]:
    """Impls whose name or family matches one of ``patterns`` (shell globs, e.g.
    ``leanfa-*``; None: those with ``default``) and whose precision is in ``precisions`` (None: all)."""
    out = []
    for impl in impls:
        if precisions and impl.precision not in precisions:
            continue
        if not patterns and not impl.default:
            continue
        if patterns and not any(fnmatch.fnmatch(impl.name, p) or impl.family == p for p in patterns):
            continue
        out.append(impl)
    return out


def baseline_for(precision: str) -> str:
    """The name of the row a row of ``precision`` is compared to."""
    return {"fp8": "cudnn-fp8", "bf16": "cudnn-bf16"}[precision]
