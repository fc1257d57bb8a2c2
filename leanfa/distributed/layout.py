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
    rank, world = _group_info(group)
    if world == 1:
        return shard_of(x, 0, 1, dim)  # a copy, as on more ranks
    return unshard_from(_all_gather_shards(x, group, dim), dim)


def _all_gather_shards(x: torch.Tensor, group, dim: int) -> list[torch.Tensor]:
    """Every rank's ``x`` (lengths along ``dim`` may differ, other dims must agree), on every rank."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    lengths = [torch.zeros((), dtype=torch.int64, device=x.device) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor(x.shape[dim], dtype=torch.int64, device=x.device), group=group)
    lengths = [int(n) for n in lengths]
    pad_shape = list(x.shape)
    pad_shape[dim] = max(lengths) - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad_shape)], dim=dim).contiguous()
    # as bytes: every backend moves uint8 (gloo has no float8, not every build has bfloat16)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather([g.view(-1).view(torch.uint8) for g in gathered], padded.view(-1).view(torch.uint8), group=group)
    return [g.narrow(dim, 0, n) for g, n in zip(gathered, lengths)]


# ----------------------------------------------------------------------------- packed (varlen) sequences
#
# Each sequence of a packed batch is cut into 2W chunks by the rule above and rank r holds chunks r and
# 2W-1-r of every sequence. Its shard is *chunk-major*: the first chunks of all sequences (in sequence
# order), then the second chunks of all sequences. Each half is then an ordinary packed batch with its
# own ``cu_seqlens``, which is what the attention calls take.


def _lengths(cu_seqlens) -> list[int]:
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu}")
    return [b - a for a, b in zip(cu, cu[1:])]


def varlen_runs(cu_seqlens, world: int, rank: int) -> tuple[list[int], list[int]]:
    """Per-sequence token counts of rank ``rank``'s two halves (its first and its second chunks)."""
    a, b = rank_chunks(rank, world)
    sizes = [chunk_sizes(n, world) for n in _lengths(cu_seqlens)]
    return [s[a] for s in sizes], [s[b] for s in sizes]


def varlen_shard_indices(cu_seqlens, world: int, rank: int, device=None) -> torch.Tensor:
    """int64 indices, into the full packed batch, of rank ``rank``'s shard tokens, in shard order. Minus
    ``cu_seqlens`` of each token's sequence they are the positions rotary embeddings need."""
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    halves = ([], [])
    for start, n in zip(cu, _lengths(cu)):
        starts = chunk_starts(n, world)
        for half, c in zip(halves, rank_chunks(rank, world)):
            half.append(torch.arange(start + starts[c], start + starts[c + 1], device=device))
    return torch.cat([*halves[0], *halves[1]]) if cu[-1] else torch.zeros(0, dtype=torch.int64, device=device)


def shard_varlen(x: torch.Tensor, cu_seqlens, group=None, dim: int = 0) -> torch.Tensor:
    """This rank's shard of a full packed batch ``x`` (sequences at ``cu_seqlens`` along ``dim``, 0 for a
    ``(total, H, D)`` tensor; the same on every rank), in the chunk-major order above. No communication."""
    rank, world = _group_info(group)
    return x.index_select(dim, varlen_shard_indices(cu_seqlens, world, rank, x.device))


def unshard_varlen(x: torch.Tensor, cu_seqlens, group=None, dim: int = 0) -> torch.Tensor:
    """The full packed batch, on every rank, from each rank's shard ``x`` (an all-gather)."""
    _, world = _group_info(group)
    shards = _all_gather_shards(x, group, dim) if world > 1 else [x]
    total = sum(s.shape[dim] for s in shards)
    shape = list(x.shape)
    shape[dim] = total
    full = x.new_empty(shape)
    for r, s in enumerate(shards):
        full.index_copy_(dim, varlen_shard_indices(cu_seqlens, world, r, x.device), s)
    return full
