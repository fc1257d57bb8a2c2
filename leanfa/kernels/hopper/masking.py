"""Which key blocks a query tile visits, and the mask of the blocks that need one.

Causal attention is aligned bottom-right (flash-attn): query ``i`` sees key ``j`` iff
``j <= i + seqlen_k - seqlen_q``. For a tile of rows ``[m_start, m_start + BLOCK_M)`` the key
blocks split into ``[0, n_full)``, visible to every row and every column in bounds (no mask),
and ``[n_full, n_end)``, the diagonal and the sequence tail, masked. Blocks past ``n_end`` are
fully masked and skipped.

A sliding window (flash-attn's ``window_size=(left, right)``, the kernel's ``WINDOW``) bounds both sides: query
``i`` sees keys ``i + shift - left <= j <= i + shift + right`` (``shift = seqlen_k - seqlen_q``; the host passes
an unbounded side as a bound past every key, and causal as ``right = 0``). A tile then visits the key blocks
``[n_start, n_end)`` of its band only: ``[n_start, n_lfull)`` (the left edge) and ``[n_full, n_end)`` (the
right edge and the tail) masked, the blocks between not (:func:`window_block_range`, :func:`mask_band`).
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


@gluon.jit
def window_block_range(m_start, seqlen_q, seqlen_k, n_full, n_end, window_left, window_right,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key blocks a tile of rows ``[m_start, m_start + BLOCK_M)`` visits under the window ``(window_left,
    window_right)`` (both >= 0: bounds past every key stand for an unbounded side), given the non-causal
    :func:`kv_block_range` ``(n_full, n_end)``: ``(n_start, n_lfull, n_full, n_end)``. Blocks ``[n_start, n_end)``
    are visited; those before ``n_lfull`` or from ``n_full`` on are masked. A tile that sees no key has
    ``n_start = n_end = 0`` (so ``n_end > 0`` still says whether it loads Q)."""
    shift = seqlen_k - seqlen_q
    last_row = gl.minimum(m_start + BLOCK_M, seqlen_q) - 1
    # the last real row sees keys up to last_row + shift + right (the band's right end) ...
    end_keys = gl.maximum(last_row + shift + window_right + 1, 0)
    n_end = gl.minimum(n_end, (end_keys + BLOCK_N - 1) // BLOCK_N)
    # ... the first row every key of [0, m_start + shift + right] on the right side ...
    full_keys = gl.maximum(m_start + shift + window_right + 1, 0)
    n_full = gl.minimum(n_full, full_keys // BLOCK_N)
    # ... the first row keys from m_start + shift - left (the band's left end), the last row from
    # last_row + shift - left: blocks from there on need no mask on the left
    n_start = gl.minimum(gl.maximum(m_start + shift - window_left, 0) // BLOCK_N, n_end)
    n_lfull = (gl.maximum(last_row + shift - window_left, 0) + BLOCK_N - 1) // BLOCK_N
    n_full = gl.minimum(n_full, n_end)
    return n_start, n_lfull, n_full, n_end


@gluon.jit
def mask_band(s, offs_m, offs_n, seqlen_q, seqlen_k, window_left, window_right):
    """Set the scores of keys outside the sequence or outside row ``offs_m``'s window to -inf."""
    diag = offs_m[:, None] + (seqlen_k - seqlen_q)  # the key at the query's position
    visible = (offs_n[None, :] < seqlen_k) & (offs_n[None, :] <= diag + window_right)
    visible = visible & (offs_n[None, :] >= diag - window_left)
    return gl.where(visible, s, float("-inf"))
