"""Which query tiles a program computes (the tile scheduler of the Hopper kernel).

The tiles are numbered heaviest first (:func:`tile_coords`): every head's last query tile (it sees
the most keys, causal) comes before any first tile, so the last wave is made of cheap tiles. GQA:
query head ``h`` reads KV head ``h // group_size``. One tile per program on the 2-D grid
``(batch * heads, query tiles)``, or -- ``PERSISTENT`` -- a 1-D grid of one program per SM that
walks the tiles in rounds of one per program, alternating direction (:func:`round_tile`), and pays
the pipeline fill once.

Varlen (packed ``(total, H, D)`` tensors): sequence ``b``'s tokens are ``[cu_seqlens[b], cu_seqlens[b + 1])``,
and the tiles are read from the call's tile table (:mod:`.varlen_tiles`: only the real (sequence, query
tile) pairs, heaviest first, each for every query head in turn, :func:`varlen_tile_coords`); the number
of tiles is the table's first entry times the heads, read on the GPU.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon
from .varlen_tiles import PAIR_SHIFT


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
def varlen_tile_coords(t, tiles, num_heads, group_size, BLOCK_M: gl.constexpr):
    """``(b, h, hkv, m_start)`` of varlen tile ``t`` (``< num_tiles``): query head ``t % num_heads`` of the
    table's pair ``t // num_heads`` (``tiles[1 + i] = b << PAIR_SHIFT | m``, :mod:`.varlen_tiles`)."""
    pair = gl.maximum(gl.load(tiles + 1 + t // num_heads), 0)  # (an empty batch's -1 padding reads as pair 0)
    h = t % num_heads
    return pair >> PAIR_SHIFT, h, h // group_size, (pair & ((1 << PAIR_SHIFT) - 1)) * BLOCK_M


@gluon.jit
def round_tile(r, first, step):
    """The tile of round ``r`` of a persistent program: rounds alternate direction (boustrophedon),
    so the program that took one of a round's heaviest tiles takes one of the next round's lightest.
    (Run 16: with plain striding ``first + r * step`` program 0 got ~12% more keys than program 131
    at 16K causal, and the persistent kernel was 2-4% slower than one tile per program.)"""
    return r * step + gl.where(r % 2 == 0, first, step - 1 - first)


@gluon.jit
def program_tiles(num_bh, num_m_tiles, num_heads, tiles, PERSISTENT: gl.constexpr, VARLEN: gl.constexpr):
    """``(first, step, num_tiles)``: this program computes tiles ``first, first + step, ... < num_tiles``
    (persistent: :func:`round_tile` of rounds ``0, 1, ...``). Varlen: the tile table's pairs times the heads
    (the grid may be larger: its programs past the last tile have nothing to do)."""
    if VARLEN:
        num_tiles = gl.load(tiles) * num_heads
    else:
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
