"""Lean-P online softmax for the v2 kernel, with an optional stale-max ("lazy rescale") rule.

``online_softmax_step_lazy(..., RESCALE_SKIP=False)`` is exactly :func:`.softmax.online_softmax_step`.

With ``RESCALE_SKIP`` a row keeps its old max unless the block's max exceeds it by more than
``TAU`` (log2 domain). The math stays exact -- ``l`` and ``acc`` are kept relative to the same
(stale) max, and ``finish_rows`` uses that max -- but ``p = exp2(s*c - (m_stale - P_OFFSET))``
can now reach ``2^(P_OFFSET + TAU)``. FP8: P is converted to e4m3 (satfinite, max 448 =
2^8.807) with ``P_OFFSET = 8``, so ``TAU <= log2(448/256) = 0.807``; we use 0.8 (p <= 445.7).
BF16/FP16 P has range to spare; FP16 max is 65504 = 2^15.99 so TAU = 8 is safe for both.
Rows whose max did not grow by more than TAU get ``alpha = 1`` exactly.

What it saves: only the per-row ``alpha`` work *unless* the caller skips the O rescale
warp-uniformly. In the FP8 path the rescale is folded into the FFMA that adds the fresh PV
block (``acc = fma(acc, alpha, pv)``), so it costs nothing to skip -- the expected FP8 gain is
~0 (documented in docs/perf-notes.md); kept as an option for BF16 experiments.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .exp2 import exp2_mixed


@gluon.jit
def _pairwise_max(x):
    a, b = gl.split(x)
    return gl.maximum(a, b)


@gluon.jit
def _pairwise_sum(x):
    a, b = gl.split(x)
    return a + b


@gluon.jit
def row_reduce_tree(s, IS_MAX: gl.constexpr):
    """Row max (``IS_MAX``) or sum of a wgmma accumulator tile ``[M, N]``, as a tree.

    A thread holds columns ``8 i + 2 t + e`` (``t``: lane % 4, ``i < N / 8``, ``e < 2``) of its rows;
    ``gl.max``/``gl.sum`` fold a thread's ``N / 4`` values in one dependent chain (ptxas keeps the
    order: ~32 FMNMX x ~4 cycles per row and block in v3's softmax). Here the in-thread values are
    regrouped as a last axis and halved ``log2(N / 4)`` times (independent pairs), then the 4
    threads of a row combine as before."""
    M: gl.constexpr = s.shape[0]
    N: gl.constexpr = s.shape[1]
    out_layout: gl.constexpr = gl.SliceLayout(1, s.type.layout)
    x = s.reshape([M, N // 8, 4, 2]).permute(0, 2, 1, 3).reshape([M, 4, N // 4])
    for _ in gl.static_range(0, 8):  # log2(N / 4) <= 8 halvings
        if x.shape[2] > 1:
            x = x.reshape([M, 4, x.shape[2] // 2, 2])
            if IS_MAX:
                x = _pairwise_max(x)
            else:
                x = _pairwise_sum(x)
    x = x.reshape([M, 4])
    if IS_MAX:
        r = gl.max(x, axis=1)
    else:
        r = gl.sum(x, axis=1)
    return gl.convert_layout(r, out_layout)


@gluon.jit
def online_softmax_step_lazy(s, c, m_i, l_i, P_OFFSET: gl.constexpr, RESCALE_SKIP: gl.constexpr,
                             POLY: gl.constexpr = 0):
    """One key block: ``(p, m_new, l_new, alpha)``; the caller rescales the accumulator by alpha.
    ``POLY`` of every 8 exponentials run on the FMA pipe (:func:`.exp2.exp2_mixed`)."""
    TAU: gl.constexpr = 0.8 if P_OFFSET > 0.0 else 8.0
    m_blk = row_reduce_tree(s, True) * c
    if RESCALE_SKIP:
        m_new = gl.where(m_blk > m_i + TAU, m_blk, m_i)
    else:
        m_new = gl.maximum(m_i, m_blk)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    neg_m = P_OFFSET - m_sub
    p = exp2_mixed(gl.fma(s, c, neg_m[:, None]), POLY)
    l_new = l_i * alpha + row_reduce_tree(p, False)
    return p, m_new, l_new, alpha


@gluon.jit
def fold_pv(acc, alpha_o, pv, TWO_LEVEL: gl.constexpr):
    """O after a retired PV wgmma. Two-level (FP8): the block's PV was accumulated in a fresh fp32
    tile, added here by one FFMA per element that also rescales O; otherwise the wgmma accumulated
    into O itself (fed ``acc * alpha``) and ``pv`` is the new O."""
    if TWO_LEVEL:
        acc = gl.fma(acc, alpha_o, pv)
    else:
        acc = pv
    return acc
