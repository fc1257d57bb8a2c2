"""Row reductions of a wgmma tile as a pairwise tree over each thread's registers.

``gl.max(s, axis=1)`` folds a thread's 32 values of a row one after the other: in the SASS of the
FP8 d128 key loop that is a chain of 31 dependent ``FMNMX`` per row (two rows per thread, the
second chain mostly after the first), ~300 cycles before the first exponential of a block can
start (the clock trace, run 34: a warpgroup's softmax phase takes ~1200 cycles alone). The same
31 operations as a tree are 5 dependent levels.

A thread of an ``[M, N]`` wgmma accumulator holds columns ``8 i + 2 t + e`` (``t`` = lane % 4,
``e`` in {0, 1}, ``i < N / 8``): every column bit above the lowest three is a register index. So
splitting the columns in halves by their top bit (reshape ``[M, 2, N / 2]``, split) moves no data;
``op(lo, hi)`` of the halves is one level of the tree. Halving stops at 8 columns (the two
registers ``e`` and the four lanes ``t``), where ``gl.reduce`` finishes with one in-thread
operation and two butterfly shuffles. Max is exact in any order; the sum is rounded in a
different order than ``gl.sum``'s (fp32, both well inside the e4m3/bf16 rounding of P).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LANE_COLUMNS = gl.constexpr(8)  # columns spread over one thread's pair of registers and 4 lanes


@gluon.jit
def _halve_max(x):
    M: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    lo, hi = gl.split(x.reshape([M, 2, N // 2]).permute(0, 2, 1))
    return gl.maximum(lo, hi)


@gluon.jit
def _halve_sum(x):
    M: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    lo, hi = gl.split(x.reshape([M, 2, N // 2]).permute(0, 2, 1))
    return lo + hi


@gluon.constexpr_function
def _levels(n):
    """Halvings from ``n`` columns down to ``LANE_COLUMNS``."""
    return max((n // LANE_COLUMNS.value).bit_length() - 1, 0)


@gluon.jit
def row_max(x, TREE: gl.constexpr):
    """``gl.max(x, axis=1)`` (in ``x``'s row layout); ``TREE``: as a pairwise tree."""
    if TREE:
        row_layout: gl.constexpr = gl.SliceLayout(1, x.type.layout)
        y = x
        for _ in gl.static_range(_levels(x.shape[1])):
            y = _halve_max(y)
        return gl.convert_layout(gl.max(y, axis=1), row_layout)
    else:
        return gl.max(x, axis=1)


@gluon.jit
def row_sum(x, TREE: gl.constexpr):
    """``gl.sum(x, axis=1)`` (in ``x``'s row layout); ``TREE``: as a pairwise tree."""
    if TREE:
        row_layout: gl.constexpr = gl.SliceLayout(1, x.type.layout)
        y = x
        for _ in gl.static_range(_levels(x.shape[1])):
            y = _halve_sum(y)
        return gl.convert_layout(gl.sum(y, axis=1), row_layout)
    else:
        return gl.sum(x, axis=1)
