"""The GEMM rates every attention speed is reported against, measured in the same run.

* ``bf16``: cuBLAS ``torch.matmul`` of two 8192x8192 BF16 matrices;
* ``fp8``: ``torch._scaled_mm`` of two 8192x8192 e4m3 matrices (B column-major, as cuBLASLt
  requires) with float32 per-tensor scales, BF16 output, ``use_fast_accum=True`` (the
  fastest FP8 GEMM cuBLAS offers: the peak an attention kernel could hope for).

Each is timed like the attention rows (:func:`leanfa.bench.timing.time_calls`) with the NVML
sampler running, so its SM clock and power are recorded too: under the power cap the GEMMs
run at a lower clock than attention does (docs/design.md §1.3).
"""

from __future__ import annotations

import torch

from .power import NvmlSampler
from .timing import time_calls

GEMM_N = 8192


def _operands(dtype, n, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32)
    b = torch.randn(n, n, generator=gen, device=device, dtype=torch.float32)
    return a.to(dtype), b.to(dtype)


def gemm_rates(*, n: int = GEMM_N, device="cuda", warmup_ms: float = 200.0, rep_ms: float = 500.0,
               seed: int = 0, device_index: int = 0) -> dict:
    """``{"bf16": {...}, "fp8": {...}}`` with tflops, time and clock/power of each GEMM
    (an entry holds ``error`` instead where that GEMM could not run)."""
    flop = 2.0 * n ** 3
    out: dict = {}

    def measure(name, make):
        try:
            fn = make()
            sampler = NvmlSampler(device_index)
            t = time_calls([fn], warmup_ms=warmup_ms, rep_ms=rep_ms, min_reps=10, sampler=sampler)
            out[name] = {"tflops": flop / (t.median_ms * 1e-3) / 1e12, **t.to_dict(),
                         **sampler.summary(), "n": n}
        except Exception as e:  # e.g. no FP8 GEMM on this GPU
            out[name] = {"error": f"{type(e).__name__}: {e}", "n": n}

    def bf16_gemm():
        a, b = _operands(torch.bfloat16, n, device, seed)
        return lambda: torch.matmul(a, b)

    def fp8_gemm():
        a8, b8 = _operands(torch.float8_e4m3fn, n, device, seed)
        b8t = b8.t()  # (N, K) row-major seen as (K, N) column-major, as cuBLASLt wants
        one = torch.ones((), dtype=torch.float32, device=device)
        return lambda: torch._scaled_mm(a8, b8t, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    measure("bf16", bf16_gemm)
    measure("fp8", fp8_gemm)
    if "tflops" in out.get("fp8", {}):
        out["fp8"]["use_fast_accum"] = True
    return out
