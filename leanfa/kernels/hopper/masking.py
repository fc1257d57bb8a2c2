"""Which key blocks a query tile visits, and the mask of the blocks that need one.

Causal attention is aligned bottom-right (flash-attn): query ``i`` sees key ``j`` iff
``j <= i + seqlen_k - seqlen_q``. For a tile of rows ``[m_start, m_start + BLOCK_M)`` the key
blocks split into ``[0, n_full)``, visible to every row and every column in bounds (no mask),
and ``[n_full, n_end)``, the diagonal and the sequence tail, masked. Blocks past ``n_end`` are
fully masked and skipped.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon


@gluon.jit
def kv_block_range(m_start, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   CAUSAL: gl.constexpr):
    """Return ``(n_full, n_end)`` in key blocks."""
    n_blocks = (seqlen_k + BLOCK_N - 1) // BLOCK_N
    n_inbounds = seqlen_k // BLOCK_N  # blocks with no tail
    if CAUSAL:
        shift = seqlen_k - seqlen_q
        last_row = gl.minimum(m_start + BLOCK_M, seqlen_q) - 1
        # keys visible to the last real row: [0, last_row + shift]
        end_keys = gl.maximum(last_row + shift + 1, 0)
        n_end = gl.minimum((end_keys + BLOCK_N - 1) // BLOCK_N, n_blocks)
        # keys visible to the first row: [0, m_start + shift]
        full_keys = gl.maximum(m_start + shift + 1, 0)
        n_full = gl.minimum(full_keys // BLOCK_N, n_inbounds)
    else:
        n_end = n_blocks
        n_full = n_inbounds
    n_end = gl.where(m_start < seqlen_q, n_end, 0)  # a tile past the sequence (varlen) visits nothing
    n_full = gl.minimum(n_full, n_end)
    return n_full, n_end


@gluon.jit
def mask_scores(s, offs_m, offs_n, seqlen_q, seqlen_k, CAUSAL: gl.constexpr):
    """Set the scores of invisible (query, key) pairs to -inf."""
    visible = offs_n[None, :] < seqlen_k
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + (seqlen_k - seqlen_q))
    return gl.where(visible, s, float("-inf"))
