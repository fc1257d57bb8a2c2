"""flash-attn 2 style entry points: ``from leanfa.compat.flash_attn import flash_attn_func``.

Supported subset (forward only): ``q, k, v`` ``(B, S, H, D)`` (packed ``(total, H, D)`` for
varlen) in bf16/fp16, GQA/MQA, head dims 64/64, 128/128, 192/128, 256/256, ``softmax_scale``,
``causal`` (bottom-right aligned, as flash-attn >= 2.1), ``deterministic`` (accepted; the
forward is deterministic anyway), ``dropout_p=0.0``; the packed forms
(:func:`flash_attn_qkvpacked_func`, :func:`flash_attn_kvpacked_func` and their varlen forms:
views of the packed tensor, nothing is copied); ``return_attn_probs=True`` returns
``(out, softmax_lse, S_dmask)`` as flash-attn 2 does without dropout: ``softmax_lse`` float32
``(B, Hq, Sq)`` (varlen ``(Hq, total_q)``) and ``S_dmask`` an empty ``(0,)`` tensor of ``q``'s
dtype (flash-attn 2 materializes the probabilities only with dropout); ``window_size=(left, right)``
(sliding-window local attention, bottom-right aligned: query ``i`` sees keys
``[i + Sk - Sq - left, i + Sk - Sq + right]``, -1 unbounded, ``causal`` makes ``right`` 0) and
``softcap > 0`` (scores ``softcap * tanh(s / softcap)``), on every form; these run on the portable
kernel. Rows whose window holds no key are 0 with LSE ``-inf``; negative sides other than -1 or a
negative ``softcap`` raise ``ValueError``.

Anything else raises ``NotImplementedError`` naming the option: ``dropout_p > 0``,
``alibi_slopes``, ``block_table``, and ``flash_attn_with_kvcache``. Gradients are not implemented.
"""

from __future__ import annotations

import torch

from ._common import reject

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _check_fa2(dropout_p, alibi_slopes, block_table=None):
    reject("dropout_p", dropout_p != 0.0, dropout_p)
    reject("alibi_slopes", alibi_slopes is not None)
    reject("block_table", block_table is not None, "(paged KV cache)")


def _unpack(name: str, packed, parts: int, axis: int, rank: int, layout: str):
    """``packed``'s ``parts`` views along ``axis`` (flash-attn 2's packed layouts)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != rank or packed.shape[axis] != parts:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(axis)


def _result(res, return_attn_probs: bool, q):
    """flash-attn 2's return value from leanfa's (``out``, or ``(out, lse)`` when ``return_attn_probs``):
    ``out``, or ``(out, softmax_lse, S_dmask)`` (``S_dmask`` empty: no dropout)."""
    if not return_attn_probs:
        return res
    out, lse = res
    return out, lse, torch.empty((0,), dtype=q.dtype, device=q.device)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2 ``flash_attn_func``: ``out`` ``(B, Sq, Hq, Dv)``, or ``(out, softmax_lse, S_dmask)``
    with ``return_attn_probs``."""
    from .. import api

    _check_fa2(dropout_p, alibi_slopes)
    res = api.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=bool(return_attn_probs),
                              window_size=window_size, softcap=softcap)
    return _result(res, return_attn_probs, q)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2 ``flash_attn_varlen_func``: ``out`` ``(total_q, Hq, Dv)``, or
    ``(out, softmax_lse, S_dmask)`` (``softmax_lse`` ``(Hq, total_q)``) with ``return_attn_probs``."""
    from .. import api

    _check_fa2(dropout_p, alibi_slopes, block_table)
    res = api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale=softmax_scale, causal=causal, return_lse=bool(return_attn_probs),
                                     window_size=window_size, softcap=softcap)
    return _result(res, return_attn_probs, q)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2 ``flash_attn_qkvpacked_func``: ``qkv`` ``(B, S, 3, H, D)``; as :func:`flash_attn_func`."""
    q, k, v = _unpack("qkv", qkv, 3, 2, 5, "(batch, seqlen, 3, heads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2 ``flash_attn_kvpacked_func``: ``kv`` ``(B, Sk, 2, Hkv, D)``; as :func:`flash_attn_func`."""
    k, v = _unpack("kv", kv, 2, 2, 5, "(batch, seqlen, 2, kv_heads, head_dim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn 2 ``flash_attn_varlen_qkvpacked_func``: ``qkv`` ``(total, 3, H, D)``, one ``cu_seqlens``
    for queries and keys; as :func:`flash_attn_varlen_func`."""
    q, k, v = _unpack("qkv", qkv, 3, 1, 4, "(total_tokens, 3, heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2 ``flash_attn_varlen_kvpacked_func``: ``kv`` ``(total_k, 2, Hkv, D)``; as
    :func:`flash_attn_varlen_func`."""
    k, v = _unpack("kv", kv, 2, 1, 4, "(total_tokens, 2, kv_heads, head_dim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(*args, **kwargs):
    """Not implemented: leanfa is a prefill kernel (no KV-cache/paged decode)."""
    raise NotImplementedError(
        "flash_attn_with_kvcache is not implemented by leanfa (prefill attention only); "
        "use flash_attn_varlen_func on the packed prefill tokens")
