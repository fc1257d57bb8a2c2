"""Which query tiles a program computes (the tile scheduler of the Hopper kernel).

The tiles are numbered heaviest first (:func:`tile_coords`): every head's last query tile (it sees
the most keys, causal) comes before any first tile, so the last wave is made of cheap tiles. GQA:
query head ``h`` reads KV head ``h // group_size``. One tile per program on the 2-D grid
``(batch * heads, query tiles)``, or -- ``PERSISTENT`` -- a 1-D grid of one program per SM that
walks the tiles in rounds of one per program, alternating direction (:func:`round_tile`), and pays
the pipeline fill once.

Varlen (packed ``(total, H, D)`` tensors): program ``b`` of axis 0 is sequence ``b``, whose tokens
are ``[cu_seqlens[b], cu_seqlens[b + 1])``; the grid covers ``max_seqlen_q`` and the tiles past a
shorter sequence visit no key blocks (:func:`.masking.kv_block_range`).
"""

from __future__ import annotations

from .gluon_compat import gl, gluon


@gluon.jit
def tile_coords(t, num_bh, num_heads, group_size, num_m_tiles, BLOCK_M: gl.constexpr):
    """``(b, h, hkv, m_start)`` of tile ``t``: query tile ``num_m_tiles - 1 - t // num_bh`` of
    ``(b, h)`` number ``t % num_bh`` (so tiles ``[0, num_bh)`` are every head's last, heaviest, one)."""
    pid_bh = t % num_bh
    pid_m = num_m_tiles - 1 - t // num_bh
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    return b, h, h // group_size, pid_m * BLOCK_M


@gluon.jit
def round_tile(r, first, step):
    """The tile of round ``r`` of a persistent program: rounds alternate direction (boustrophedon),
    so the program that took one of a round's heaviest tiles takes one of the next round's lightest.
    (Run 16: with plain striding ``first + r * step`` program 0 got ~12% more keys than program 131
    at 16K causal, and the persistent kernel was 2-4% slower than one tile per program.)"""
    return r * step + gl.where(r % 2 == 0, first, step - 1 - first)


@gluon.jit
def program_tiles(num_bh, num_m_tiles, PERSISTENT: gl.constexpr):
    """``(first, step, num_tiles)``: this program computes tiles ``first, first + step, ... < num_tiles``
    (persistent: :func:`round_tile` of rounds ``0, 1, ...``)."""
    num_tiles = num_bh * num_m_tiles
    if PERSISTENT:
        first = gl.program_id(0)
        step = gl.num_programs(0)
    else:  # grid (num_bh, num_m_tiles): the launch order is the tile order
        first = gl.program_id(1) * num_bh + gl.program_id(0)
        step = num_tiles
    return first, step, num_tiles


@gluon.jit
def sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k, VARLEN: gl.constexpr):
    """``(tma_b, q_start, k_start, seqlen_q, seqlen_k)`` of sequence ``b``: the batch coordinate of
    the TMA boxes, the first Q/K token in the descriptors, and this sequence's lengths. Dense: batch
    ``b`` from token 0; varlen: batch 0 (the packed tensors) from the ``cu_seqlens`` entries."""
    if VARLEN:
        q_start = gl.load(cu_seqlens_q + b)
        k_start = gl.load(cu_seqlens_k + b)
        seqlen_q = gl.load(cu_seqlens_q + b + 1) - q_start
        seqlen_k = gl.load(cu_seqlens_k + b + 1) - k_start
        tma_b = 0
    else:
        q_start = b * 0  # a tensor, like the varlen offsets, so callers can widen it
        k_start = b * 0
        tma_b = b
    return tma_b, q_start, k_start, seqlen_q, seqlen_k
