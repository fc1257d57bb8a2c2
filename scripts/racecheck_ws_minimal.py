#!/usr/bin/env python
"""Is compute-sanitizer racecheck's report on the warp-specialized Hopper kernels Triton's own?

Runs 10 and 11 (2026-11-29): racecheck flags ~23 hazards in v3 (kernel_pingpong.py), as it did in
the v2 kernel since deleted, always between the kernel's first instructions (worker warps reading a
per-warp state table at the end of shared memory) and the default partition's writes of that
table (before ``bar.sync 1``, and at exit) -- Triton's ``warp_specialize`` dispatch, not the
kernels' Q/K/V buffers. This script launches a *minimal* Gluon kernel with the same structure
and no shared memory of its own: v3's partitions (a 4-warp default, a 4-warp worker with 240
registers and a 1-warp worker with 24, so 8 worker warps and an 8-byte state table) that only
write disjoint global memory. If racecheck reports the same hazards here, they come from
Triton's dispatch code. (Run 13: the first version, one 1-warp worker and a 4-byte table, was
racecheck-clean while v3 was not -- hence the v3 shape.)

    compute-sanitizer --tool racecheck --error-exitcode 3 python scripts/racecheck_ws_minimal.py
    python scripts/racecheck_ws_minimal.py --compile-only     # no GPU: compile for sm90 and exit
    ... --thread-barrier    # the 4-warp partitions also run gl.thread_barrier() (v3's release_slot)
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default_part(out_ptr, BLOCK: gl.constexpr, BARRIER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.program_id(0) * 3 * BLOCK + gl.arange(0, BLOCK, layout)
    if BARRIER:  # a partition-wide barrier, as v3's release_slot (bar.sync 0, 128 here)
        gl.thread_barrier()
    gl.store(out_ptr + offs, offs.to(gl.float32))


@gluon.jit
def _worker_part(out_ptr, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs = gl.program_id(0) * 3 * BLOCK + BLOCK + gl.arange(0, BLOCK, layout)
    gl.store(out_ptr + offs, -offs.to(gl.float32))


@gluon.jit
def _wide_worker_part(out_ptr, BLOCK: gl.constexpr, BARRIER: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.program_id(0) * 3 * BLOCK + 2 * BLOCK + gl.arange(0, BLOCK, layout)
    if BARRIER:  # bar.sync 2, 128
        gl.thread_barrier()
    gl.store(out_ptr + offs, 0.5 * offs.to(gl.float32))


@gluon.jit
def ws_minimal_kernel(out_ptr, BLOCK: gl.constexpr, BARRIER: gl.constexpr):
    gl.warp_specialize([
        (_default_part, (out_ptr, BLOCK, BARRIER)),
        (_worker_part, (out_ptr, BLOCK)),
        (_wide_worker_part, (out_ptr, BLOCK, BARRIER)),
    ], [1, 4], [24, 240])


def main() -> int:
    block, grid = 128, 264
    barrier = "--thread-barrier" in sys.argv  # partition-wide barriers inside the 4-warp partitions
    if "--compile-only" in sys.argv:
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
        src = GluonASTSource(ws_minimal_kernel, {"out_ptr": "*fp32", "BLOCK": "constexpr", "BARRIER": "constexpr"},
                             constexprs={"BLOCK": block, "BARRIER": barrier})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print("compiled for sm90:", ck.asm["ptx"].count("setmaxnreg"), "setmaxnreg")
        return 0
    out = torch.full((grid * 3 * block,), float("nan"), device="cuda")
    ws_minimal_kernel[(grid,)](out, BLOCK=block, BARRIER=barrier, num_warps=4)
    torch.cuda.synchronize()
    idx = torch.arange(grid * 3 * block, device="cuda", dtype=torch.float32)
    part = (idx.long() // block) % 3
    want = torch.where(part == 0, idx, torch.where(part == 1, -idx, 0.5 * idx))
    ok = torch.equal(out, want)
    print(f"minimal warp_specialize kernel (thread barriers: {barrier}):", "correct" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
