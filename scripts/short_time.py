#!/usr/bin/env python
"""FP8 kernel time alone at short and long sequences, per per-tile configuration (the one-tile grid or
the persistent one; register or TMA-store epilogue), against cuDNN FP8 in the same run; with
``--dtype bf16`` the BF16 kernel the same four ways against cuDNN BF16 (its TMA store with
``LEANFA_HOPPER_STORE_TMA=2``; since run 54 the persistent + TMA-store column is BF16 128/128's default; MLA keeps
register stores).

    python scripts/short_time.py [--seqlens 1024,2048,4096,16384] [--dtype fp8|bf16]

Each Hopper row launches a plan built once (``hopper_configs_gpu.kernel_only``), so host time stays out of
it: at S <= 2K ``leanfa bench`` times ``flash_attn_func``'s host path as much as the kernel (run 47).
Causal, B*S = 16K, 16 heads, d128 and MLA 192/128; ``do_bench`` medians and the SM clock.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

#: column -> the scripts/hopper_configs_gpu.py config it times (each pins both knobs)
CONFIGS = {"grid": "v3-grid", "persist": "v3-persist", "tma": "v3-tma", "tma-persist": "v3-tma-persist"}
BF16_CONFIGS = {"grid": "v3-grid", "persist": "v3-persist", "tma": "v3-tma2", "tma-persist": "v3-tma2-persist"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="1024,2048,4096,16384")
    ap.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    args = ap.parse_args()
    fp8 = args.dtype == "fp8"
    configs = CONFIGS if fp8 else BF16_CONFIGS
    import hopper_gpu_check as H
    from hopper_configs_gpu import _set_env, kernel_only
    from leanfa.bench import cudnn_graphs, impls
    from leanfa.bench.inputs import Inputs
    from leanfa.bench.shapes import Case

    have_cudnn = cudnn_graphs.available()[0]
    print(f"{'shape':24s} " + " ".join(f"{n:>18s}" for n in [f"cudnn-{args.dtype}", *configs]))
    for S in (int(s) for s in args.seqlens.split(",")):
        B, Hh = 16384 // S, 16
        for dqk, dv in ((128, 128), (192, 128)):
            q, k, v = H.make_qkv(B, S, S, Hh, Hh, dqk, dv)
            (q8, k8, v8), kw = H.quantize(q, k, v) if fp8 else ((q, k, v), {})
            flops = 2 * B * Hh * S * S * (dqk + dv) / 2
            cells = []
            if have_cudnn:
                case = Case("short", f"d{dqk}", "gaussian", B, S, Hh, Hh, dqk, dv, True)
                ms, clk = H.bench(impls._cudnn_graph_prepare(case, Inputs(q, k, v), fp8=fp8, e2e=False).run)
                base = ms
                cells.append(f"{flops / ms / 1e9:5.0f} {ms:6.3f}@{clk}")
            else:
                base = float("nan")
                cells.append("n/a")
            for cfg in configs.values():
                _set_env(cfg)
                ms, clk = H.bench(kernel_only(q8, k8, v8, dqk ** -0.5, kw))
                cells.append(f"{flops / ms / 1e9:5.0f} {base / ms:4.2f}x {ms:6.3f}@{clk}")
            print(f"S{S:<6d} B{B:<3d} d{dqk}/{dv:<8d} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
