"""Instruction rates behind the cycle budget (docs/design.md §1.2–1.3, docs/perf-notes.md), re-measured.

    python -m leanfa.bench.rates            # one table: results / clock / SM, per instruction mix

Every thread of a full grid (1024 threads per CTA, 16 CTAs per SM) runs ``ITERS`` iterations
of one inline-PTX block over its 8 registers: 8 independent dependency chains per thread,
``REPEAT`` instructions per chain per iteration, so the loop overhead is small. The rate is

    results per clock per SM = threads * 8 * REPEAT * ITERS / (time * SM clock * SMs)

with the time from CUDA events (median of several calls) and the SM clock from NVML sampled
during those calls (under the power cap it is below the boost clock). Rows:

* ``ex2`` (MUFU.EX2, what ``gl.exp2`` emits), ``ffma``, ``fmnmx``.

The values are data-independent (the chains overflow to inf quickly; no instruction here has a
data-dependent latency), so the inputs need no care.
"""

from __future__ import annotations

import argparse
import json
import sys

import triton
import triton.language as tl

PACK = 8  # chains per thread: registers per inline-PTX block
CONSTRAINTS = ",".join(["=f"] * PACK + ["f"] * PACK)  # the block's operand constraints

REPEAT = 4  # dependent instructions per chain per iteration
THREADS = 1024


def _chain(op: str) -> str:
    """PTX: ``REPEAT`` dependent ``op`` on each of the 8 chains (``op`` uses {d} and {s})."""
    body = []
    for i in range(PACK):
        d, s = f"${i}", f"${i + PACK}"
        body.append(op.format(d=d, s=s))
        body += [op.format(d=d, s=d)] * (REPEAT - 1)
    return "{ " + " ".join(body) + " }"


MIXES = {
    "ex2 (MUFU.EX2)": _chain("ex2.approx.ftz.f32 {d}, {s};"),
    "ffma": _chain("fma.rn.f32 {d}, {s}, 0f3F800001, 0f3F000000;"),
    "fmnmx": _chain("max.f32 {d}, {s}, 0f3F000000;"),
}


@triton.jit
def _rate_kernel(x_ptr, out_ptr, iters, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, PACK: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in tl.range(iters):
        x = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=PACK)
    tl.store(out_ptr + offs, x)


def measure(asm: str, *, iters: int = 2048, ctas_per_sm: int = 16, device_index: int = 0) -> dict:
    import torch

    from .power import NvmlSampler
    from .timing import time_calls

    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    block = THREADS * PACK
    grid = sms * ctas_per_sm
    x = torch.rand(grid * block, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)

    def call():
        _rate_kernel[(grid,)](x, out, iters, ASM=asm, CONSTRAINTS=CONSTRAINTS, PACK=PACK, BLOCK=block,
                              num_warps=THREADS // 32)

    sampler = NvmlSampler(device_index)
    t = time_calls([call], warmup_ms=200.0, rep_ms=400.0, min_reps=5, sampler=sampler)
    clk = sampler.summary()["sm_clock_mhz"]
    results = grid * block * REPEAT * iters
    per_clk = results / (t.median_ms * 1e-3) / (clk * 1e6) / sms if clk else float("nan")
    return {"ms": t.median_ms, "sm_clock_mhz": clk, "per_clk_per_sm": per_clk}


def table() -> list[dict]:
    rows = []
    for name, asm in MIXES.items():
        r = measure(asm)
        rows.append({"mix": name, **r})
        print(f"{name:22s} {r['per_clk_per_sm']:7.2f} results/clk/SM   {r['ms']:8.3f} ms   "
              f"{r['sm_clock_mhz']} MHz", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("leanfa.bench.rates needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}: {PACK} chains x {REPEAT} per thread, {THREADS} threads/CTA")
    rows = table()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
