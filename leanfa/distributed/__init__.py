"""Context parallelism: one long prefill across the ranks of a ``torch.distributed`` group.

* :func:`context_parallel_attention` — self-attention over a sequence sharded in the load-balanced
  causal layout, K/V passed around a ring (BF16 or FP8), partial results merged through their LSE.
* :func:`shard` / :func:`unshard` — a full ``(B, S, H, D)`` tensor to this rank's shard and back;
  :func:`shard_positions` — the shard's token positions (for rotary embeddings).
* :func:`context_parallel_varlen_attention`, :func:`shard_varlen` / :func:`unshard_varlen` /
  :func:`varlen_shard_indices` — the same for packed batches, each sequence sharded that way.

Nothing else in leanfa imports this package; it uses leanfa's public API (``flash_attn_func``,
``quantize_fp8``). docs/distributed.md describes the layout, the ring schedule and the merge.
"""

from .attention import context_parallel_attention, context_parallel_varlen_attention
from .layout import chunk_sizes, shard, shard_positions, shard_varlen, unshard, unshard_varlen, varlen_shard_indices
from .merge import merge_into

__all__ = ["context_parallel_attention", "context_parallel_varlen_attention", "shard", "unshard", "shard_positions",
           "shard_varlen", "unshard_varlen", "varlen_shard_indices", "chunk_sizes", "merge_into"]
