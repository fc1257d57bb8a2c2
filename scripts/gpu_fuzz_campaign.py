#!/usr/bin/env python
"""GPU differential fuzz campaign: random cases vs the float64 reference, until a time budget.

Draws from the same case space as tests/test_fuzz.py (its ``random_case``/``build_case``/
``compare``, driven by ``random.Random`` instead of hypothesis) with GPU-sized limits, runs every
case on backend="portable" and, where ``hopper.supports()`` accepts it (dense, and BF16/FP16
varlen), backend="hopper", and
compares each against ``attention_ref`` in float64 on the GPU. Outputs are poisoned with NaN
(LEANFA_POISON_OUTPUTS=1) so unwritten elements fail.

Each case has its own seed (derived from --seed and the case index) and every failure prints a
one-line repro: ``--replay SEED`` rebuilds exactly that case.

    python scripts/gpu_fuzz_campaign.py                 # 150 s, seed 0
    python scripts/gpu_fuzz_campaign.py --seconds 300 --seed 7
    python scripts/gpu_fuzz_campaign.py --seconds 240 --workers 12   # thousands of cases
    python scripts/gpu_fuzz_campaign.py --replay 123456789

Prints "cases run N, failures F" and a table grouped by backend / mode; exit status 1 on any
failure. Compile time dominates the first ~30 s (each new constexpr combination compiles once).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
import traceback

os.environ["LEANFA_POISON_OUTPUTS"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import leanfa  # noqa: E402
from leanfa.reference import attention_ref  # noqa: E402

import test_fuzz as tf  # noqa: E402  (the case space; importing it runs no test)

# keep the float64 reference cheap and skip the autotuning sweep: Sq * Sk below
# AUTOTUNE_MIN_WORK most of the time, a few larger cases every so often
LIMITS = tf.Limits(max_len=1000, max_batch=3, kv_heads=(1, 2, 3, 4), budget=float("inf"),
                   max_seqs=8, max_heads=64)
BIG = tf.Limits(max_len=3000, max_batch=1, kv_heads=(1, 2), budget=float("inf"), max_seqs=4, max_heads=16)


def case_params(seed: int) -> dict:
    rng = random.Random(seed)
    lim = BIG if rng.random() < 0.05 else LIMITS
    p = tf.random_case(rng, lim)
    p["case_seed"] = seed
    return p


def hopper_ok(case) -> bool:
    if case.params["mode"] == "fp8sink":  # sink keys run in the portable kernel
        return False
    from leanfa.api import _build_problem, _unpack_quantized
    from leanfa.kernels import dispatch

    kw = dict(case.kwargs)
    q, k, v, qd, kd, vd, km = _unpack_quantized(case.args[0], case.args[1], case.args[2], kw.pop("q_descale", None),
                                                kw.pop("k_descale", None), kw.pop("v_descale", None),
                                                kw.pop("k_mean", None))
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    cu = dict(zip(names, case.args[3:7])) if case.varlen else dict.fromkeys(names)  # varlen: positional
    prob = _build_problem(q, k, v, varlen=case.varlen, **cu, q_descale=qd, k_descale=kd, v_descale=vd, k_mean=km,
                          **kw)
    return dispatch.hopper_applies(prob)[0]


def run_one(seed: int, stats, failures, verbose: bool):
    p = case_params(seed)
    try:
        case = tf.build_case(p, "cuda")
    except Exception as e:  # noqa: BLE001 - a build error is a failure of the quantizer or the case
        key = ("build", p["mode"])
        stats[key][0] += 1
        stats[key][1] += 1
        failures.append((seed, "build", f"{type(e).__name__}: {e}", str(p)))
        return
    ref, ref_lse = attention_ref(*case.ref_args, **case.ref_kwargs)
    backends = ["portable"] + (["hopper"] if hopper_ok(case) else [])
    for backend in backends:
        key = (backend, p["mode"] + ("-varlen" if case.varlen else ""))
        stats[key][0] += 1
        try:
            out, lse = case.call(backend)
            fails, err = tf.compare(case, out, lse, ref, ref_lse)
        except Exception as e:  # noqa: BLE001
            fails, err = [f"{type(e).__name__}: {e}"], float("nan")
            if verbose:
                traceback.print_exc()
        stats[key][2] = max(stats[key][2], err if err == err else 0.0)
        if fails:
            stats[key][1] += 1
            failures.append((seed, backend, "; ".join(fails), case.label()))
            print(f"FAIL seed={seed} backend={backend}: {'; '.join(fails)} :: {case.label()}", flush=True)
        elif verbose:
            print(f"ok   seed={seed} backend={backend} err={err:.3g} :: {case.label()}", flush=True)


def campaign(seed: int, seconds: float, max_cases: int, replay=None, verbose=False):
    """One process's share: (cases run, stats, failures). Case seeds come from ``seed``."""
    stats = collections.defaultdict(lambda: [0, 0, 0.0])  # key -> [runs, failures, max err]
    failures = []
    t0 = time.time()
    n = 0
    master = random.Random(seed)
    while True:
        if replay is not None:
            if n >= len(replay):
                break
            case_seed = replay[n]
        else:
            if time.time() - t0 > seconds or n >= max_cases:
                break
            case_seed = master.randrange(2**31)
        run_one(case_seed, stats, failures, verbose or replay is not None)
        n += 1
        if replay is None and n % 200 == 0:
            print(f"  [seed {seed}] {n} cases, {len(failures)} failures, {time.time() - t0:.0f} s", flush=True)
    torch.cuda.synchronize()
    return n, dict(stats), failures


def _worker(args):
    seed, seconds, max_cases = args
    return campaign(seed, seconds, max_cases)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="time budget (default 150)")
    ap.add_argument("--seed", type=int, default=0, help="campaign seed (case seeds derive from it)")
    ap.add_argument("--max-cases", type=int, default=10**9, help="per worker")
    ap.add_argument("--workers", type=int, default=1,
                    help="processes sharing the GPU (compiles are CPU-bound; Triton's disk cache is shared)")
    ap.add_argument("--replay", type=int, nargs="*", help="run only these case seeds, verbosely")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"leanfa GPU fuzz: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"campaign seed {args.seed}, budget {args.seconds:.0f} s, workers {args.workers}", flush=True)
    t0 = time.time()
    if args.replay or args.workers <= 1:
        results = [campaign(args.seed, args.seconds, args.max_cases, args.replay, args.verbose)]
    else:
        import multiprocessing as mp

        # worker i draws from seed * 1000 + i: disjoint streams, each reproducible on its own
        jobs = [(args.seed * 1000 + i, args.seconds, args.max_cases) for i in range(args.workers)]
        with mp.get_context("spawn").Pool(args.workers) as pool:
            results = pool.map(_worker, jobs)
    n = sum(r[0] for r in results)
    stats = collections.defaultdict(lambda: [0, 0, 0.0])
    failures = []
    for _, part, fails in results:
        failures += fails
        for key, (runs, nfail, mx) in part.items():
            stats[key][0] += runs
            stats[key][1] += nfail
            stats[key][2] = max(stats[key][2], mx)
    total_runs = sum(s[0] for s in stats.values())
    total_fail = sum(s[1] for s in stats.values())
    print(f"\n{'backend':<10} {'mode':<16} {'runs':>6} {'fail':>5} {'max rel err':>12}")
    for (backend, mode), (runs, fails, mx) in sorted(stats.items()):
        print(f"{backend:<10} {mode:<16} {runs:>6} {fails:>5} {mx:>12.3g}")
    print(f"\ncases run {n} ({total_runs} kernel runs), failures {total_fail}  [{time.time() - t0:.0f} s]")
    if failures:
        print("repro: python scripts/gpu_fuzz_campaign.py --replay " + " ".join(str(f[0]) for f in failures[:20]))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
