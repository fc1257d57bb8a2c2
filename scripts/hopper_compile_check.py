#!/usr/bin/env python
"""Compile every Hopper kernel variant for sm90 on a machine without a GPU (AOT), and print
registers / spills / shared memory per variant; fail if a variant does not compile, spills
(beyond :func:`spill_budget`), exceeds shared memory, has no ``wgmma.mma_async`` in its PTX, or
has its wgmmas serialized by ptxas (C7512). The spill budgets are those of the GPU-validated Triton
(leanfa/_versions.py): with another Triton, spills over budget are listed (``spills>budget``) but do not fail.

    python scripts/hopper_compile_check.py            # all variants
    python scripts/hopper_compile_check.py -k bf16    # names containing "bf16"
    python scripts/hopper_compile_check.py --defaults # only what backend="auto" runs (CI, every Triton)
    python scripts/hopper_compile_check.py --dump DIR # also write ttgir/ptx per variant
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from leanfa import _versions  # noqa: E402
from leanfa.kernels.hopper import launch as L  # noqa: E402
from leanfa.kernels.hopper.gluon_aot import Variant, compile_variant  # noqa: E402

SMEM_LIMIT = 227 * 1024


def variants():
    out = []
    for dtype, (dqk, dv), causal in itertools.product(("fp8", "bf16"), ((128, 128), (192, 128)), (True, False)):
        out.append(Variant(dtype, dqk, dv, causal))
    out.append(Variant("fp8", 128, 128, True, return_lse=True, k_mean=True))
    out.append(Variant("bf16", 128, 128, True, return_lse=True))
    out.append(Variant("bf16", 128, 128, True, v_kmajor=True))
    out.append(Variant("fp8", 192, 128, True, return_lse=True, out_dtype=torch.float32))
    # the mixed mode (FP8 Q·K, BF16 P·V: attention(precision="fp8qk")), what backend="auto" runs of it
    for (dqk, dv), causal in itertools.product(((128, 128), (192, 128)), (True, False)):
        out.append(Variant("mixed", dqk, dv, causal))
    out.append(Variant("mixed", 128, 128, True, return_lse=True, k_mean=True))
    for (dqk, dv), causal in (((64, 64), True), ((256, 256), True), ((128, 128), True), ((192, 128), False)):
        out.append(Variant("mixed", dqk, dv, causal, return_lse=dqk == 256, varlen=dqk in (128, 192)))
    # paged K/V (16-bit V caches): 64-key pages (two boxes per key block), 128 (one), 16 (eight), dense q over the
    # whole table, head dim 256 (BF16 64-key blocks from 128-key pages), the mixed mode
    for dtype, d, page_size, varlen in (("bf16", 128, 64, True), ("bf16", 128, 128, True), ("bf16", 64, 16, True),
                                        ("bf16", 128, 64, False), ("bf16", 256, 128, True), ("mixed", 128, 64, True)):
        out.append(Variant(dtype, d, d, True, varlen=varlen, page_size=page_size))
    # paged FP8 K/V: K page by page, V from its pages' dense transposed copy (one box per key block): varlen 64-key
    # and 128-key pages, 16 (eight K boxes), dense q over the whole table, non-causal, head dims 64 and 256
    for d, page_size, varlen, causal in ((128, 64, True, True), (128, 128, True, True), (128, 16, True, True),
                                         (128, 64, False, True), (128, 128, True, False), (64, 64, True, True),
                                         (256, 128, True, True)):
        out.append(Variant("fp8", d, d, causal, varlen=varlen, page_size=page_size))
    # sliding windows (WINDOW: the band's key blocks only): causal windows, the general band, varlen, head dims
    for dtype, (dqk, dv), causal, window, varlen in (
            ("fp8", (128, 128), True, (4096, -1), False), ("bf16", (128, 128), True, (4096, -1), False),
            ("mixed", (128, 128), True, (4096, -1), False), ("fp8", (128, 128), False, (256, 256), False),
            ("bf16", (128, 128), False, (-1, 256), False), ("fp8", (128, 128), True, (4096, -1), True),
            ("bf16", (128, 128), True, (4096, -1), True), ("fp8", (192, 128), True, (4096, -1), False),
            ("bf16", (64, 64), True, (4096, -1), False), ("bf16", (256, 256), True, (4096, -1), False),
            ("mixed", (256, 256), True, (4096, -1), False)):  # (FP8 d256 windows stay portable: ~550 B spills)
        out.append(Variant(dtype, dqk, dv, causal, varlen=varlen, window=window))
    # softcap (SOFTCAP: one MUFU.TANH per score; with a smoothed K, k_mean, q . mean inside tanh's argument)
    nw = (-1, -1)  # no window
    for dtype, (dqk, dv), causal, lse, kmean, varlen, window in (
            ("fp8", (128, 128), True, False, False, False, nw), ("fp8", (128, 128), True, True, True, False, nw),
            ("fp8", (128, 128), False, False, True, False, nw), ("fp8", (128, 128), True, True, True, True, nw),
            ("bf16", (128, 128), True, False, False, False, nw), ("bf16", (128, 128), False, True, False, False, nw),
            ("bf16", (128, 128), True, False, False, True, nw), ("mixed", (128, 128), True, True, True, False, nw),
            ("fp8", (128, 128), True, False, True, False, (4096, -1)),
            ("bf16", (128, 128), True, False, False, False, (4096, -1)),
            ("fp8", (192, 128), True, False, True, False, nw), ("bf16", (192, 128), True, False, False, False, nw),
            ("fp8", (64, 64), True, False, True, False, nw), ("bf16", (64, 64), True, False, False, False, nw),
            ("fp8", (256, 256), True, True, True, False, nw), ("bf16", (256, 256), True, True, False, False, nw),
            ("mixed", (256, 256), True, False, True, False, nw)):
        out.append(Variant(dtype, dqk, dv, causal, return_lse=lse, k_mean=kmean, varlen=varlen, window=window,
                           softcap=30.0))
    # sliding windows over paged K/V (the band's absolute key blocks through the page table)
    for dtype, d, page_size, varlen in (("bf16", 128, 64, True), ("bf16", 128, 128, False), ("mixed", 128, 64, True),
                                        ("fp8", 128, 64, True), ("fp8", 128, 128, False)):
        out.append(Variant(dtype, d, d, True, varlen=varlen, page_size=page_size, window=(4096, -1)))
    # FA3's seqused_k (the kernel's seqused_k in _tile: packed K and dense; paged varlen reads the lengths as its
    # cu_seqlens_k, so its kernel is the paged variant's)
    for dtype, varlen, page_size in (("fp8", True, 0), ("bf16", True, 0), ("fp8", False, 0), ("bf16", False, 0),
                                     ("bf16", True, 64), ("fp8", True, 64), ("fp8", False, 64)):
        out.append(Variant(dtype, 128, 128, True, varlen=varlen, page_size=page_size, seqused_k=True))
    # FA3's seqused_q (the kernel's seqused_q in _tile; the rows past it written as 0 in the epilogue)
    for dtype, varlen in (("fp8", True), ("bf16", True), ("fp8", False), ("bf16", False)):
        out.append(Variant(dtype, 128, 128, True, varlen=varlen, seqused_k=True, seqused_q=True))
    # the default knobs above; below varlen, the other head dims, the sink and the measured options
    for dtype, causal in (("fp8", True), ("fp8", False), ("bf16", True), ("bf16", False)):  # head dim 64
        out.append(Variant(dtype, 64, 64, causal))
    for dtype, causal in (("fp8", True), ("fp8", False), ("bf16", True), ("bf16", False)):  # head dim 256
        out.append(Variant(dtype, 256, 256, causal, return_lse=causal))
    out.append(Variant("fp8", 256, 256, True, return_lse=True, k_mean=True))
    out.append(Variant("fp8", 256, 256, True, varlen=True))
    for d, causal, lse, varlen in ((128, True, True, False), (128, False, False, False), (128, True, False, True),
                                   (64, True, True, False)):  # BF16 sink keys (K smoothed: k_mean)
        out.append(Variant("fp8", d, d, causal, return_lse=lse, k_mean=True, varlen=varlen, sink=True))
    for dtype, dqk in (("fp8", 128), ("bf16", 128), ("bf16", 192)):
        out.append(Variant(dtype, dqk, 128, True, varlen=dtype == "bf16"))
    out.append(Variant("fp8", 128, 128, True, varlen=True))  # V re-packed, its starts from a table
    out.append(Variant("fp8", 192, 128, False, varlen=True))
    for dtype in ("fp8", "bf16"):  # the clock trace (scripts/hopper_trace.py)
        out.append(Variant(dtype, 128, 128, True, env=(("LEANFA_HOPPER_TRACE", 1),)))
    out.append(Variant("fp8", 128, 128, True, env=(("LEANFA_HOPPER_PERSISTENT", 1),)))
    tma_store = (("LEANFA_HOPPER_STORE_TMA", 1),)  # FP8 output through shared memory and TMA (epilogue.py)
    for dqk, dv, causal, lse in ((128, 128, True, False), (128, 128, False, True), (192, 128, True, True),
                                 (64, 64, True, False)):
        out.append(Variant("fp8", dqk, dv, causal, return_lse=lse, k_mean=lse, env=tma_store))
    out.append(Variant("fp8", 128, 128, True, env=tma_store + (("LEANFA_HOPPER_PERSISTENT", 1),)))
    bf16_tma = (("LEANFA_HOPPER_STORE_TMA", 2),)  # BF16 through the same epilogue (until GPU-validated: =2)
    for d, causal, lse, persistent in ((128, True, False, 0), (128, False, True, 0), (128, True, False, 1),
                                       (64, True, False, 1)):
        out.append(Variant("bf16", d, d, causal, return_lse=lse,
                           env=bf16_tma + (("LEANFA_HOPPER_PERSISTENT", persistent),)))
    return list({v.name: v for v in out}.values())  # each variant once


def spill_budget(v: Variant) -> int:
    """Bytes of spills accepted: the consumers (240 registers) may spill a few outside the key loop
    (tests/test_hopper.py allows 64); the persistent grid's ~330 B (the FP8 default since the tenth session; BF16
    128/128's since the twelfth, 68-120 B) are tile-invariant epilogue addresses LLVM hoists out of the tile loop
    (docs/perf-notes.md)."""
    if v.sink and v.return_lse:  # the LSE's q . mean from the 16-bit Q next to O and the row state (epilogue)
        return 256
    if v.dtype == "fp8" and v.dv == 256:  # 128-key blocks next to a 128-register O (run 42: 1.07-1.24x
        return 160                        # the spill-free 64-key blocks, launch.wide_head): 52-80 B, and
                                          # 116-132 B with the LSE's K-mean term (epilogue)
    env = dict(v.env)
    persistent = env.get("LEANFA_HOPPER_PERSISTENT")
    if persistent is None:  # the default (launch.persistent_default)
        persistent = L.persistent_default(v.dtype in ("fp8", "mixed"), int(v.sink), v.dv,
                                          has_kmean=v.k_mean and v.return_lse and not v.softcap, dqk=v.dqk,
                                          fp8_softcap=v.softcap > 0 and v.dtype == "fp8")
    return 400 if persistent else 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", default="", help="only variants whose name contains this")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--defaults", action="store_true",
                    help="only the variants with no knob set: those backend='auto' runs")
    a = ap.parse_args()
    bad = 0
    print(f"{'variant':56s} {'regs':>5s} {'spill':>9s} {'smem':>8s} {'wgmma':>6s} {'time':>6s}  status")
    todo = [v for v in variants() if a.k in v.name]
    if a.defaults:
        todo = [v for v in todo if not v.env]
    for v in todo:
        t0 = time.time()
        try:
            r = compile_variant(v)
        except Exception as e:  # noqa: BLE001
            bad += 1
            print(f"{v.name:56s} COMPILE ERROR: {type(e).__name__}: {str(e).splitlines()[-1][:200]}")
            traceback.print_exc(limit=1)
            continue
        problems, notes = [], []
        if max(r.spill_stores, r.spill_loads) > spill_budget(v):
            if _versions.triton_gpu_validated():
                problems.append("SPILLS")
            else:
                notes.append(f"spills>budget({spill_budget(v)})")
        if r.shared > SMEM_LIMIT:
            problems.append("SMEM>227K")
        if r.wgmma_ptx == 0:
            problems.append("NO-WGMMA")
        if any("serialized" in w for w in r.perf_warnings):
            problems.append("WGMMA-SERIALIZED")
        bad += bool(problems)
        print(f"{r.name:56s} {r.regs:5d} {r.spill_stores:4d}/{r.spill_loads:<4d} {r.shared:8d} {r.wgmma_ptx:6d} "
              f"{time.time() - t0:5.1f}s  {' '.join(problems) or 'ok'}{''.join(' ' + n for n in notes)}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            base = os.path.join(a.dump, r.name.replace("/", "_"))
            open(base + ".ttgir", "w").write(r.ttgir)
            open(base + ".ptx", "w").write(r.ptx)
    if not _versions.triton_gpu_validated():
        print(f"(triton {_versions.installed()['triton']} is not GPU-validated: spill budgets not enforced)")
    print("ALL OK" if not bad else f"{bad} variant(s) FAILED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
