"""The load-balanced causal layout of a sequence over ``W`` ranks, and moving tensors into and out of it.

The sequence (``S`` tokens) is cut into ``2W`` chunks, consecutive and as equal as possible: the first
``S mod 2W`` chunks hold one token more (``torch.tensor_split``'s rule). Rank ``r`` holds chunks ``r``
and ``2W-1-r``, in that order, concatenated: its *shard*. Under a causal mask the queries of chunk ``c``
see ``c`` whole chunks and half of their own (the diagonal), ``c + 1/2`` chunk pairs of work, so rank ``r``
does ``(r + 1/2) + (2W - 1 - r + 1/2) = 2W`` of them, the same on every rank (up to the one-token
differences of an uneven cut).

Pure functions (no communication) take ``rank`` and ``world``; :func:`shard` / :func:`unshard` take a
``torch.distributed`` process group.
"""

from __future__ import annotations

import torch


def chunk_sizes(total: int, world: int) -> list[int]:
    """Token counts of the ``2 * world`` chunks of a ``total``-token sequence."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if total < 0:
        raise ValueError(f"total must be non-negative, got {total}")
    n = 2 * world
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def chunk_starts(total: int, world: int) -> list[int]:
    """Start token of each of the ``2 * world`` chunks (and ``total`` last: ``2 * world + 1`` values)."""
    starts = [0]
    for size in chunk_sizes(total, world):
        starts.append(starts[-1] + size)
    return starts


def rank_chunks(rank: int, world: int) -> tuple[int, int]:
    """The two chunks rank ``rank`` holds, in shard order: ``(rank, 2*world - 1 - rank)``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return rank, 2 * world - 1 - rank


def shard_sizes(total: int, world: int, rank: int) -> tuple[int, int]:
    """Token counts of rank ``rank``'s two chunks, in shard order."""
    sizes = chunk_sizes(total, world)
    a, b = rank_chunks(rank, world)
    return sizes[a], sizes[b]


def shard_positions(total: int, world: int, rank: int, device=None) -> torch.Tensor:
    """int64 positions (in the full sequence) of rank ``rank``'s shard, in shard order: what rotary
    embeddings of the shard's tokens need."""
    starts = chunk_starts(total, world)
    a, b = rank_chunks(rank, world)
    return torch.cat([torch.arange(starts[a], starts[a + 1], device=device),
                      torch.arange(starts[b], starts[b + 1], device=device)])


def shard_of(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``x`` along ``dim`` (a new tensor)."""
    total = x.shape[dim]
    starts = chunk_starts(total, world)
    a, b = rank_chunks(rank, world)
    return torch.cat([x.narrow(dim, starts[a], starts[a + 1] - starts[a]),
                      x.narrow(dim, starts[b], starts[b + 1] - starts[b])], dim=dim)


def unshard_from(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (``shards[r]`` is rank ``r``'s), along ``dim``."""
    world = len(shards)
    total = sum(s.shape[dim] for s in shards)
    sizes = chunk_sizes(total, world)
    pieces: list[torch.Tensor | None] = [None] * (2 * world)
    for r, s in enumerate(shards):
        a, b = rank_chunks(r, world)
        if s.shape[dim] != sizes[a] + sizes[b]:
            raise ValueError(f"rank {r}'s shard has {s.shape[dim]} tokens along dim {dim}; the layout of {total} "
                             f"tokens over {world} ranks gives it {sizes[a] + sizes[b]}")
        pieces[a] = s.narrow(dim, 0, sizes[a])
        pieces[b] = s.narrow(dim, sizes[a], sizes[b])
    return torch.cat(pieces, dim=dim)


def _group_info(group):
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` (the same on every rank), along ``dim`` (1: the sequence
    of a ``(B, S, H, D)`` tensor). No communication."""
    rank, world = _group_info(group)
    return shard_of(x, rank, world, dim)


def unshard(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """The full tensor, on every rank, from each rank's shard ``x`` along ``dim`` (an all-gather; shards
    may differ in length by the layout's rule, other dims must agree)."""
    import torch.distributed as dist

    rank, world = _group_info(group)
    if world == 1:
        return shard_of(x, 0, 1, dim)  # a copy, as on more ranks
    lengths = [torch.zeros((), dtype=torch.int64, device=x.device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor(x.shape[dim], dtype=torch.int64, device=x.device), group=group)
    lengths = [int(n) for n in lengths]
    longest = max(lengths)
    pad_shape = list(x.shape)
    pad_shape[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim).contiguous()
    # as bytes: every backend moves uint8 (gloo has no float8, not every build has bfloat16)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather([g.view(-1).view(torch.uint8) for g in gathered], padded.view(-1).view(torch.uint8), group=group)
    return unshard_from([g.narrow(dim, 0, n) for g, n in zip(gathered, lengths)], dim)
