"""Lean-P online softmax, in the exp2 domain, one FFMA per score, and the fold of a block's PV into O.

Per key block the caller passes ``c = q_scale * k_scale * softmax_scale * log2(e)`` (all the
dequantization and softmax constants folded into one number; ``c > 0``). Row statistics are
kept in the scaled domain: ``m = max_j(s_j) * c``; the probabilities are

    p = exp2(s * c - (m - P_OFFSET))

one FFMA and one MUFU.EX2 per score. ``P_OFFSET = 8`` for FP8 scales P by 256 into the e4m3
range for free; ``l`` sums the scaled ``p`` so ``out = acc / l`` and
``lse = (m + log2(l) - P_OFFSET) * ln 2`` need no correction. Rows that have seen no key yet
keep ``m = -inf``; they use 0 as the subtracted max so no ``inf - inf`` appears.

Soft-capping (flash-attn's ``softcap``, the kernel's ``SOFTCAP``): the capped score in the exp2 domain is
``softcap * log2(e) * tanh(u)`` with ``u = s * c + shift`` (``c = q_scale * k_scale * softmax_scale / softcap``;
``shift``: the per-row ``softmax_scale * <q, mean> / softcap`` when K was smoothed, as tanh, unlike the
softmax, is not invariant to it). :func:`capped_scores` gives ``tanh(u)`` (MUFU.TANH, one more MUFU op per
score); the softmax step then takes it with ``c = softcap * log2(e)``, so ``m``, ``l`` and the LSE are those of
the capped scores.
"""

from __future__ import annotations

from .ablation import ABLATE_EXP, ABLATE_MAX, ablates
from .gluon_compat import gl, gluon


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
def row_sums_like(l_i, rows):
    """The row sums held in ``l_i`` (whole ``[M]``, or :func:`thread_row_sums`-shaped partials) in ``rows``' layout."""
    PARTIAL: gl.constexpr = len(l_i.shape) == 2
    if PARTIAL:
        l_rows = gl.convert_layout(gl.sum(l_i, axis=1), rows.type.layout)
    else:
        l_rows = gl.convert_layout(l_i, rows.type.layout)
    return l_rows


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
def tanh_approx(x):
    """``tanh(x)`` by the SFU (PTX ``tanh.approx.f32``, MUFU.TANH: relative error <= 2^-11 by the PTX ISA, as FA3's
    softcap uses); saturates to +-1, NaN stays NaN."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def capped_scores(s, c, shift, SHIFT: gl.constexpr):
    """``tanh(s * c + shift)`` (``shift`` per row, with ``SHIFT``; else ``tanh(s * c)``): the soft-capped scores
    divided by ``softcap``, in ``[-1, 1]``."""
    if SHIFT:
        u = gl.fma(s, c, shift[:, None])
    else:
        u = s * c
    return tanh_approx(u)


@gluon.jit
def online_softmax_step(s, c, m_i, l_i, P_OFFSET: gl.constexpr, ABLATE: gl.constexpr = 0,
                        PARTIAL_L: gl.constexpr = False):
    """One key block: ``(p, m_new, l_new, alpha)``; the caller rescales the accumulator by ``alpha``.
    ``ABLATE``: the timing ablations of :mod:`.ablation` (0: none)."""
    if ablates(ABLATE, ABLATE_MAX):  # timing ablation: wrong results
        m_blk = m_i
    else:
        m_blk = gl.max(s, axis=1) * c
    m_new = gl.maximum(m_i, m_blk)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_sub)
    x = gl.fma(s, c, (P_OFFSET - m_sub)[:, None])
    if ablates(ABLATE, ABLATE_EXP):  # timing ablation: wrong results
        p = x
    else:
        p = gl.exp2(x)
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
