"""Lean-P online softmax, in the exp2 domain, one FFMA per score.

Per key block the caller passes ``c = q_scale * k_scale * softmax_scale * log2(e)`` (all the
dequantization and softmax constants folded into one number; ``c > 0``). Row statistics are
kept in the scaled domain: ``m = max_j(s_j) * c``; the probabilities are

    p = exp2(s * c - (m - P_OFFSET))

one FFMA and one MUFU.EX2 per score. ``P_OFFSET = 8`` for FP8 scales P by 256 into the e4m3
range for free; ``l`` sums the scaled ``p`` so ``out = acc / l`` and
``lse = (m + log2(l) - P_OFFSET) * ln 2`` need no correction. Rows that have seen no key yet
keep ``m = -inf``; they use 0 as the subtracted max so no ``inf - inf`` appears.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon

LN2 = 0.6931471805599453


@gluon.jit
def online_softmax_step(s, c, m_i, l_i, P_OFFSET: gl.constexpr):
    """One key block: return ``(p, m_new, l_new, alpha)``; rescale the accumulator by ``alpha``."""
    m_blk = gl.max(s, axis=1) * c
    m_new = gl.maximum(m_i, m_blk)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    neg_m = P_OFFSET - m_sub
    p = gl.exp2(gl.fma(s, c, neg_m[:, None]))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def finish_rows(m_i, l_i, P_OFFSET: gl.constexpr):
    """Return ``(1 / l, lse)`` per row (natural-log LSE); rows with no visible key give 0 and -inf, a
    NaN row (NaN in its q, or in a key it sees) gives NaN for both, as the portable kernel does (run
    32: ``l > 0`` read a NaN sum as "no key" and wrote LSE -inf next to a NaN output)."""
    seen = l_i != 0.0
    inv_l = gl.where(seen, 1.0 / l_i, 0.0)
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0)) - P_OFFSET) * 0.6931471805599453,
                   float("-inf"))
    return inv_l, lse
