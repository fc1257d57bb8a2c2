"""The tile table of a packed varlen call: which (sequence, query tile) pairs the Hopper kernel computes, in
which order.

A varlen grid sized by ``max_seqlen_q`` has a program slot for every query tile of the longest sequence in
every sequence; for a batch of one long prompt and many short ones most slots are empty, and each still
costs a program (or a persistent round). The table lists only the real pairs, heaviest first (by the key blocks
the tile's last row sees, causal: so a chunk with ``Sq < Sk`` counts its cached prefix; with a sliding window the
keys of the tile's band), and the kernel walks
``pairs x query heads`` (:func:`.schedule.varlen_tile_coords`): the heads of one pair are adjacent, so the
query heads of one KV group read its K/V blocks close in time.

It is built on the GPU from ``cu_seqlens`` by one Triton launch (a counting sort by the number of key blocks each
tile sees, in one program) with no host synchronization, so a call with new lengths (or a CUDA-graph replay)
needs nothing from the host but the token count, the batch size and ``max_seqlen_k``. (The same table from ~15
PyTorch operations cost 0.53-0.76 ms of host time per call on the H200's host, run 78; this launch replaces them.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launcher import DirectLaunch
from ..sequences import block_slots

#: a pair is packed as ``b << PAIR_SHIFT | m`` in one int32 (the table kernel packs, ``schedule.varlen_tile_coords``
#: unpacks)
PAIR_SHIFT = tl.constexpr(16)
MAX_TILES_PER_SEQUENCE = 1 << PAIR_SHIFT.value
MAX_SEQUENCES = 1 << (31 - PAIR_SHIFT.value)


def capacity(total_q: int, batch: int, block_m: int) -> int:
    """The most (sequence, query tile) pairs ``batch`` sequences of ``total_q`` tokens in all can have."""
    return block_slots(total_q, batch, block_m)


def table_problem(total_q: int, batch: int, block_m: int) -> str | None:
    """Why a table cannot describe this batch, or None."""
    if batch >= MAX_SEQUENCES:
        return f"the Hopper varlen kernel takes fewer than {MAX_SEQUENCES} sequences (got {batch})"
    if total_q >= MAX_TILES_PER_SEQUENCE * block_m:
        return f"the Hopper varlen kernel takes fewer than {MAX_TILES_PER_SEQUENCE * block_m} query tokens (got {total_q})"
    return None


#: sequences x tiles handled per step of the one program (a 32 x 32 block of (sequence, tile) pairs)
BLOCK_B = 32
BLOCK_T = 32
#: warps of the one program: 2 lanes of a 32 x 32 block per thread (a thread's atomics run one after another)
WARPS = 16
KEY_BLOCK = tl.constexpr(128)  # keys per bucket of the counting sort (the Hopper kernel's key block)


@triton.jit
def _pair_buckets(cu_q, cu_k, b, t0, batch, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, NBUCKETS,
                  BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, window_left, window_right, WINDOW: tl.constexpr,
                  used_k=None):
    """For sequences ``b`` (a ``[BLOCK_B]`` block) and query tiles ``t0 + [0, BLOCK_T)``: ``(pair, bucket, real)``,
    the packed pair, the key blocks its last row sees (causal: bottom-right aligned; ``WINDOW``: the keys of the
    tile's band, sides ``window_left``/``window_right`` >= 0; clamped to the histogram), and whether the tile
    exists. ``used_k``: None, or FA3's ``seqused_k`` (each sequence's first ``used_k[b]`` keys only)."""
    in_batch = b < batch
    q0 = tl.load(cu_q + b, mask=in_batch, other=0)
    q1 = tl.load(cu_q + b + 1, mask=in_batch, other=0)
    k0 = tl.load(cu_k + b, mask=in_batch, other=0)
    k1 = tl.load(cu_k + b + 1, mask=in_batch, other=0)
    len_q, len_k = q1 - q0, k1 - k0
    if used_k is not None:
        len_k = tl.minimum(tl.load(used_k + b, mask=in_batch, other=0), len_k)
    tiles = (len_q + BLOCK_M - 1) // BLOCK_M
    m = t0 + tl.arange(0, BLOCK_T)
    real = m[None, :] < tiles[:, None]
    if WINDOW:
        hi = tl.minimum(len_k[:, None], (m[None, :] + 1) * BLOCK_M + (len_k - len_q)[:, None] + window_right)
        lo = tl.maximum(m[None, :] * BLOCK_M + (len_k - len_q)[:, None] - window_left, 0)
        seen = tl.maximum(hi - lo, 0)
    elif CAUSAL:
        seen = tl.minimum(len_k[:, None], (m[None, :] + 1) * BLOCK_M + (len_k - len_q)[:, None])
        seen = tl.maximum(seen, 0)
    else:
        seen = len_k[:, None] + 0 * m[None, :]
    bucket = tl.minimum((seen + KEY_BLOCK - 1) // KEY_BLOCK, NBUCKETS - 1)
    pair = (b[:, None] << PAIR_SHIFT) | m[None, :]
    return pair, bucket, real


@triton.jit
def _tile_counts(cu_q, b, batch, BLOCK_M: tl.constexpr):
    """Query tiles of sequences ``b`` (0 past the batch)."""
    in_batch = b < batch
    len_q = tl.load(cu_q + b + 1, mask=in_batch, other=0) - tl.load(cu_q + b, mask=in_batch, other=0)
    return (len_q + BLOCK_M - 1) // BLOCK_M


@triton.jit
def _tile_table_kernel(cu_q, cu_k, used_k, table, hist, batch, slots, NBUCKETS, CAUSAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                       window_left=0, window_right=0, WINDOW: tl.constexpr = False):
    """One program: ``table[0]`` = the number ``n`` of pairs, ``table[1 + i]`` the pairs, most key blocks first
    (pairs of one bucket in any order), -1 in ``table[1 + n .. 1 + slots)``. ``hist``: ``NBUCKETS`` int32 of
    scratch (the histogram, then each bucket's next free position). ``used_k``: :func:`_pair_buckets`'."""
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, NBUCKETS, BLOCK_H):
        tl.store(hist + h0 + offs_h, 0, mask=h0 + offs_h < NBUCKETS)
    tl.debug_barrier()
    total = 0
    for b0 in range(0, batch, BLOCK_B):  # the histogram of buckets
        b = b0 + tl.arange(0, BLOCK_B)
        tiles = _tile_counts(cu_q, b, batch, BLOCK_M)
        total += tl.sum(tiles, axis=0)
        for t0 in range(0, tl.max(tiles, axis=0), BLOCK_T):
            pair, bucket, real = _pair_buckets(cu_q, cu_k, b, t0, batch, CAUSAL, BLOCK_M, NBUCKETS, BLOCK_B, BLOCK_T,
                                               window_left, window_right, WINDOW, used_k)
            tl.atomic_add(hist + bucket, 1, mask=real)
    tl.debug_barrier()
    start = 0  # each bucket's first position, the fullest (most key blocks) first
    for h0 in range(0, NBUCKETS, BLOCK_H):
        idx = NBUCKETS - 1 - (h0 + offs_h)
        inside = idx >= 0
        count = tl.load(hist + idx, mask=inside, other=0)
        tl.store(hist + idx, start + tl.cumsum(count, axis=0) - count, mask=inside)
        start += tl.sum(count, axis=0)
    tl.debug_barrier()
    for b0 in range(0, batch, BLOCK_B):  # each pair to its bucket's next position
        b = b0 + tl.arange(0, BLOCK_B)
        tiles = _tile_counts(cu_q, b, batch, BLOCK_M)
        for t0 in range(0, tl.max(tiles, axis=0), BLOCK_T):
            pair, bucket, real = _pair_buckets(cu_q, cu_k, b, t0, batch, CAUSAL, BLOCK_M, NBUCKETS, BLOCK_B, BLOCK_T,
                                               window_left, window_right, WINDOW, used_k)
            pos = tl.atomic_add(hist + bucket, 1, mask=real)
            tl.store(table + 1 + pos, pair, mask=real)
    tl.store(table, total)
    for i0 in range(total, slots, BLOCK_H):  # the unused slots, so that a table's bytes follow from its batch
        tl.store(table + 1 + i0 + offs_h, -1, mask=i0 + offs_h < slots)
    if total == 0:  # (the kernel reads pair 0 of an empty table as a tile with no rows)
        tl.store(table + 1, 0)


_TILE_TABLE = DirectLaunch(_tile_table_kernel)


def _buckets(max_seqlen_k: int) -> int:
    return triton.cdiv(max(int(max_seqlen_k), 1), KEY_BLOCK.value) + 1


def table_size(total_q: int, batch: int, max_seqlen_k: int, block_m: int) -> int:
    """The entries of :func:`build`'s table for these arguments."""
    return 1 + capacity(total_q, batch, block_m) + _buckets(max_seqlen_k)


def build(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, max_seqlen_k: int, causal: bool,
          block_m: int, window: tuple[int, int] = (-1, -1), seqused_k: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[1 + capacity + buckets]``: entry 0 is the number ``n`` of real pairs, entries ``1 .. n`` the pairs
    ``b << PAIR_SHIFT | m`` (query tile ``m`` of sequence ``b``), most key blocks first, then -1 up to the capacity
    (:func:`capacity`; an empty table holds pair 0), then the launch's scratch.
    ``max_seqlen_k`` sizes the histogram (a longer sequence's tiles share its last bucket: still all listed).
    ``window``: flash-attn's ``window_size`` as :class:`leanfa.problem.Problem` stores it (-1: unbounded; ``causal``
    a right side of 0): the tiles are ordered by the keys of their band. ``seqused_k``: FA3's int32 ``(batch,)``, each
    sequence's first ``seqused_k[b]`` keys only (the tiles are ordered by those keys)."""
    batch = cu_seqlens_q.numel() - 1
    slots = capacity(total_q, batch, block_m)
    buckets = _buckets(max_seqlen_k)
    table = torch.empty(1 + slots + buckets, dtype=torch.int32, device=cu_seqlens_q.device)
    left, right = window
    band = {}  # (no window: the default launch, as before)
    if left >= 0 or right >= 0:  # an unbounded side as one past every key (total_q >= any sequence's queries)
        band = dict(window_left=left if left >= 0 else max(int(max_seqlen_k), 1),
                    window_right=0 if causal else right if right >= 0 else max(int(total_q), 1), WINDOW=True)
    # (seqused_k None: a constexpr None, the launch compiles as without the argument)
    _TILE_TABLE[(1, )](cu_seqlens_q, cu_seqlens_k, seqused_k, table, table[1 + slots:], batch, slots, buckets,
                       CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_B=BLOCK_B, BLOCK_T=BLOCK_T, BLOCK_H=1024,
                       num_warps=WARPS, **band)
    return table
