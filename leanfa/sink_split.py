"""FP8 attention with the first keys kept in BF16 ("sink" keys), merged through the LSE.

Why: on model-like activations almost all of the FP8 error comes from the Q·K scores, and most
of that from the attention-sink key(s) at the start of the sequence — a key of large norm whose
score carries a large absolute rounding error (docs/accuracy-notes.md: keeping the first 128
keys in BF16 gives 0.25–0.5x the error of all-FP8 on the Llama/Mistral/Qwen/DeepSeek presets).

Two implementations. In the kernel (``P`` a multiple of 128, portable backend): the FP8 call
also reads the unquantized Q, K, V and attends keys ``[0, P)`` from them after its FP8 keys, in
the same online softmax (scores of the smoothed K are matched by subtracting ``q·k_mean``); the
extra work is ``P`` keys per query tile and no extra launch. Split (any ``P``, any backend;
:func:`attention_sink_bf16`): keys ``[0, P)`` are attended in BF16, keys ``[P, Sk)`` in FP8, and
the two partial results are merged exactly with their log-sum-exps: ``out = Σ_i exp(lse_i − lse) · out_i``. With the
bottom-right causal convention the FP8 part is an ordinary causal call on ``k[:, P:]``; the
BF16 part is causal for the query rows that do not see the whole prefix and non-causal for the
rest. Dense inputs only. Extra work: a ``Sq x P`` BF16 block per head (~2P/Sk of a causal
call: 1.6% at 16K, 6% at 4K, 25% at 1K tokens) and one merge pass over the outputs.
"""

from __future__ import annotations

import torch

from . import ops
from .checks import resolve_softmax_scale


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Merge two attention results over disjoint key sets.

    ``out_*``: (B, S, H, D) float32; ``lse_*``: (B, H, S) float32 (``-inf`` = saw no key).
    Returns (out, lse); rows that saw no key in either part stay 0 / ``-inf``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    empty = torch.isneginf(lse)
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    w_a = torch.where(empty, torch.zeros_like(lse), torch.exp(lse_a - safe))
    w_b = torch.where(empty, torch.zeros_like(lse), torch.exp(lse_b - safe))
    out = out_a * w_a.transpose(1, 2).unsqueeze(-1) + out_b * w_b.transpose(1, 2).unsqueeze(-1)
    return out, lse


def attention_sink_bf16(q, k, v, *, prefix: int, causal: bool, softmax_scale, return_lse: bool,
                        quantize_kwargs: dict, backend: str, flash_attn_func):
    """FP8 attention over keys ``[prefix, Sk)`` plus BF16 attention over keys ``[0, prefix)``.

    ``flash_attn_func`` runs each part: :func:`leanfa.api.flash_attn_func` (the caller passes it
    in, so this module does not import the API layer above it)."""
    sq, sk = q.shape[1], k.shape[1]
    if sk <= prefix:  # everything is "prefix": plain 16-bit attention
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                               return_lse=return_lse, backend=backend)
    f32 = torch.float32
    kp, vp = k[:, :prefix], v[:, :prefix]
    offset = sk - sq  # bottom-right: query i sees keys j <= i + offset
    # rows [0, split) see only part of the prefix (causal within it), rows [split, Sq) all of it
    split = min(max(prefix - offset, 0), sq) if causal else 0
    parts_o, parts_l = [], []
    if split > 0:
        o, l = flash_attn_func(q[:, :split], kp, vp, softmax_scale=softmax_scale, causal=True,
                               return_lse=True, out_dtype=f32, backend=backend)
        parts_o.append(o)
        parts_l.append(l)
    if split < sq:
        o, l = flash_attn_func(q[:, split:], kp, vp, softmax_scale=softmax_scale, causal=False,
                               return_lse=True, out_dtype=f32, backend=backend)
        parts_o.append(o)
        parts_l.append(l)
    out_a, lse_a = torch.cat(parts_o, dim=1), torch.cat(parts_l, dim=2)
    quant = ops.quantize_fp8(q, k[:, prefix:], v[:, prefix:], **quantize_kwargs)
    # the FP8 part's LSE without the K-mean term, which is added back below from the 16-bit q:
    # with the e4m3 q, a large K mean (outlier channels) puts an error of ~|q - q8|.|mean| into
    # that LSE, and the merge would weight the two parts wrongly (docs/accuracy-notes.md)
    out_b, lse_b = flash_attn_func(quant.q, quant.k, quant.v, softmax_scale=softmax_scale, causal=causal,
                                   q_descale=quant.q_descale, k_descale=quant.k_descale,
                                   v_descale=quant.v_descale, return_lse=True, out_dtype=f32, backend=backend)
    if quant.k_mean is not None:
        group = q.shape[2] // k.shape[2]
        mean = quant.k_mean.repeat_interleave(group, dim=1)  # (B, Hq, D)
        lse_b = lse_b + resolve_softmax_scale(softmax_scale, q.shape[-1]) * torch.einsum("bshd,bhd->bhs", q.float(), mean)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
