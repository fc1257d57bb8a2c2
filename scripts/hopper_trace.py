#!/usr/bin/env python
"""Where a v3 consumer warpgroup's key-block chain spends its SM cycles (GPU; LEANFA_HOPPER_TRACE).

    python scripts/hopper_trace.py [--out DIR] [--cases fp8-d128-16k,bf16-d128-16k,...]

For each case (causal, B·S = 16K, 16 heads): the kernel alone without and with the trace (median ms,
SM clock: what the trace costs), then one traced launch read by :mod:`leanfa.bench.chain_trace` --
median cycles per phase of the interior key blocks, how the two warpgroups' phases coincide, and
the per-tile costs -- and a timeline PNG of one mid-sequence tile. ``--out`` keeps the summaries
(JSON), the PNGs and the first 64 tiles' raw trace (``.npz``, compressed) per case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hopper_gpu_check as H  # noqa: E402
from leanfa.bench import chain_trace  # noqa: E402

#: name -> (dtype, S, dqk, dv, extra env); every case is causal with B·S = 16K, 16 heads. Since the tenth
#: session dense FP8 at head dim <= 128 defaults to the persistent grid with the TMA-store epilogue
#: (launch.persistent_default): the plain FP8 cases trace that; the "-grid" ones the one-tile grid.
CASES = {
    "fp8-d128-16k-grid": ("fp8", 16384, 128, 128, {"LEANFA_HOPPER_PERSISTENT": "0", "LEANFA_HOPPER_STORE_TMA": "0"}),
    "fp8-d128-4k-grid": ("fp8", 4096, 128, 128, {"LEANFA_HOPPER_PERSISTENT": "0", "LEANFA_HOPPER_STORE_TMA": "0"}),
    "fp8-d128-16k": ("fp8", 16384, 128, 128, {}),
    "bf16-d128-16k": ("bf16", 16384, 128, 128, {}),
    "fp8-d192-16k": ("fp8", 16384, 192, 128, {}),
    "fp8-d128-4k": ("fp8", 4096, 128, 128, {}),
    "fp8-d128-16k-onewg": ("fp8", 16384, 128, 128, {"LEANFA_HOPPER_ABLATE": "onewg"}),
    "fp8-d128-16k-nosoftmax": ("fp8", 16384, 128, 128, {"LEANFA_HOPPER_ABLATE": "exp,max"}),
    # one program per SM walking the tiles (off: 0-15% slower, runs 16-17): where does a tile's time go?
    "fp8-d128-4k-persist": ("fp8", 4096, 128, 128, {"LEANFA_HOPPER_PERSISTENT": "1", "LEANFA_HOPPER_STORE_TMA": "0"}),
    "fp8-d128-16k-persist": ("fp8", 16384, 128, 128, {"LEANFA_HOPPER_PERSISTENT": "1", "LEANFA_HOPPER_STORE_TMA": "0"}),
    # run 38: persistent BF16 d128 at S = 1K ran 0.58x the one-tile grid (FP8: 0.98x); where does it lose?
    "bf16-d128-1k": ("bf16", 1024, 128, 128, {}),
    # tenth session: short sequences are per-tile cost (fill, epilogue, turnover); the Q box handed back
    # after the last QK and V's descale read under the last block, one tile per program or persistent
    "fp8-d128-1k": ("fp8", 1024, 128, 128, {}),
    "fp8-d128-1k-persist": ("fp8", 1024, 128, 128, {"LEANFA_HOPPER_PERSISTENT": "1", "LEANFA_HOPPER_STORE_TMA": "0"}),
    # ... and the output through shared memory and TMA (epilogue.stage_and_store)
    "fp8-d128-1k-tma": ("fp8", 1024, 128, 128, {"LEANFA_HOPPER_STORE_TMA": "1", "LEANFA_HOPPER_PERSISTENT": "0"}),
    "fp8-d128-1k-tma-persist": ("fp8", 1024, 128, 128, {"LEANFA_HOPPER_STORE_TMA": "1", "LEANFA_HOPPER_PERSISTENT": "1"}),
    "fp8-d128-4k-tma-persist": ("fp8", 4096, 128, 128, {"LEANFA_HOPPER_STORE_TMA": "1", "LEANFA_HOPPER_PERSISTENT": "1"}),
    "fp8-d128-16k-tma": ("fp8", 16384, 128, 128, {"LEANFA_HOPPER_STORE_TMA": "1", "LEANFA_HOPPER_PERSISTENT": "0"}),
    "bf16-d128-1k-persist": ("bf16", 1024, 128, 128, {"LEANFA_HOPPER_PERSISTENT": "1"}),
    # run 43: FP8 d256 runs ~3560 cycles per pair of 128-key blocks, against ~2600 for its softmax and
    # its own wgmmas: is its 2-slot ring (2 x 64 KB) dry? (3 slots fit: 229,824 B, AOT)
    "fp8-d256-16k": ("fp8", 16384, 256, 256, {}),
    "fp8-d256-16k-stages3": ("fp8", 16384, 256, 256, {"LEANFA_HOPPER_STAGES": "3"}),
    "bf16-d256-16k": ("bf16", 16384, 256, 256, {}),
}


def plan_for(q, k, v, scale, kw, env):
    """A v3 plan built with ``env`` set (the trace buffer, if asked for, is ``plan.trace``)."""
    from leanfa.api import _build_problem
    from leanfa.kernels import hopper
    with mock.patch.dict(os.environ, env):
        problem = _build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                 max_seqlen_k=None, softmax_scale=scale, causal=True, return_lse=False,
                                 out_dtype=None, **{n: kw.get(n) for n in ("q_descale", "k_descale", "v_descale", "k_mean")})
        ok, why = hopper.supports(problem)
        if not ok:
            raise RuntimeError(why)
        return hopper.plan(problem)[0]


def run_case(name, out_dir):
    from leanfa.kernels.hopper.launch import launch
    dtype, S, dqk, dv, env = CASES[name]
    B, Hh = 16384 // S, 16
    q, k, v = H.make_qkv(B, S, S, Hh, Hh, dqk, dv)
    scale = dqk ** -0.5
    kw = {}
    if dtype == "fp8":
        (q, k, v), kw = H.quantize(q, k, v)
    plain = plan_for(q, k, v, scale, kw, env)
    traced = plan_for(q, k, v, scale, kw, {**env, "LEANFA_HOPPER_TRACE": "1"})
    ms, clk = H.bench(lambda: launch(plain))
    ms_t, clk_t = H.bench(lambda: launch(traced))
    traced.trace.fill_(-1)
    launch(traced)
    torch.cuda.synchronize()
    tr = traced.trace.cpu().numpy()
    s = chain_trace.summarize(tr)
    s.update(case=name, ms=ms, sm_clock=clk, ms_traced=ms_t, sm_clock_traced=clk_t, env=env)
    print(f"\n{name} ({dtype} B{B} S{S} H{Hh} d{dqk}/{dv} causal, {env}): kernel {ms:.3f} ms at {clk}; "
          f"traced {ms_t:.3f} ms at {clk_t} ({ms_t / ms - 1:+.1%})", flush=True)
    print(chain_trace.format_summary(s), flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump(s, f, indent=1)
        np.savez_compressed(os.path.join(out_dir, f"{name}.npz"), trace=tr[:64])
        # a tile from the middle of the launch order (a long causal tile: many interior blocks)
        tile = tr.shape[0] // 4
        chain_trace.plot_timeline(tr, tile, os.path.join(out_dir, f"{name}-timeline.png"), (8, 16))
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    for name in args.cases.split(","):
        try:
            run_case(name, args.out)
        except Exception as e:  # noqa: BLE001 (one case failing must not hide the others)
            print(f"\n{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
