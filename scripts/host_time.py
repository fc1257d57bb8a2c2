"""Host (CPU) time per call of the FP8 end-to-end path and its parts, against their GPU time (GPU).

    python scripts/host_time.py [--shapes 64x300,1x1024,1x4096] [--profile] [--launches]

For each shape (causal, 16 heads, d128, bf16 inputs): the host time of one call -- the Python and
launch work the CPU does before the call returns, measured over calls queued back to back with no
synchronization (the GPU queue never fills: a few kernels per call), in rounds over every part so that the
host's drift falls on all parts alike -- and the GPU time of the same
call (``triton.testing.do_bench``, median). A call whose host time exceeds its GPU time is
host-bound: the GPU waits for the CPU. Parts: ``quantize_fp8``, the Hopper plan alone
(``hopper.plan``: checks, descriptors, arguments), the kernel launch alone (a plan built once),
``flash_attn_func`` on pre-quantized inputs, ``attention(precision="fp8")``, BF16
``flash_attn_func``, and ``flash_attn_varlen_func`` (FP8 pre-quantized and BF16) on the same tokens packed as b
sequences (also with the batch's ``varlen_schedule`` given, and the varlen call's host parts alone: checks and
``Problem``, dispatch, plan, tile table), and the V re-pack a varlen FP8 call makes of a token-major (FA3-style) FP8 V (``align_varlen_v``; quantize_fp8's V needs none). FlashAttention-3's ``flash_attn_func`` and ``flash_attn_varlen_func`` (BF16, and FP8 on inputs quantized
beforehand with per-head descales) are measured the same way when its module is importable. ``--launches``: every
GPU launch of one call of each end-to-end path (name and GPU microseconds, from the CUDA profiler). ``--profile``: the functions by cumulative
time of 200 calls of BF16 ``flash_attn_func`` and of the varlen calls (BF16, FP8, FP8 end to end) under cProfile, at
the first shape.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics

import torch
from triton.testing import do_bench

import leanfa
from leanfa.api import _build_problem
from leanfa.bench import fa3, timing
from leanfa.kernels import dispatch, hopper
from leanfa.kernels.varlen_v import align_varlen_v


def host_ms_interleaved(fns: dict, calls: int = 40, repeats: int = 7) -> dict:
    """CPU milliseconds per call of each of ``fns`` queued back to back (synchronized before and after only): the
    median of ``repeats`` rounds, each round timing ``calls`` calls of every function in turn, so that a drift of
    the host's speed (2x between runs on the H200's host) falls on all of them alike."""
    for fn in fns.values():
        for _ in range(10):
            fn()
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            runs[name].append(timing.host_ms([fn], calls))
    return {name: statistics.median(r) for name, r in runs.items()}


def launches(fn) -> list[tuple[str, float]]:
    """(kernel name, GPU microseconds) of every launch one call of ``fn`` makes (CUDA profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name[:40], e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def fa3_parts(q, k, v, flat, cu, s) -> dict:
    """FA3's dense and varlen calls on the same tokens (BF16, and FP8 quantized beforehand), or {} without FA3."""
    try:
        mod = fa3.module()
    except ImportError as e:
        print(f"FA3 not measured: {e}")
        return {}
    b, heads = q.shape[0], q.shape[2]
    (q8, dq), (k8, dk), (v8, dv) = (fa3.quantize_per_kv_head(t, heads) for t in (q, k, v))
    descales = dict(q_descale=dq, k_descale=dk, v_descale=dv)
    f8 = [t.reshape(b * s, *t.shape[2:]) for t in (q8, k8, v8)]
    return {
        "FA3 flash_attn_func bf16": lambda: mod.flash_attn_func(q, k, v, causal=True),
        "FA3 flash_attn_func fp8": lambda: mod.flash_attn_func(q8, k8, v8, causal=True, **descales),
        "FA3 varlen bf16": lambda: mod.flash_attn_varlen_func(*flat, cu, cu, s, s, causal=True),
        "FA3 varlen fp8": lambda: mod.flash_attn_varlen_func(*f8, cu, cu, s, s, causal=True, **descales),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x300,1x1024,1x4096", help="BxS, comma-separated")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--launches", action="store_true")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape':>12s} {'part':28s} {'host ms':>8s} {'GPU ms':>8s}")
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, 16, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        qq = leanfa.quantize_fp8(q, k, v)
        kw = qq.descales()
        problem = _build_problem(qq.q, qq.k, qq.v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None,
                                 max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=True,
                                 return_lse=False, out_dtype=None, **kw)
        plan, _, _ = hopper.plan(problem)
        # the same tokens as one packed varlen batch of b sequences (what serving engines call for prefill)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
        flat = [t.reshape(b * s, 16, 128) for t in (q, k, v)]
        qv = leanfa.quantize_fp8(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
        v_token_major = qv.packed_v(cu)  # (an FP8 V as FA3 takes it: the layout the plan re-packs)
        sched = leanfa.varlen_schedule(flat[0], cu, cu, s, s, causal=True)  # (made once per batch, for every layer)
        vp = _build_problem(*flat, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                            softmax_scale=None, causal=True, q_descale=None, k_descale=None, v_descale=None,
                            k_mean=None, return_lse=False, out_dtype=None)
        parts = {
            "quantize_fp8": lambda: leanfa.quantize_fp8(q, k, v),
            "hopper.plan (no launch)": lambda: hopper.plan(problem),
            "launch (plan built once)": lambda: hopper._launch.launch(plan),
            "flash_attn_func fp8": lambda: leanfa.flash_attn_func(qq.q, qq.k, qq.v, causal=True, **kw),
            "attention(precision=fp8)": lambda: leanfa.attention(q, k, v, causal=True, precision="fp8"),
            "flash_attn_func bf16": lambda: leanfa.flash_attn_func(q, k, v, causal=True),
            "varlen fp8": lambda: leanfa.flash_attn_varlen_func(qv.q, qv.k, qv.v, cu, cu, s, s, causal=True,
                                                               **qv.descales()),
            "varlen bf16": lambda: leanfa.flash_attn_varlen_func(*flat, cu, cu, s, s, causal=True),
            "varlen fp8, schedule given": lambda: leanfa.flash_attn_varlen_func(
                qv, None, None, cu, cu, s, s, causal=True, scheduler_metadata=sched),
            "varlen bf16, schedule given": lambda: leanfa.flash_attn_varlen_func(
                *flat, cu, cu, s, s, causal=True, scheduler_metadata=sched),
            "varlen bf16: _build_problem": lambda: _build_problem(
                *flat, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                softmax_scale=None, causal=True, q_descale=None, k_descale=None, v_descale=None, k_mean=None,
                return_lse=False, out_dtype=None),
            "varlen bf16: dispatch.choose": lambda: dispatch.choose(vp, "auto"),
            "varlen bf16: hopper.plan": lambda: hopper.plan(vp),
            "varlen: tile table": lambda: leanfa.varlen_schedule(flat[0], cu, cu, s, s, causal=True),
            "varlen fp8 end to end": lambda: leanfa.attention(*flat, causal=True, precision="fp8", cu_seqlens_q=cu,
                                                              cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s),
            "varlen V re-pack (FP8)": lambda: align_varlen_v(v_token_major, cu, s),
        }
        parts.update(fa3_parts(q, k, v, flat, cu, s))
        host = host_ms_interleaved(parts)
        for name, fn in parts.items():
            host_only = name == "hopper.plan (no launch)" or name.startswith("varlen bf16:")
            gpu = do_bench(fn, return_mode="median") if not host_only else float("nan")
            print(f"{shape:>12s} {name:28s} {host[name]:8.3f} {gpu:8.3f}", flush=True)
        if args.launches:
            for name in ("attention(precision=fp8)", "flash_attn_func bf16", "varlen fp8", "varlen bf16",
                         "varlen fp8 end to end"):
                print(f"{shape:>12s} {name}: " + ", ".join(f"{k} {us:.1f} us" for k, us in launches(parts[name])))
        if args.profile and shape == args.shapes.split(",")[0]:  # the host work is the same at every shape
            for name in ("flash_attn_func bf16", "varlen bf16", "varlen fp8", "varlen fp8 end to end"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(200):
                    parts[name]()
                prof.disable()
                torch.cuda.synchronize()
                print(f"\ncProfile, 200 x {name} at {shape} (own time, top 30):")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(45)

if __name__ == "__main__":
    main()
