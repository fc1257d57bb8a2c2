"""Context parallelism: one long prefill across the ranks of a ``torch.distributed`` group.

* :func:`context_parallel_attention` — self-attention over a sequence sharded in the load-balanced
  causal layout, K/V passed around a ring (BF16 or FP8), partial results merged through their LSE.
* :func:`shard` / :func:`unshard` — a full ``(B, S, H, D)`` tensor to this rank's shard and back;
  :func:`shard_positions` — the shard's token positions (for rotary embeddings).

Nothing else in leanfa imports this package; it uses leanfa's public API (``flash_attn_func``,
``quantize_fp8``). docs/distributed.md describes the layout, the ring schedule and the merge.
"""

from .attention import context_parallel_attention
from .layout import chunk_sizes, shard, shard_positions, unshard
from .merge import merge_into

__all__ = ["context_parallel_attention", "shard", "unshard", "shard_positions", "chunk_sizes", "merge_into"]
