"""SM-clock trace of the v3 consumers' key loop (``LEANFA_HOPPER_TRACE=1``; off by default).

Each consumer warpgroup of each program writes ``%clock`` (the SM's cycle counter, one per SM,
so two warpgroups of a CTA share a time base) at fixed points of its chain, into an int32 buffer
``[programs, warpgroups, 1 + TRACE_BLOCKS, TRACE_EVENTS]``:

* row 0, the tile: ``[smid, before the Q wait, S_0 ready, output stored, -]``;
* row ``1 + j``, key block ``j`` (the first ``TRACE_BLOCKS``): ``[row sum done (the exponentials),
  V ready, wgmmas issued, wgmmas waited for, the slot released]``.

So a block's softmax is ``e0 - (previous e4)``, its wait for V ``e1 - e0``, the issue of PV, the wait
for the next K and the issue of QK ``e2 - e1``, the matrix work as this warpgroup waits for it
``e3 - e2``, the release ``e4 - e3``. :mod:`leanfa.bench.chain_trace` reads the buffer (and traces in
the older layout of four events per block, without "V ready"). With the trace off the pointer is
``None`` (a constexpr): the kernel compiles with no trace code in its PTX.

The clock reads are ``volatile`` inline PTX: LLVM keeps them in order with the other volatile
operations (wgmma issue and wait, mbarrier waits, stores) but may move plain arithmetic across
them; ``row sum done`` takes the row sum as an operand so it cannot be read before it. Each
event is one scalar store (a few instructions): the traced kernel is a little slower, and
``scripts/hopper_trace.py`` times both.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon

TRACE_EVENTS = gl.constexpr(5)
TRACE_BLOCKS = gl.constexpr(128)  # key blocks recorded per tile (S = 16K at 128-key blocks)

EVENT_NAMES = ("rowsum", "v_ready", "issued", "waited", "released")
HEADER_NAMES = ("smid", "q_wait", "s0_ready", "stored")


@gluon.jit
def clock_after(x):
    """``%clock`` read after ``x`` exists (``x``: any 32-bit scalar or tensor; the result has its shape)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [x.to(gl.int32, bitcast=True)],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def record_smid(row, x):
    """Store the SM this warp runs on as event 0 of the tile row (``x``: any int32 scalar)."""
    if row is not None:
        gl.store(row, gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=gl.int32, is_pure=False,
                                                pack=1))


@gluon.jit
def trace_row(trace, t, W: gl.constexpr, WGS: gl.constexpr):
    """The record of warpgroup ``W`` on tile ``t`` (call only with a buffer: ``trace is not None``)."""
    return trace + ((t * WGS + W) * (1 + TRACE_BLOCKS)).to(gl.int64) * TRACE_EVENTS


@gluon.jit
def record(row, slot, event: gl.constexpr, value):
    """Store ``value`` as ``event`` of record row ``slot`` (0: the tile; ``1 + j``: key block ``j``,
    the first ``TRACE_BLOCKS`` only)."""
    if row is not None:  # (a mask, not a branch: a branch splits the block ptxas schedules)
        gl.store(row + slot * TRACE_EVENTS + event, value, mask=slot <= TRACE_BLOCKS)


@gluon.jit
def record_clock(row, slot, event: gl.constexpr, after):
    """``record`` of the clock read after ``after`` (a scalar)."""
    if row is not None:
        record(row, slot, event, clock_after(after))


@gluon.jit
def record_clock_rows(row, slot, event: gl.constexpr, after, offs_m, ROWS: gl.constexpr):
    """``record`` of the clock read after the per-row tensor ``after`` (query rows ``offs_m``) exists,
    as the thread holding the warpgroup's first row (a multiple of ``ROWS``) read it: one store (a
    reduction to a scalar would cost a barrier)."""
    if row is not None:
        gl.store(row + slot * TRACE_EVENTS + event + offs_m * 0, clock_after(after),
                 mask=(offs_m % ROWS == 0) & (slot <= TRACE_BLOCKS))
