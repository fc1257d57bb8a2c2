"""Context-parallel attention: one long self-attention spread over the ranks of a process group.

Each rank holds its shard of Q, K and V in the load-balanced layout (:mod:`.layout`: chunks ``r`` and
``2W-1-r`` of ``2W``). The K/V blocks go around the ring (:mod:`.ring`): at step ``s`` rank ``r`` holds
the block of rank ``r - s`` and, while it attends its two query chunks to that block's two key chunks,
sends the block on to rank ``r + 1`` and receives the next from rank ``r - 1``; after ``W`` steps it has
seen every key. Each (query chunk ``a``, key chunk ``b``) pair is, under a causal mask, fully visible
(``b < a``), diagonal (``b == a``: causal within, same length) or invisible (``b > a``: skipped); without
the mask every pair is fully visible. Each pair is one ``leanfa.flash_attn_func`` call returning a
float32 output and its LSE, merged exactly into the chunk's accumulator (:mod:`.merge`).

FP8 (``precision="fp8"``): the scheme of ``leanfa.attention(precision="fp8")`` — per-128-token Q/K
scales, K smoothing, per-channel V scales — applied once per rank to its shard. K smoothing subtracts the
mean of K over the *whole* sequence: one all-reduce of per-channel sums gives it, K is centred in
float32 and quantized without further smoothing, and the mean goes to every call (``k_mean``) so the
LSE is exact. The shard is quantized as two packed sequences (its chunks), so every chunk has its own
scale blocks and V scales and a chunk is a plain slice with its own descales. K and V travel in FP8
with their descales: half the bytes of BF16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import describe, validate
from .layout import rank_chunks, shard_sizes
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
    """A 16-bit shard: chunk ``i`` of q/k/v is a slice of the sequence axis."""

    def __init__(self, q, k, v, sizes):
        self.sizes, self.q, self.k, self.v = sizes, q, k, v

    def payload(self):
        return [self.k.contiguous(), self.v.contiguous()]

    @staticmethod
    def keys(block, sizes, i):
        k, v = block
        start = sizes[0] if i else 0
        return dict(k=k[:, start:start + sizes[i]], v=v[:, start:start + sizes[i]])

    def queries(self, i):
        start = self.sizes[0] if i else 0
        return dict(q=self.q[:, start:start + self.sizes[i]])


class _ShardFP8:
    """An FP8 shard quantized as two packed sequences (its chunks), K centred on the global mean."""

    def __init__(self, q, k, v, sizes, k_mean):
        import leanfa

        b, n = q.shape[:2]
        self.sizes, self.batch, self.tokens = sizes, b, n
        cu = torch.tensor([x for i in range(b) for x in (i * n, i * n + sizes[0])] + [b * n], dtype=torch.int32)
        cu = cu.to(q.device)
        k_centred = k.float() - k_mean.unsqueeze(1)
        longest = max(sizes)
        self.quant = leanfa.quantize_fp8(q.reshape(b * n, *q.shape[2:]), k_centred.reshape(b * n, *k.shape[2:]),
                                         v.reshape(b * n, *v.shape[2:]), "block", False, cu_seqlens_q=cu,
                                         cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
        self.k_mean = k_mean

    def payload(self):
        qt = self.quant
        return [qt.k, qt.k_descale, qt.v, qt.v_descale]

    @staticmethod
    def _chunk(x, desc, batch, tokens, sizes, i, channel):
        start = sizes[0] if i else 0
        x = x.view(batch, tokens, *x.shape[1:])[:, start:start + sizes[i]]
        desc = desc.view(batch, 2, *desc.shape[1:])[:, i]
        return x, desc if channel else desc[..., :_num_blocks(sizes[i])]

    def keys(self, block, sizes, i):
        k8, kd, v8, vd = block
        tokens = sum(sizes)
        k, k_descale = self._chunk(k8, kd, self.batch, tokens, sizes, i, channel=False)
        v, v_descale = self._chunk(v8, vd, self.batch, tokens, sizes, i, channel=True)
        return dict(k=k, v=v, k_descale=k_descale, v_descale=v_descale)

    def queries(self, i):
        q, q_descale = self._chunk(self.quant.q, self.quant.q_descale, self.batch, self.tokens, self.sizes, i,
                                   channel=False)
        return dict(q=q, q_descale=q_descale, k_mean=self.k_mean)


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
    from leanfa.api import HEAD_DIMS

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    descs = [None] * world
    dist.all_gather_object(descs, describe(q, k, v, causal, precision, softmax_scale, backend), group=group)
    total = validate(descs, HEAD_DIMS)

    sizes = shard_sizes(total, world, rank)
    batch, tokens, heads, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    if precision == "fp8":
        k_sum = k.float().sum(dim=1)  # (B, Hkv, D)
        if world > 1:
            dist.all_reduce(k_sum, group=group)
        shard = _ShardFP8(q, k, v, sizes, k_sum / max(total, 1))
    else:
        shard = _Shard16(q, k, v, sizes)
    block, pieces = pack(shard.payload())
    if len({d["q"][0][1] for d in descs}) == 1:  # equal shards: equal layouts
        layouts = [pieces] * world
    else:
        layouts = [None] * world
        dist.all_gather_object(layouts, pieces, group=group)

    out = torch.zeros((batch, tokens, heads, dv), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, tokens), float("-inf"), dtype=torch.float32, device=q.device)
    acc = [(out[:, :sizes[0]], lse[:, :, :sizes[0]]), (out[:, sizes[0]:], lse[:, :, sizes[0]:])]
    queries = [shard.queries(i) for i in range(2)]
    ring = Ring(group, q.device) if world > 1 else None
    src = rank
    for step in range(world):
        if step < world - 1:
            recv = torch.empty(nbytes(layouts[(src - 1) % world]), dtype=torch.uint8, device=q.device)
            works = ring.start(block, recv)
        src_sizes = shard_sizes(total, world, src)
        keys = unpack(block, layouts[src])
        for i, qc in enumerate(rank_chunks(rank, world)):
            for j, kc in enumerate(rank_chunks(src, world)):
                seen = visibility(qc, kc, causal)
                if seen == NONE or sizes[i] == 0 or src_sizes[j] == 0:
                    continue
                o, l = leanfa.flash_attn_func(**queries[i], **shard.keys(keys, src_sizes, j),
                                              softmax_scale=softmax_scale, causal=seen == DIAGONAL,
                                              return_lse=True, out_dtype=torch.float32, backend=backend)
                merge_into(*acc[i], o, l)
        if step < world - 1:
            ring.finish(works)
            block, src = recv, (src - 1) % world
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out

