#!/usr/bin/env python
"""Kernel-alone timing of Hopper kernel configurations against FA3 and cuDNN in the same process (H200).

    python scripts/kernel_variants.py --configs v3,v3-grid [--shapes d128-16k,mla-16k] [--rounds 2] [--bf16]

Every shape builds BF16 inputs once (``hopper_gpu_check.make_qkv``, random normal), quantizes them the way each
implementation takes them (leanfa's ``quantize_fp8``; FA3 one scale per (sequence, KV head); cuDNN per tensor), and
times the kernel alone (``triton.testing.do_bench``, median) with the SM clock read by NVML right after. Configs
are ``scripts/hopper_configs_gpu.py``'s ``CONFIGS`` (environment of the plan). Rounds repeat the whole shape's list
(peers and configs interleaved) so that clock drift shows. Prints one row per (shape, implementation) with
TFLOP/s, the ratio to the best peer (FA3 or cuDNN) of the same precision and round, and the clock.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

#: name -> (batch, seqlen, q heads, kv heads, head dim qk, head dim v, causal)
SHAPES = {
    "d128-1k": (16, 1024, 16, 16, 128, 128, True),
    "d128-4k": (4, 4096, 16, 16, 128, 128, True),
    "d128-16k": (1, 16384, 16, 16, 128, 128, True),
    "d128-32k": (1, 32768, 16, 16, 128, 128, True),
    "d128-8k-full": (2, 8192, 16, 16, 128, 128, False),
    "mla-4k": (4, 4096, 16, 16, 192, 128, True),
    "mla-16k": (1, 16384, 16, 16, 192, 128, True),
    "gqa64-16k": (1, 16384, 64, 8, 128, 128, True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="v3")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="also BF16 (leanfa, FA3, cuDNN through SDPA)")
    ap.add_argument("--error", default=None, metavar="S",
                    help="instead of timing: relative L2 error vs float64 of each config's FP8 output (leanfa's "
                         "quantizer, end to end) at sequence length S, causal, 8 q / 2 kv heads, d128, on the "
                         "check's inputs and the llama3-8b preset")
    ap.add_argument("--warm", action="store_true", help="compile only: one call per config and shape at S = 256")
    a = ap.parse_args()
    if a.error:
        return errors(a.configs.split(","), int(a.error))

    import torch

    import hopper_gpu_check as H
    from hopper_configs_gpu import _set_env, kernel_only
    from leanfa.bench import cudnn_graphs, fa3, impls
    from leanfa.bench.inputs import Inputs
    from leanfa.bench.shapes import Case

    os.environ["LEANFA_POISON_OUTPUTS"] = "0"
    print(f"device {torch.cuda.get_device_name()}; fa3 {fa3.available()}; cudnn {cudnn_graphs.available()}", flush=True)
    configs = a.configs.split(",")
    rows = []
    for shape in a.shapes.split(","):
        B, S, Hq, Hkv, dqk, dv, causal = SHAPES[shape]
        if a.warm:
            B, S = 1, 256
        flops = 2 * B * Hq * S * S * (dqk + dv) / (2 if causal else 1)
        q, k, v = H.make_qkv(B, S, S, Hq, Hkv, dqk, dv)
        scale = dqk ** -0.5
        case = Case("variants", shape, "gaussian", B, S, Hq, Hkv, dqk, dv, causal)
        x = Inputs(q, k, v)
        (q8, k8, v8), kw = H.quantize(q, k, v)
        precs = ("fp8", "bf16") if a.bf16 else ("fp8",)
        for rnd in range(a.rounds):
            res = {}

            def timed(name, fn):
                try:
                    res[name] = H.bench(fn)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc(limit=1)
                    res[name] = (float("nan"), f"{type(e).__name__}")

            for prec in precs:
                fp8 = prec == "fp8"
                try:
                    run, _ = fa3.call(case, x, fp8=fp8)
                    timed(f"fa3-{prec}", run)
                except Exception as e:  # noqa: BLE001
                    print(f"fa3-{prec}: {type(e).__name__}: {e}")
                try:
                    if fp8:
                        timed("cudnn-fp8", impls._cudnn_graph_prepare(case, x, fp8=True, e2e=False).run)
                    else:
                        from torch.nn.attention import SDPBackend, sdpa_kernel
                        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

                        def sdpa():
                            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                                return torch.nn.functional.scaled_dot_product_attention(
                                    qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=Hq != Hkv)
                        timed("cudnn-bf16", sdpa)
                except Exception as e:  # noqa: BLE001
                    print(f"cudnn-{prec}: {type(e).__name__}: {e}")
                for cfg in configs:
                    _set_env(cfg)
                    try:
                        if fp8:
                            timed(f"{cfg}-fp8", kernel_only(q8, k8, v8, scale, kw, causal))
                        else:
                            timed(f"{cfg}-bf16", kernel_only(q, k, v, scale, {}, causal))
                    except Exception as e:  # noqa: BLE001
                        print(f"{cfg}-{prec}: {type(e).__name__}: {e}")
                _set_env("v3")
            if a.warm:
                continue
            for name, (ms, clk) in res.items():
                prec = name.rsplit("-", 1)[1]
                best = min((res.get(p, (float("inf"),))[0] for p in (f"fa3-{prec}", f"cudnn-{prec}")),
                           default=float("inf"))
                tf = flops / (ms * 1e-3) / 1e12
                rows.append((shape, rnd, name, ms, tf, best / ms, clk))
                print(f"{shape:14s} r{rnd} {name:24s} {ms:8.3f} ms {tf:7.1f} TFLOP/s  x{best / ms:5.3f} best peer"
                      f"  clk={clk}", flush=True)
        del q, k, v, q8, k8, v8, x
        torch.cuda.empty_cache()
    print("\n=== summary: x best peer (same precision, same round) ===")
    names = sorted({r[2] for r in rows}, key=lambda n: (n.rsplit("-", 1)[1], n))
    shapes = list(dict.fromkeys(r[0] for r in rows))
    print("| impl | " + " | ".join(shapes) + " |")
    for n in names:
        cells = []
        for s in shapes:
            vals = [f"{r[5]:.3f}@{r[6]}" for r in rows if r[0] == s and r[2] == n]
            cells.append(" / ".join(vals) or "-")
        print(f"| {n} | " + " | ".join(cells) + " |")


def errors(configs, S):
    import torch

    import hopper_gpu_check as H
    import leanfa
    from hopper_configs_gpu import _set_env
    from leanfa.activations import make_qkv

    inputs = {"check": H.make_qkv(1, S, S, 8, 2, 128, 128),
              "llama3-8b": make_qkv("llama3-8b", 1, S, heads=8, kv_heads=2, seed=1, device="cuda")}
    for name, (q, k, v) in inputs.items():
        ref, _ = H.reference(q, k, v, True, 128 ** -0.5)
        ref = ref.float()
        for cfg in configs:
            _set_env(cfg)
            fp8 = leanfa.quantize_fp8(q, k, v)
            H.poison_allocator(q.numel() * 4)
            out = leanfa.flash_attn_func(fp8.q, fp8.k, fp8.v, softmax_scale=128 ** -0.5, causal=True,
                                         backend="hopper", **fp8.descales()).float()
            err = ((out - ref).norm() / ref.norm()).item()
            print(f"error S={S} {name:10s} {cfg:24s} rel L2 {err:.4e}  finite {bool(out.isfinite().all())}",
                  flush=True)
        _set_env("v3")
        del ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
