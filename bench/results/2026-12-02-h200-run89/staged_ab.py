"""A/B of the varlen epilogue (STORE_STAGED vs register stores, LEANFA_HOPPER_STORE_TMA=1/0) in one process, with
FA3 varlen as the reference: kernel-alone TFLOP/s (do_bench median) on the serving batches, interleaved rounds."""
import os, statistics, sys
import torch
from triton.testing import do_bench
import leanfa
from leanfa.bench import fa3
from leanfa.bench.shapes import serving_lengths
from leanfa.kernels import hopper

H, HKV, D = 32, 8, 128
mod = fa3.module()

def flops(lq, lk):
    return sum(2 * H * q * (k - q) * 2 * D + 2 * H * q * q * D for q, k in zip(lq, lk))  # causal bottom-right

rows = []
for label in sys.argv[1].split(","):
    lq, lk = serving_lengths(label)
    lk = lk or lq
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    mq, mk = max(lq), max(lk)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lq), H, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(sum(lk), HKV, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    qt = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    sched = leanfa.varlen_schedule(q, cu_q, cu_k, mq, mk, causal=True)
    (q8, dq), (k8, dk), (v8, dv) = (fa3.quantize_per_kv_head(t, HKV, cu) for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
    calls = {
        "fp8": lambda: leanfa.flash_attn_varlen_func(qt, None, None, cu_q, cu_k, mq, mk, causal=True, scheduler_metadata=sched),
        "bf16": lambda: leanfa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, scheduler_metadata=sched),
    }
    ref = {"fp8": lambda: mod.flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, mq, mk, causal=True, q_descale=dq, k_descale=dk, v_descale=dv),
           "bf16": lambda: mod.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)}
    f = flops(lq, lk)
    res = {}
    for r in range(3):
        for prec in ("fp8", "bf16"):
            for mode in ("1", "0"):
                os.environ["LEANFA_HOPPER_STORE_TMA"] = mode
                out = calls[prec]()  # (a new plan for this knob value)
                res.setdefault((prec, mode), []).append(f / do_bench(calls[prec], warmup=25, rep=100, return_mode="median") / 1e9)
            res.setdefault((prec, "fa3"), []).append(f / do_bench(ref[prec], warmup=25, rep=100, return_mode="median") / 1e9)
    os.environ["LEANFA_HOPPER_STORE_TMA"] = "1"
    for prec in ("fp8", "bf16"):
        st, rg, fa = (statistics.median(res[(prec, m)]) for m in ("1", "0", "fa3"))
        print(f"{label:18s} {prec:5s} staged {st:7.1f} ({st/fa:.3f}x FA3)  registers {rg:7.1f} ({rg/fa:.3f}x)  staged/registers {st/rg:.3f}  FA3 {fa:7.1f}", flush=True)
