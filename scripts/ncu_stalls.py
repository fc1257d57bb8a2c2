#!/usr/bin/env python
"""Where do a kernel's warps wait? One ncu run per implementation with warp-state sampling, then
the stall reasons (details page) and the per-SASS-instruction samples (source page) as CSV.

    python scripts/ncu_stalls.py --out DIR [--impl leanfa-hopper-fp8-kernel,cudnn-fp8,fa3-fp8] [--seqlen 8192]

Any implementation of ``leanfa bench --list`` can be named (FA3's ``fa3-fp8``/``fa3-bf16`` too);
:data:`KERNEL_FILTERS` picks its attention kernel out of the profiled call, past the kernels
launched before it (leanfa's copies/quantizers, FA3's semaphore fill or varlen scheduler).
Writes ``DIR/<impl>.details.csv.gz``, ``DIR/<impl>.source.csv.gz`` and prints, per implementation, the
stall reasons and the 40 instructions with the most samples. Aggregate pipe percentages live in
``leanfa profile``; this script answers the next question: which instruction waits, and on what.
"""

from __future__ import annotations

import argparse
import gzip
import csv
import io
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from leanfa.bench.profile import find_ncu  # noqa: E402

SECTIONS = ("SpeedOfLight", "WarpStateStats", "SchedulerStats", "SourceCounters", "MemoryWorkloadAnalysis",
            "ComputeWorkloadAnalysis")


#: implementation name prefix -> ncu arguments that select its attention kernel (first match wins)
KERNEL_FILTERS = (
    ("leanfa-hopper", ["--kernel-name", "regex:attn_fwd"]),
    # FA3 launches cutlass::device_kernel<flash::...FlashAttnFwdSm90<...>>, after a fill of its
    # tile semaphore (causal) or its varlen scheduler kernel (neither is a cutlass device_kernel)
    ("fa3-", ["--kernel-name-base", "demangled", "--kernel-name", "regex:FlashAttnFwd|device_kernel"]),
)


def kernel_filter(impl: str) -> list[str]:
    """The ncu arguments that pick ``impl``'s attention kernel (none: the first kernel)."""
    return next((args for prefix, args in KERNEL_FILTERS if impl.startswith(prefix)), [])


def run(cmd, timeout=600):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout, res.stderr


def profile(ncu, impl, args, out):
    rep = os.path.join(out, impl)
    child = [sys.executable, "-m", "leanfa.bench.profile_child", "--impl", impl, "--preset", "gaussian",
             "--batch", str(args.batch), "--seqlen", str(args.seqlen), "--heads", "16", "--kv-heads", "16",
             "--head-dim", str(args.head_dim), "--head-dim-v", "128", "--warmup", "3", "--seed", "0"]
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--profile-from-start", "off",
           "--launch-count", "1", "--import-source", "no", "-f", "-o", rep]
    cmd += kernel_filter(impl)
    for s in SECTIONS:
        cmd += ["--section", s]
    rc, so, se = run(cmd + child)
    if rc != 0 or not os.path.exists(rep + ".ncu-rep"):
        print(f"[{impl}] ncu failed rc={rc}: {(so + se)[-1500:]}")
        return
    rc, details, se = run([ncu, "--import", rep + ".ncu-rep", "--page", "details", "--csv"])
    with gzip.open(rep + ".details.csv.gz", "wt") as f:  # raw profile data: keep --out outside git
        f.write(details if rc == 0 else se)
    rc, source, se = run([ncu, "--import", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"])
    with gzip.open(rep + ".source.csv.gz", "wt") as f:
        f.write(source if rc == 0 else se)
    print(f"=== {impl} (B={args.batch} S={args.seqlen} d={args.head_dim}, causal)")
    summarize_details(details)
    if rc == 0:
        summarize_source(source)
    else:
        print(f"source page failed: {se[-600:]}")


def summarize_details(text):
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        return
    head = rows[0]
    try:
        isec, iname, iunit, ival = (head.index(c) for c in ("Section Name", "Metric Name", "Metric Unit",
                                                            "Metric Value"))
    except ValueError:
        print("details: unexpected header", head[:12])
        return
    for r in rows[1:]:
        if len(r) > ival and r[isec] in ("GPU Speed Of Light Throughput", "Warp State Statistics",
                                         "Scheduler Statistics", "Memory Workload Analysis",
                                         "Compute Workload Analysis"):
            print(f"  {r[isec][:24]:24s} {r[iname][:48]:48s} {r[ival]:>14s} {r[iunit]}")


def summarize_source(text, top=40):
    """Stall reasons summed over all instructions, then the ``top`` instructions by samples (offset
    from the kernel's first instruction, SASS, share, their three main reasons)."""
    rows = list(csv.reader(io.StringIO(text)))
    head_i = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head_i is None:
        print("  source page: no 'Address' header")
        return
    head = rows[head_i]
    body = [r for r in rows[head_i + 1:] if len(r) == len(head)]
    col = head.index("Warp Stall Sampling (All Samples)")
    reasons = [c for c in head if c.startswith("stall_") and "Not Issued" not in c]
    idx = {c: head.index(c) for c in reasons}

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[col]) for r in body) or 1.0
    by_reason = {c: sum(num(r[idx[c]]) for r in body) for c in reasons}
    print(f"  total samples {total:.0f}; by reason: " + ", ".join(
        f"{c[6:]} {100 * v / total:.1f}%" for c, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:10]))
    base = int(body[0][0], 16)
    for r in sorted(body, key=lambda r: -num(r[col]))[:top]:
        main = sorted(((num(r[idx[c]]), c) for c in reasons), reverse=True)[:3]
        print(f"  {int(r[0], 16) - base:#8x} {r[1].strip()[:64]:64s} {100 * num(r[col]) / total:5.1f}%  "
              + ", ".join(f"{c[6:]} {100 * v / total:.1f}" for v, c in main if v))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--impl", default="leanfa-hopper-fp8-kernel,cudnn-fp8")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    from leanfa.bench.impls import all_impls

    known = {i.name for i in all_impls()}
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    unknown = [i for i in impls if i not in known]
    if unknown:
        sys.exit(f"unknown implementation(s) {unknown}; choose from {sorted(known)}")
    ncu = find_ncu()
    if ncu is None:
        sys.exit("ncu not found")
    os.makedirs(args.out, exist_ok=True)
    for impl in impls:
        profile(ncu, impl, args, args.out)


if __name__ == "__main__":
    main()
