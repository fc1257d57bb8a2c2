"""Where the FP8 end-to-end path spends its time beyond the kernel (GPU).

    python scripts/quant_time.py [--seqlens 4096,16384] [--dims 128/128,192/128]

For each shape (causal, B·S = 16K tokens, 16 heads): ``leanfa.attention(precision="fp8")``,
``quantize_fp8`` alone and the Hopper kernel alone (median ms, ``triton.testing.do_bench``), then one
``quantize_fp8`` call under ``torch.profiler``: every CUDA kernel it launches with its device time,
and the quantizer's bytes over that time against the bytes it must move (read Q, K, V; write
FP8 Q, K, V^T; the statistics pass reads K and V once more).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import leanfa


def _bytes(q, k, v) -> tuple[int, int]:
    """(must move, moves with the statistics pass): BF16 reads, FP8 writes."""
    once = sum(x.numel() * x.element_size() for x in (q, k, v)) + sum(x.numel() for x in (q, k, v))
    return once, once + sum(x.numel() * x.element_size() for x in (k, v))


def _kernels(fn, calls: int = 5) -> list[tuple[str, float]]:
    """(kernel name, mean device µs per call) of every CUDA kernel ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / calls) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--dims", default="128/128,192/128")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for dims in args.dims.split(","):
        dqk, dv = map(int, dims.split("/"))
        for s in map(int, args.seqlens.split(",")):
            b, h = max(1, 16384 // s), 16
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, s, h, dqk, device="cuda", generator=g).to(torch.bfloat16)
            k = torch.randn(b, s, h, dqk, device="cuda", generator=g).to(torch.bfloat16)
            v = torch.randn(b, s, h, dv, device="cuda", generator=g).to(torch.bfloat16)
            qq = leanfa.quantize_fp8(q, k, v)
            kw = qq.descales()
            t_e2e = do_bench(lambda: leanfa.attention(q, k, v, causal=True, precision="fp8"), return_mode="median")
            t_quant = do_bench(lambda: leanfa.quantize_fp8(q, k, v), return_mode="median")
            t_kernel = do_bench(lambda: leanfa.flash_attn_func(qq.q, qq.k, qq.v, causal=True, **kw),
                                return_mode="median")
            need, moved = _bytes(q, k, v)
            print(f"\nB{b} S{s} H{h} d{dqk}/{dv} causal: attention(fp8) {t_e2e:.3f} ms = quantize {t_quant:.3f} + "
                  f"kernel {t_kernel:.3f} + other {t_e2e - t_quant - t_kernel:+.3f}")
            print(f"  quantize: {need / 1e6:.0f} MB must move ({moved / 1e6:.0f} MB with the statistics pass): "
                  f"{moved / t_quant / 1e9:.2f} TB/s achieved")
            for name, us in _kernels(lambda: leanfa.quantize_fp8(q, k, v)):
                print(f"    {us:8.1f} us  {name[:90]}")


if __name__ == "__main__":
    main()
