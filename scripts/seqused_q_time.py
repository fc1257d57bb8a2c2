#!/usr/bin/env python
"""What ``seqused_q`` costs on the Hopper kernel (GPU): the same calls with and without it, in one process.

    python scripts/seqused_q_time.py [--rounds 5]

FlashAttention-3's varlen form passes ``seqused_q`` equal to the lengths; a call with ``seqused_q`` also writes the
rows past it (as 0, LSE -inf) from the kernel's epilogue. Each row times, through
the public API with ``backend="hopper"`` (FP8 inputs quantized beforehand), the call with ``seqused_k`` alone and the
call with ``seqused_k`` and ``seqused_q`` (both equal to the lengths, so the work is the same), in interleaved rounds
(``triton.testing.do_bench`` median per round); the ratio is time without / time with, its median reported with the
SM clock. The two outputs are compared first (the used rows are all the rows here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import leanfa  # noqa: E402
from leanfa.bench.power import sm_clock_mhz  # noqa: E402
from leanfa.bench.shapes import VARLEN_SEQLENS  # noqa: E402

#: (name, fp8, lengths or None for dense, dense batch x length)
ROWS = (
    ("fp8 d128 causal varlen mix16k", True, VARLEN_SEQLENS, None),
    ("bf16 d128 causal varlen mix16k", False, VARLEN_SEQLENS, None),
    ("fp8 d128 causal dense 4x4K", True, None, (4, 4096)),
    ("bf16 d128 causal dense 4x4K", False, None, (4, 4096)),
    ("fp8 d128 causal dense 1x16K", True, None, (1, 16384)),
)
HEADS, DIM = (32, 8), 128


def calls(fp8: bool, lens, dense):
    """``{"seqused_k": fn, "seqused_k+q": fn}`` over the same inputs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv = HEADS
    if lens is not None:
        total, s = sum(lens), max(lens)
        shapes = ((total, hq, DIM), (total, hkv, DIM), (total, hkv, DIM))
        cu = torch.tensor((0,) + tuple(lens), device="cuda").cumsum(0).to(torch.int32)
        used = torch.tensor(lens, dtype=torch.int32, device="cuda")
        geom = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
    else:
        b, s = dense
        shapes = ((b, s, hq, DIM), (b, s, hkv, DIM), (b, s, hkv, DIM))
        used, geom = torch.full((b,), s, dtype=torch.int32, device="cuda"), {}
    q, k, v = (torch.randn(*x, device="cuda", generator=g).to(torch.bfloat16) for x in shapes)
    fn = leanfa.flash_attn_varlen_func if lens is not None else leanfa.flash_attn_func
    args = (leanfa.quantize_fp8(q, k, v, **geom), None, None) if fp8 else (q, k, v)
    if lens is not None:
        args = args + tuple(geom.values())
    return {"seqused_k": lambda: fn(*args, causal=True, seqused_k=used, backend="hopper"),
            "seqused_k+q": lambda: fn(*args, causal=True, seqused_k=used, seqused_q=used, backend="hopper")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"{'row':34s} {'ms usedk':>9s} {'ms usedk+q':>11s} {'ratio':>6s} {'max|diff|':>9s} {'SM MHz':>6s}")
    for name, fp8, lens, dense in ROWS:
        fns = calls(fp8, lens, dense)
        a, b = (f() for f in fns.values())
        diff = float((a.float() - b.float()).abs().max())
        times = {n: [] for n in fns}
        for _ in range(args.rounds):
            for n, f in fns.items():
                times[n].append(do_bench(f, warmup=25, rep=100))
        ratio = statistics.median(x / y for x, y in zip(times["seqused_k"], times["seqused_k+q"]))
        print(f"{name:34s} {statistics.median(times['seqused_k']):9.3f} {statistics.median(times['seqused_k+q']):11.3f}"
              f" {ratio:6.3f} {diff:9.2e} {sm_clock_mhz() or 0:6d}")


if __name__ == "__main__":
    main()
