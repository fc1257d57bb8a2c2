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

from .gluon_compat import gl, gluon

from .exp2 import ABLATE_MAX, ablates, exp2_mixed


@gluon.jit
def _new_row_max(m_i, m_blk, TAU: gl.constexpr, RESCALE_SKIP: gl.constexpr):
    """``(m_new, m_sub, alpha)``: the row max after a block whose max is ``m_blk`` (kept stale within
    ``TAU`` with ``RESCALE_SKIP``), the value subtracted in the exponent (0 for rows with no key
    yet) and the factor that rescales the old sum and O."""
    if RESCALE_SKIP:
        m_new = gl.where(m_blk > m_i + TAU, m_blk, m_i)
    else:
        m_new = gl.maximum(m_i, m_blk)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, m_sub, gl.exp2(m_i - m_sub)


@gluon.jit
def thread_row_sums(p):
    """Per-thread partial row sums of ``p`` (a wgmma accumulator ``[M, N]``: thread lane ``t`` of a quad holds
    columns ``8i + 2t + e``): ``[M, 8]``, column ``2t + e`` summed over ``i`` -- adds within each thread only,
    no shuffle. :func:`row_totals` finishes the sum across the quad."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    return gl.sum(p.reshape([M, N // 8, 8]), axis=1)


@gluon.jit
def row_totals(l_part, row_layout: gl.constexpr):
    """The row sums (``row_layout``) from :func:`thread_row_sums`-shaped partials (one quad reduction)."""
    return gl.convert_layout(gl.sum(l_part, axis=1), row_layout)


@gluon.jit
def _add_row_sums(l_i, alpha, p, PARTIAL_L: gl.constexpr):
    """``l_i * alpha + rowsum(p)``: ``l_i`` row sums ``[M]``, or (``PARTIAL_L``) per-thread partials ``[M, 8]``."""
    if PARTIAL_L:
        a = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout))
        l_new = l_i * a[:, None] + gl.convert_layout(thread_row_sums(p), l_i.type.layout)
    else:
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return l_new


@gluon.jit
def online_softmax_step_lazy(s, c, m_i, l_i, P_OFFSET: gl.constexpr, RESCALE_SKIP: gl.constexpr,
                             POLY: gl.constexpr = 0, PARTIAL_L: gl.constexpr = False):
    """One key block: ``(p, m_new, l_new, alpha)``; the caller rescales the accumulator by alpha.
    ``POLY`` of every 8 exponentials run on the FMA pipe (:func:`.exp2.exp2_mixed`)."""
    TAU: gl.constexpr = 0.8 if P_OFFSET > 0.0 else 8.0
    if ablates(POLY, ABLATE_MAX):  # timing ablation (exp2.ABLATE_MAX): wrong results
        m_blk = m_i
    else:
        m_blk = gl.max(s, axis=1) * c
    m_new, m_sub, alpha = _new_row_max(m_i, m_blk, TAU, RESCALE_SKIP)
    neg_m = P_OFFSET - m_sub
    p = exp2_mixed(gl.fma(s, c, neg_m[:, None]), POLY)
    return p, m_new, _add_row_sums(l_i, alpha, p, PARTIAL_L), alpha


@gluon.jit
def online_softmax_step_halves(s, c0, c1, m_i, l_i, P_OFFSET: gl.constexpr, RESCALE_SKIP: gl.constexpr,
                               POLY: gl.constexpr = 0, PARTIAL_L: gl.constexpr = False):
    """:func:`online_softmax_step_lazy` for a block whose two column halves have their own score
    scales ``c0``, ``c1`` (a 256-key block spans two 128-token K scale blocks). The halves are a
    thread's own registers (columns ``8i + 2t + e``, ``i < 16`` or ``>= 16``), regrouped without data
    movement; every score still takes one FFMA."""
    TAU: gl.constexpr = 0.8 if P_OFFSET > 0.0 else 8.0
    M: gl.constexpr = s.shape[0]
    N: gl.constexpr = s.shape[1]
    row_layout: gl.constexpr = m_i.type.layout
    s0, s1 = gl.split(s.reshape([M, 2, N // 2]).permute(0, 2, 1))
    m_blk = gl.maximum(gl.convert_layout(gl.max(s0, axis=1), row_layout) * c0,
                       gl.convert_layout(gl.max(s1, axis=1), row_layout) * c1)
    m_new, m_sub, alpha = _new_row_max(m_i, m_blk, TAU, RESCALE_SKIP)
    neg_m = gl.convert_layout(P_OFFSET - m_sub, gl.SliceLayout(1, s0.type.layout))
    p0 = exp2_mixed(gl.fma(s0, c0, neg_m[:, None]), POLY)
    p1 = exp2_mixed(gl.fma(s1, c1, neg_m[:, None]), POLY)
    p = gl.convert_layout(gl.join(p0, p1).permute(0, 2, 1).reshape([M, N]), s.type.layout)
    return p, m_new, _add_row_sums(l_i, alpha, p, PARTIAL_L), alpha


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
