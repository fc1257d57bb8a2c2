"""The tile table of a packed varlen call: which (sequence, query tile) pairs the Hopper kernel computes, in
which order.

A varlen grid sized by ``max_seqlen_q`` has a program slot for every query tile of the longest sequence in
every sequence; for a batch of one long prompt and many short ones most slots are empty, and each still
costs a program (or a persistent round). The table lists only the real pairs, heaviest first (causal: by the
keys the tile's last row sees, so a chunk with ``Sq < Sk`` counts its cached prefix), and the kernel walks
``pairs x query heads`` (:func:`.schedule.varlen_tile_coords`): the heads of one pair are adjacent, so the
query heads of one KV group read its K/V blocks close in time.

It is built on the GPU from ``cu_seqlens`` with a fixed number of torch operations and no host
synchronization, so a call with new lengths (or a CUDA-graph replay) needs nothing from the host but the
token count, which the packed tensors' shape gives.
"""

from __future__ import annotations

import torch

#: a pair is packed as ``b << PAIR_SHIFT | m`` in one int32
PAIR_SHIFT = 16
MAX_TILES_PER_SEQUENCE = 1 << PAIR_SHIFT
MAX_SEQUENCES = 1 << (31 - PAIR_SHIFT)


def capacity(total_q: int, batch: int, block_m: int) -> int:
    """The most (sequence, query tile) pairs ``batch`` sequences of ``total_q`` tokens in all can have."""
    return total_q // block_m + batch


def table_problem(total_q: int, batch: int, block_m: int) -> str | None:
    """Why a table cannot describe this batch, or None."""
    if batch >= MAX_SEQUENCES:
        return f"the Hopper varlen kernel takes fewer than {MAX_SEQUENCES} sequences (got {batch})"
    if total_q >= MAX_TILES_PER_SEQUENCE * block_m:
        return f"the Hopper varlen kernel takes fewer than {MAX_TILES_PER_SEQUENCE * block_m} query tokens (got {total_q})"
    return None


def build(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, causal: bool,
          block_m: int) -> torch.Tensor:
    """int32 ``[1 + capacity]``: entry 0 is the number ``n`` of real pairs, entries ``1 .. n`` the pairs
    ``b << 16 | m`` (query tile ``m`` of sequence ``b``) heaviest first, the rest -1."""
    batch = cu_seqlens_q.numel() - 1
    slots = capacity(total_q, batch, block_m)
    dev = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    tiles = (len_q + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    slot = torch.arange(slots, device=dev)
    b = torch.searchsorted(ends, slot, right=True).clamp_(max=max(batch - 1, 0))
    m = slot - (ends[b] - tiles[b])
    real = slot < ends[-1:]
    if causal:  # keys seen by the tile's last row (bottom-right aligned causal mask)
        seen = torch.minimum(len_k[b], (m + 1) * block_m + len_k[b] - len_q[b]).clamp_(min=0)
    else:
        seen = len_k[b]
    order = torch.argsort(torch.where(real, seen, -1), descending=True, stable=True)
    pairs = torch.where(real, (b << PAIR_SHIFT) | m, -1)[order]
    return torch.cat([ends[-1:], pairs]).to(torch.int32)
