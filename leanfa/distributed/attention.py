"""Context-parallel attention: one long self-attention spread over the ranks of a process group.

Each rank holds its shard of Q, K and V in the load-balanced layout (:mod:`.layout`: chunks ``r`` and
``2W-1-r`` of ``2W``). The K/V blocks go around the ring (:mod:`.ring`): at step ``s`` rank ``r`` holds
the block of rank ``r - s`` and, while it attends its two query chunks to that block's two key chunks,
sends the block on to rank ``r + 1`` and receives the next from rank ``r - 1``; after ``W`` steps it has
seen every key. Each (query chunk ``a``, key chunk ``b``) pair is, under a causal mask, fully visible
(``b < a``), diagonal (``b == a``: causal within, same length) or invisible (``b > a``: skipped); without
the mask every pair is fully visible. Each pair is one ``leanfa.flash_attn_func`` call (for packed
batches ``flash_attn_varlen_func``, a shard's half being a packed batch of its own) returning a float32
output and its LSE, merged exactly into the chunk's accumulator (:mod:`.merge`).

FP8 (``precision="fp8"``): the scheme of ``leanfa.attention(precision="fp8")`` — per-128-token Q/K
scales, K smoothing, per-channel V scales — applied once per rank to its shard. K smoothing subtracts the
mean of K over the *whole* sequence: one all-reduce of per-channel sums gives it, K is centred in
float32 and quantized without further smoothing, and the mean goes to every call (``k_mean``) so the
LSE is exact (packed batches: one mean per sequence). The shard is quantized as packed sequences, one
per chunk (and sequence), so every chunk has its own scale blocks and V scales and a chunk is a plain
slice with its own descales. K and V travel in FP8
with their descales: half the bytes of BF16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import describe, validate
from .layout import _lengths, rank_chunks, shard_sizes, varlen_runs
from .merge import merge_into
from .ring import Ring, nbytes, pack, unpack

FULL, DIAGONAL, NONE = "full", "diagonal", "none"


def visibility(query_chunk: int, key_chunk: int, causal: bool) -> str:
    """How the queries of one chunk see the keys of another: FULL, DIAGONAL (causal within) or NONE."""
    if not causal or key_chunk < query_chunk:
        return FULL
    return DIAGONAL if key_chunk == query_chunk else NONE


def _num_blocks(tokens: int) -> int:
    import leanfa

    return max(1, -(-tokens // leanfa.SCALE_BLOCK))


class _Shard16:
    """A 16-bit dense shard: chunk ``i`` of q/k/v is a slice of the sequence axis."""

    def __init__(self, q, k, v, total, world, rank):
        self.q, self.k, self.v, self.total, self.world = q, k, v, total, world
        self.sizes = shard_sizes(total, world, rank)

    def payload(self):
        return [self.k.contiguous(), self.v.contiguous()]

    def chunk_tokens(self, rank, i):
        return shard_sizes(self.total, self.world, rank)[i]

    def keys(self, block, src, j):
        k, v = block
        sizes = shard_sizes(self.total, self.world, src)
        start = sizes[0] if j else 0
        return dict(k=k[:, start:start + sizes[j]], v=v[:, start:start + sizes[j]])

    def queries(self, i):
        start = self.sizes[0] if i else 0
        return dict(q=self.q[:, start:start + self.sizes[i]])


class _ShardFP8:
    """An FP8 dense shard quantized as two packed sequences per batch entry (its chunks), K centred on the
    global mean."""

    def __init__(self, q, k, v, total, world, rank, k_sum):
        import leanfa

        b, n = q.shape[:2]
        self.total, self.world, self.batch, self.tokens = total, world, b, n
        self.sizes = sizes = shard_sizes(total, world, rank)
        self.k_mean = k_sum / max(total, 1)
        cu = torch.tensor([x for i in range(b) for x in (i * n, i * n + sizes[0])] + [b * n], dtype=torch.int32)
        cu = cu.to(q.device)
        k_centred = k.float() - self.k_mean.unsqueeze(1)
        longest = max(sizes)
        self.cu = cu
        self.quant = leanfa.quantize_fp8(q.reshape(b * n, *q.shape[2:]), k_centred.reshape(b * n, *k.shape[2:]),
                                         v.reshape(b * n, *v.shape[2:]), "block", False, cu_seqlens_q=cu,
                                         cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)

    @staticmethod
    def sums(k):
        """What the ranks all-reduce for the K mean: K's per-channel sums over this shard, ``(B, Hkv, D)``."""
        return k.float().sum(dim=1)

    def payload(self):
        qt = self.quant  # (V token-major without the aligned layout's gaps: a half is a token range of it)
        return [qt.k, qt.k_descale, qt.packed_v(self.cu), qt.v_descale]

    def chunk_tokens(self, rank, i):
        return shard_sizes(self.total, self.world, rank)[i]

    @staticmethod
    def _chunk(x, desc, batch, sizes, i, channel):
        start = sizes[0] if i else 0
        x = x.view(batch, sum(sizes), *x.shape[1:])[:, start:start + sizes[i]]
        desc = desc.view(batch, 2, *desc.shape[1:])[:, i]
        return x, desc if channel else desc[..., :_num_blocks(sizes[i])]

    def keys(self, block, src, j):
        k8, kd, v8, vd = block
        sizes = shard_sizes(self.total, self.world, src)
        k, k_descale = self._chunk(k8, kd, self.batch, sizes, j, channel=False)
        v, v_descale = self._chunk(v8, vd, self.batch, sizes, j, channel=True)
        return dict(k=k, v=v, k_descale=k_descale, v_descale=v_descale)

    def queries(self, i):
        q, q_descale = self._chunk(self.quant.q, self.quant.q_descale, self.batch, self.sizes, i, channel=False)
        return dict(q=q, q_descale=q_descale, k_mean=self.k_mean)


class _Runs:
    """A packed shard's two halves (:mod:`.layout`: first chunks of every sequence, then second chunks): per
    rank and half, the token range, ``cu_seqlens`` (on the device) and the longest sequence."""

    def __init__(self, cu_seqlens, world, device):
        self.cu_seqlens, self.world, self.device = cu_seqlens, world, device
        self._cache = {}

    def lengths(self, rank):
        return varlen_runs(self.cu_seqlens, self.world, rank)

    def run(self, rank, i):
        key = (rank, i)
        if key not in self._cache:
            halves = self.lengths(rank)
            start = sum(halves[0]) if i else 0
            cu = [0]
            for n in halves[i]:
                cu.append(cu[-1] + n)
            cu_t = torch.tensor(cu, dtype=torch.int32).to(self.device)
            self._cache[key] = (start, start + cu[-1], cu_t, max(halves[i], default=0))
        return self._cache[key]

    def tokens(self, rank, i):
        start, end, _, _ = self.run(rank, i)
        return end - start


class _Varlen16:
    """A 16-bit packed shard: half ``i`` is a token range with its own ``cu_seqlens``."""

    def __init__(self, q, k, v, runs, rank):
        self.q, self.k, self.v, self.runs, self.rank = q, k, v, runs, rank

    def payload(self):
        return [self.k.contiguous(), self.v.contiguous()]

    def chunk_tokens(self, rank, i):
        return self.runs.tokens(rank, i)

    def keys(self, block, src, j):
        start, end, cu, longest = self.runs.run(src, j)
        k, v = block
        return dict(k=k[start:end], v=v[start:end], cu_seqlens_k=cu, max_seqlen_k=longest)

    def queries(self, i):
        start, end, cu, longest = self.runs.run(self.rank, i)
        return dict(q=self.q[start:end], cu_seqlens_q=cu, max_seqlen_q=longest)


class _VarlenFP8:
    """An FP8 packed shard quantized as ``2N`` packed sequences (half 0's N, then half 1's), K centred on each
    sequence's global mean."""

    def __init__(self, q, k, v, runs, rank, k_sum):
        import leanfa

        self.runs, self.rank = runs, rank
        lengths = torch.tensor(_lengths(runs.cu_seqlens), dtype=torch.float32, device=q.device)
        self.k_mean = k_sum / lengths.clamp(min=1)[:, None, None]
        self.nseq = len(lengths)
        halves = runs.lengths(rank)
        cu = [0]
        for n in halves[0] + halves[1]:
            cu.append(cu[-1] + n)
        cu = torch.tensor(cu, dtype=torch.int32).to(q.device)
        k_centred = k.float() - self.k_mean[_sequence_ids(runs, rank, q.device)]
        longest = max(halves[0] + halves[1], default=0)
        self.cu = cu
        self.quant = leanfa.quantize_fp8(q, k_centred, v, "block", False, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                         max_seqlen_q=longest, max_seqlen_k=longest)

    @staticmethod
    def sums(k, runs, rank):
        """Per-sequence, per-channel sums of K over this shard, ``(N, Hkv, D)``."""
        nseq = len(_lengths(runs.cu_seqlens))
        ids = _sequence_ids(runs, rank, k.device)
        return torch.zeros((nseq, *k.shape[1:]), dtype=torch.float32, device=k.device).index_add_(0, ids, k.float())

    def payload(self):
        qt = self.quant  # (V token-major without the aligned layout's gaps: a half is a token range of it)
        return [qt.k, qt.k_descale, qt.packed_v(self.cu), qt.v_descale]

    def chunk_tokens(self, rank, i):
        return self.runs.tokens(rank, i)

    def _half(self, x, desc, rank, i, channel):
        start, end, cu, longest = self.runs.run(rank, i)
        desc = desc[i * self.nseq:(i + 1) * self.nseq]
        return x[start:end], (desc if channel else desc[..., :_num_blocks(longest)]), cu, longest

    def keys(self, block, src, j):
        k8, kd, v8, vd = block
        k, k_descale, cu, longest = self._half(k8, kd, src, j, channel=False)
        v, v_descale, _, _ = self._half(v8, vd, src, j, channel=True)
        return dict(k=k, v=v, k_descale=k_descale, v_descale=v_descale, cu_seqlens_k=cu, max_seqlen_k=longest)

    def queries(self, i):
        q, q_descale, cu, longest = self._half(self.quant.q, self.quant.q_descale, self.rank, i, channel=False)
        return dict(q=q, q_descale=q_descale, k_mean=self.k_mean, cu_seqlens_q=cu, max_seqlen_q=longest)


def _sequence_ids(runs, rank, device):
    """The sequence of each token of rank ``rank``'s packed shard (int64)."""
    halves = runs.lengths(rank)
    counts = torch.tensor(halves[0] + halves[1], dtype=torch.int64)
    ids = torch.arange(len(halves[0]), dtype=torch.int64).repeat(2)
    return torch.repeat_interleave(ids, counts).to(device)


def _ring(shard, q, group, world, rank, same_layouts, causal, call, acc):
    """Attend this rank's two query chunks to every rank's K/V block as the blocks go around the ring,
    merging each chunk pair's result into ``acc`` (per query chunk: the accumulator's output and LSE).
    ``same_layouts``: every rank's block is laid out as this one's (else the layouts are all-gathered)."""
    block, pieces = pack(shard.payload())
    if same_layouts:
        layouts = [pieces] * world
    else:
        layouts = [None] * world
        dist.all_gather_object(layouts, pieces, group=group)
    queries = [shard.queries(i) for i in range(2)]
    ring = Ring(group, q.device) if world > 1 else None
    src = rank
    for step in range(world):
        if step < world - 1:
            recv = torch.empty(nbytes(layouts[(src - 1) % world]), dtype=torch.uint8, device=q.device)
            works = ring.start(block, recv)
        keys = unpack(block, layouts[src])
        for i, qc in enumerate(rank_chunks(rank, world)):
            for j, kc in enumerate(rank_chunks(src, world)):
                seen = visibility(qc, kc, causal)
                if seen == NONE or shard.chunk_tokens(rank, i) == 0 or shard.chunk_tokens(src, j) == 0:
                    continue
                o, l = call(**queries[i], **shard.keys(keys, src, j), causal=seen == DIAGONAL)
                merge_into(*acc[i], o, l)
        if step < world - 1:
            ring.finish(works)
            block, src = recv, (src - 1) % world


def _check_all(q, k, v, group, causal, precision, softmax_scale, backend, cu_seqlens=None):
    from leanfa.api import head_dims_problem

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    descs = [None] * world
    dist.all_gather_object(descs, describe(q, k, v, causal, precision, softmax_scale, backend, cu_seqlens),
                           group=group)
    return world, rank, descs, validate(descs, head_dims_problem)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group=None,
    causal: bool = True,
    precision: str = "fp8",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    backend: str = "auto",
):
    """Self-attention over a sequence sharded across the ranks of ``group`` (default: the world).

    ``q``: ``(B, L, Hq, Dqk)``, ``k``: ``(B, L, Hkv, Dqk)``, ``v``: ``(B, L, Hkv, Dv)``, bf16 or fp16: this
    rank's shard in the load-balanced layout (:func:`leanfa.distributed.shard` cuts a full tensor that
    way; ``L`` may differ between ranks by the layout's rule when the total is not a multiple of
    ``2 * world``). ``causal``, ``softmax_scale``, ``backend`` as in :func:`leanfa.flash_attn_func`;
    ``precision`` as in :func:`leanfa.attention` (``"fp8"`` or ``"bf16"``, the 16-bit kernel on the
    inputs as they are). Every rank must pass the same shapes (``L`` aside), dtypes and options; where
    they do not, every rank raises the same error.

    Returns this rank's shard of the output ``(B, L, Hq, Dv)`` (the inputs' dtype), and with
    ``return_lse`` its LSE ``(B, Hq, L)`` float32.
    """
    import leanfa

    world, rank, descs, total = _check_all(q, k, v, group, causal, precision, softmax_scale, backend)
    if precision == "fp8":
        k_sum = _ShardFP8.sums(k)
        if world > 1:
            dist.all_reduce(k_sum, group=group)
        shard = _ShardFP8(q, k, v, total, world, rank, k_sum)
    else:
        shard = _Shard16(q, k, v, total, world, rank)
    batch, tokens, heads, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    out = torch.zeros((batch, tokens, heads, dv), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, tokens), float("-inf"), dtype=torch.float32, device=q.device)
    first = shard.sizes[0]
    acc = [(out[:, :first], lse[:, :, :first]), (out[:, first:], lse[:, :, first:])]

    def call(**kw):
        return leanfa.flash_attn_func(**kw, softmax_scale=softmax_scale, return_lse=True, out_dtype=torch.float32,
                                      backend=backend)

    # equal shard lengths mean equal chunk sizes (layout.py's rule), so equal layouts
    _ring(shard, q, group, world, rank, len({d["q"][0][1] for d in descs}) == 1, causal, call, acc)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def context_parallel_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    group=None,
    causal: bool = True,
    precision: str = "fp8",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    backend: str = "auto",
):
    """:func:`context_parallel_attention` on a packed batch: every sequence sharded in the load-balanced layout.

    ``q``: ``(L, Hq, Dqk)``, ``k``/``v``: ``(L, Hkv, D)``: this rank's shard as
    :func:`leanfa.distributed.shard_varlen` cuts it (the first chunks of every sequence, then the second
    chunks). ``cu_seqlens``: the *full* batch's int32 ``(N + 1,)`` boundaries, the same on every rank (read
    on the host: on a GPU tensor that is one synchronization). Returns the shard's output ``(L, Hq, Dv)``
    and with ``return_lse`` its LSE ``(Hq, L)``, in shard order.
    """
    import leanfa

    world, rank, descs, _ = _check_all(q, k, v, group, causal, precision, softmax_scale, backend, cu_seqlens)
    cu = list(descs[0]["cu_seqlens"])
    runs = _Runs(cu, world, q.device)
    if precision == "fp8":
        k_sum = _VarlenFP8.sums(k, runs, rank)
        if world > 1:
            dist.all_reduce(k_sum, group=group)
        shard = _VarlenFP8(q, k, v, runs, rank, k_sum)
    else:
        shard = _Varlen16(q, k, v, runs, rank)
    tokens, heads, dv = q.shape[0], q.shape[1], v.shape[2]
    out = torch.zeros((tokens, heads, dv), dtype=torch.float32, device=q.device)
    lse = torch.full((heads, tokens), float("-inf"), dtype=torch.float32, device=q.device)
    acc = []
    for i in range(2):  # as (1, S, H, D) / (1, H, S) views: merge_into's layouts
        start, end, _, _ = runs.run(rank, i)
        acc.append((out[start:end].unsqueeze(0), lse[:, start:end].unsqueeze(0)))

    def call(**kw):
        o, l = leanfa.flash_attn_varlen_func(**kw, softmax_scale=softmax_scale, return_lse=True,
                                             out_dtype=torch.float32, backend=backend)
        return o.unsqueeze(0), l.unsqueeze(0)

    # 16-bit blocks depend on the shard length only; FP8 descales also on its longest chunk
    same = precision != "fp8" and len({d["q"][0][0] for d in descs}) == 1
    _ring(shard, q, group, world, rank, same, causal, call, acc)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
