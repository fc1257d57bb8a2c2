"""flash-attn 2 style entry points: ``from leanfa.compat.flash_attn import flash_attn_func``.

Supported subset (forward only): ``q, k, v`` ``(B, S, H, D)`` (packed ``(total, H, D)`` for
varlen) in bf16/fp16, GQA/MQA, head dims 64/64, 128/128, 192/128, 256/256, ``softmax_scale``,
``causal`` (bottom-right aligned, as flash-attn >= 2.1), ``deterministic`` (accepted; the
forward is deterministic anyway), ``dropout_p=0.0``.

Anything else raises ``NotImplementedError`` naming the option: ``dropout_p > 0``,
``window_size != (-1, -1)``, ``softcap != 0``, ``alibi_slopes``, ``return_attn_probs=True``
(flash-attn 2 returns the attention probabilities then, which leanfa never materializes; use
:func:`leanfa.flash_attn_func` with ``return_lse=True`` for the LSE), ``block_table``, and
``flash_attn_with_kvcache``. Gradients are not implemented.
"""

from __future__ import annotations

from ._common import reject

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _check_fa2(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs, block_table=None):
    reject("dropout_p", dropout_p != 0.0, dropout_p)
    reject("window_size", tuple(window_size) != (-1, -1), f"{tuple(window_size)} (sliding-window attention)")
    reject("softcap", softcap != 0.0, softcap)
    reject("alibi_slopes", alibi_slopes is not None)
    reject("return_attn_probs", bool(return_attn_probs), "True (attention probabilities are never materialized)")
    reject("block_table", block_table is not None, "(paged KV cache)")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2 ``flash_attn_func``; returns ``out`` ``(B, Sq, Hq, Dv)``."""
    from .. import api

    _check_fa2(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    return api.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2 ``flash_attn_varlen_func``; returns ``out`` ``(total_q, Hq, Dv)``."""
    from .. import api

    _check_fa2(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs, block_table)
    return api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal)


def flash_attn_with_kvcache(*args, **kwargs):
    """Not implemented: leanfa is a prefill kernel (no KV-cache/paged decode)."""
    raise NotImplementedError(
        "flash_attn_with_kvcache is not implemented by leanfa (prefill attention only); "
        "use flash_attn_varlen_func on the packed prefill tokens")
