"""An equal-length packed batch against leanfa's own dense kernel on the same tokens, kernel alone (GPU).

    python scripts/equal_length_time.py [--batches 4x4096,2x8192,16x1024] [--heads 32/8]

Issue 22's second target: the varlen call of ``B`` sequences of ``S`` tokens runs >= 0.95x the dense
``(B, S)`` call. Both are timed as the Hopper kernel's launch alone (plans built once; the varlen one with its
tile table made beforehand, as ``varlen_schedule`` does for a step), FP8 (inputs quantized by
``quantize_fp8``, the packed V in its aligned layout) and BF16, causal, d128, and FlashAttention-3's varlen call
on the same tokens when its module is importable. Each row is checked against the dense call's output first
(the same tokens must give the same result up to FP8 rounding of different scale blocks). The SM clock
(NVML) is printed beside each row.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import leanfa
from leanfa.api import _build_problem
from leanfa.bench import fa3, power
from leanfa.kernels import hopper


def kernel_ms(problem) -> tuple[float, torch.Tensor]:
    plan, out, _ = hopper.plan(problem)
    launch = lambda: hopper._launch.launch(plan)  # noqa: E731
    launch()
    torch.cuda.synchronize()
    return do_bench(launch, warmup=100, rep=400, return_mode="median"), out


def problem_of(q, k, v, causal, varlen=False, cu=None, s=None, **kw):
    return _build_problem(q, k, v, varlen=varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                          softmax_scale=None, causal=causal, return_lse=False, out_dtype=None,
                          **{"q_descale": None, "k_descale": None, "v_descale": None, "k_mean": None, **kw})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="4x4096,2x8192,16x1024")
    ap.add_argument("--heads", default="32/8")
    args = ap.parse_args()
    hq, hkv = map(int, args.heads.split("/"))
    d = 128
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  heads {hq}/{hkv} d{d} causal")
    print(f"{'batch':>8s} {'dtype':5s} {'dense ms':>9s} {'varlen ms':>9s} {'varlen/dense':>12s} "
          f"{'FA3 varlen ms':>13s} {'TF/s dense':>10s} {'TF/s varlen':>11s} {'max|diff|':>9s} {'SM MHz':>6s}")
    for shape in args.batches.split(","):
        b, s = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(b * 7 + s)
        q = torch.randn(b, s, hq, d, device="cuda", generator=g).to(torch.bfloat16)
        k, v = (torch.randn(b, s, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        flat = [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)]
        flops = 4 * b * s * s * hq * d / 2  # causal: half the score matrix
        for dtype in ("fp8", "bf16"):
            if dtype == "fp8":
                dq = leanfa.quantize_fp8(q, k, v)
                vq = leanfa.quantize_fp8(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
                dense = problem_of(dq.q, dq.k, dq.v, True, **dq.descales())
                sched = leanfa.varlen_schedule(vq.q, cu, cu, s, s, causal=True)
                packed = problem_of(vq.q, vq.k, vq.v, True, varlen=True, cu=cu, s=s, scheduler_metadata=sched,
                                    **vq.descales())
            else:
                dense = problem_of(q, k, v, True)
                sched = leanfa.varlen_schedule(flat[0], cu, cu, s, s, causal=True)
                packed = problem_of(*flat, True, varlen=True, cu=cu, s=s, scheduler_metadata=sched)
            t_dense, o_dense = kernel_ms(dense)
            t_var, o_var = kernel_ms(packed)
            diff = (o_var.float().reshape(b, s, hq, d) - o_dense.float()).abs().max().item()
            try:
                mod = fa3.module()
                if dtype == "fp8":
                    f8 = [fa3.quantize_per_kv_head(t, hkv, cu) for t in flat]
                    ds = dict(q_descale=f8[0][1], k_descale=f8[1][1], v_descale=f8[2][1])
                    fn = lambda: mod.flash_attn_varlen_func(*(t for t, _ in f8), cu, cu, s, s, causal=True, **ds)  # noqa: E731
                else:
                    fn = lambda: mod.flash_attn_varlen_func(*flat, cu, cu, s, s, causal=True)  # noqa: E731
                t_fa3 = do_bench(fn, warmup=100, rep=400, return_mode="median")
            except ImportError:
                t_fa3 = float("nan")
            print(f"{shape:>8s} {dtype:5s} {t_dense:9.4f} {t_var:9.4f} {t_dense / t_var:12.3f} {t_fa3:13.4f} "
                  f"{flops / t_dense / 1e9:10.1f} {flops / t_var / 1e9:11.1f} {diff:9.2e} {power.sm_clock_mhz() or 0:6d}",
                  flush=True)


if __name__ == "__main__":
    main()
