#!/usr/bin/env python
"""GPU time of the FP8 varlen V re-pack (``hopper/varlen_v.py``) per program tile, against the PyTorch ops it
replaced (the eighth session's ``align_varlen_v``: a ``searchsorted`` per token, a byte-wise ``index_copy_``),
and of the whole varlen FP8 call; every tile's output checked byte for byte against the PyTorch version.

    python scripts/varlen_v_time.py

Run 55 read ~1 ms for the first kernel (one 128-row x 64-byte tile per program), but on lane 0 next to a
lane compiling the GPU tests: a short op's do_bench time there includes the host's delay in launching it.
Run 56 (one lane) timed that tile at 0.12-0.15 ms and 4 x 512 at 0.03 (now the default). Time this on one
lane. Shapes: B x S packed (d128, 16 KV heads) and the bench's
uneven batch (8 sequences, 16K tokens, 8 KV heads).
"""

from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import leanfa  # noqa: E402
from leanfa.bench.shapes import VARLEN_SEQLENS  # noqa: E402
from leanfa.kernels.hopper import varlen_v  # noqa: E402

TILES = [(128, 64), (1, 1024), (4, 512), (8, 256), (16, 128), (32, 128)]


def repack_torch(v, cu_seqlens_k, align=16):
    """The eighth session's re-pack (PyTorch ops), for the comparison."""
    total, H, Dv = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    cu = cu_seqlens_k.to(torch.int64)
    padded = (cu[1:] - cu[:-1] + align - 1) // align * align
    cu_v = torch.nn.functional.pad(padded.cumsum(0), (1, 0))
    tokens = torch.arange(total, device=v.device)
    seq = torch.searchsorted(cu[1:], tokens, right=True)
    dest = tokens - cu[seq] + cu_v[seq]
    room = -(-(total + (align - 1) * batch) // align) * align
    out = torch.zeros((H, Dv, max(room, align)), dtype=torch.uint8, device=v.device)
    out.index_copy_(2, dest, v.permute(1, 2, 0).view(torch.uint8))
    return out.view(v.dtype).permute(2, 0, 1), cu_v.to(torch.int32)


def main():
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    cases = [(f"{b}x{s}", [s] * b, 16) for b, s in ((16, 1024), (4, 4096), (1, 16384))]
    cases.append(("uneven8", list(VARLEN_SEQLENS), 8))
    print(f"{'case':>10s} {'MB':>5s} {'impl':>14s} {'GPU ms':>8s} {'GB/s':>7s}  check")
    for name, lens, hkv in cases:
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        total, mx = int(cu[-1]), max(lens)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(total, h, 128, device="cuda", generator=g).to(torch.bfloat16) for h in (2 * hkv, hkv, hkv))
        qq = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx)
        mb = qq.v.numel() / 1e6
        ref, ref_cu = repack_torch(qq.v, cu)
        ms = do_bench(lambda: repack_torch(qq.v, cu), return_mode="median")
        print(f"{name:>10s} {mb:5.1f} {'torch ops':>14s} {ms:8.3f} {2 * mb / ms:7.0f}", flush=True)
        for tile in TILES:
            out, cu_v = varlen_v.align_varlen_v(qq.v, cu, mx, tile=tile)
            ok = torch.equal(cu_v, ref_cu) and torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
            ms = do_bench(lambda: varlen_v.align_varlen_v(qq.v, cu, mx, tile=tile), return_mode="median")
            print(f"{name:>10s} {mb:5.1f} {str(tile):>14s} {ms:8.3f} {2 * mb / ms:7.0f}  {'ok' if ok else 'MISMATCH'}",
                  flush=True)
        call = lambda: leanfa.flash_attn_varlen_func(qq.q, qq.k, qq.v, cu, cu, mx, mx, causal=True,  # noqa: E731
                                                    **qq.descales())
        ms = do_bench(call, return_mode="median")
        print(f"{name:>10s} {mb:5.1f} {'varlen call':>14s} {ms:8.3f}  (default tile {varlen_v.GPU_TILE})", flush=True)


if __name__ == "__main__":
    main()
