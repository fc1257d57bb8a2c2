"""flash-attn 2 style entry points: ``from leanfa.compat.flash_attn import flash_attn_func``.

Supported subset (forward only): ``q, k, v`` ``(B, S, H, D)`` (packed ``(total, H, D)`` for
varlen) in bf16/fp16, GQA/MQA, head dims up to 256 (the Hopper kernel runs 64/64, 128/128, 192/128 and
256/256; others the portable kernel; a head dim that is not a multiple of 8 is zero-padded to one, a copy of
``q``, ``k`` and ``v`` or of the caches, as flash-attn 2 pads it), ``softmax_scale``,
``causal`` (bottom-right aligned, as flash-attn >= 2.1), ``deterministic`` (accepted; the
forward is deterministic anyway), ``dropout_p=0.0``; the packed forms
(:func:`flash_attn_qkvpacked_func`, :func:`flash_attn_kvpacked_func` and their varlen forms:
views of the packed tensor, nothing is copied); ``return_attn_probs=True`` returns
``(out, softmax_lse, S_dmask)`` as flash-attn 2 does without dropout: ``softmax_lse`` float32
``(B, Hq, Sq)`` (varlen ``(Hq, total_q)``) and ``S_dmask`` an empty ``(0,)`` tensor of ``q``'s
dtype (flash-attn 2 materializes the probabilities only with dropout); ``window_size=(left, right)``
(sliding-window local attention, bottom-right aligned: query ``i`` sees keys
``[i + Sk - Sq - left, i + Sk - Sq + right]``, -1 unbounded, ``causal`` makes ``right`` 0) and
``softcap > 0`` (scores ``softcap * tanh(s / softcap)``), on every form; windows and ``softcap`` run on
the Hopper kernel (sm90; windows not in FP8 at head dim 256; over paged K/V where the Hopper kernel reads the
pages, below), else on the portable
kernel. Rows whose window holds no key are 0 with LSE ``-inf``; negative sides other than -1 or a
negative ``softcap`` raise ``ValueError``.

Paged K/V and KV caches (prefill, chunked prefill): ``block_table=`` (int32 ``(B, max_pages)``) on
:func:`flash_attn_varlen_func`, ``k``/``v`` then the paged caches ``(num_pages, page_size, Hkv, D)``
and ``cu_seqlens_k`` the key counts; :func:`flash_attn_with_kvcache` with ``cache_seqlens`` (int or
int32 ``(B,)``) over a dense ``(B, S_cache, Hkv, D)`` cache or, with ``block_table``, a paged one,
returning ``out`` or ``(out, softmax_lse)`` with ``return_softmax_lse``. ``page_size`` is 1, 2, 4,
8, 16, 32, 64 or a multiple of 128 (else ``ValueError``); ``Sq < Sk`` causal is bottom-right aligned; GQA, windows and
``softcap`` compose with paging. The page ids a call reads must lie in ``[0, num_pages)``: checked
on CPU tensors only (a check of GPU values would synchronize); :func:`flash_attn_with_kvcache` reads
``cache_seqlens`` on the host, as flash-attn 2 does, and raises :class:`BlockTableOverflowError` (a
``RuntimeError`` and a ``ValueError``) when a sequence has more keys than its ``block_table`` row holds. On sm90,
:func:`flash_attn_varlen_func` with ``block_table`` and :func:`flash_attn_with_kvcache` over paged caches with a
power-of-two ``page_size`` from 16 keys run on the Hopper kernel, which reads the rows of a sequence's last page
past its keys (masked out of the scores: they must hold finite values); other page sizes run on the portable kernel
(one warning where the Hopper kernel would have run).

Anything else raises ``NotImplementedError`` naming the option: ``dropout_p > 0``,
``alibi_slopes``, and in :func:`flash_attn_with_kvcache` the in-place append (``k``/``v``), rotary
embedding (``rotary_cos``/``rotary_sin``), ``cache_batch_idx`` and ``cache_leftpad`` with a paged cache. Gradients
are not implemented.
"""

from __future__ import annotations

import torch

from ._common import reject

__all__ = ["BlockTableOverflowError", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]


def _check_fa2(dropout_p, alibi_slopes):
    reject("dropout_p", dropout_p != 0.0, dropout_p)
    reject("alibi_slopes", alibi_slopes is not None)


def _unpack(name: str, packed, parts: int, axis: int, rank: int, layout: str):
    """``packed``'s ``parts`` views along ``axis`` (flash-attn 2's packed layouts)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != rank or packed.shape[axis] != parts:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(axis)


def _pad_head_dim(q, k, v, softmax_scale):
    """flash-attn 2's head dims that are not a multiple of 8 (e.g. 59, 111): ``q``, ``k``, ``v`` zero-padded to
    the next multiple of 8 (a copy of each, as flash-attn 2 makes), the default scale taken from the unpadded
    dim. Returns ``(q, k, v, softmax_scale, head_dim_v)``: zero channels leave the scores unchanged and add output
    channels that :func:`_unpad_head_dim` cuts off. Other tensors (a multiple of 8, FP8, not tensors) pass
    unchanged with ``head_dim_v`` None."""
    tensors = (q, k, v)
    if (not all(isinstance(t, torch.Tensor) and t.dim() >= 3 and t.element_size() >= 2 for t in tensors)
            or all(t.shape[-1] % 8 == 0 for t in tensors)):
        return q, k, v, softmax_scale, None
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    head_dim_v = v.shape[-1]
    q, k, v = (torch.nn.functional.pad(t, (0, -t.shape[-1] % 8)) for t in tensors)
    return q, k, v, softmax_scale, head_dim_v


def _unpad_head_dim(res, head_dim_v):
    """``res`` (``out`` or a tuple starting with it) with ``out`` cut back to ``head_dim_v`` channels."""
    if head_dim_v is None:
        return res
    if isinstance(res, tuple):
        return (res[0][..., :head_dim_v], *res[1:])
    return res[..., :head_dim_v]


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
    q, k, v, softmax_scale, head_dim_v = _pad_head_dim(q, k, v, softmax_scale)
    res = api.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=bool(return_attn_probs),
                              window_size=window_size, softcap=softcap)
    return _result(_unpad_head_dim(res, head_dim_v), return_attn_probs, q)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2 ``flash_attn_varlen_func``: ``out`` ``(total_q, Hq, Dv)``, or
    ``(out, softmax_lse, S_dmask)`` (``softmax_lse`` ``(Hq, total_q)``) with ``return_attn_probs``.
    ``block_table`` (int32 ``(B, max_pages)``): ``k``/``v`` are paged caches ``(num_pages, page_size, Hkv, D)``
    and ``cu_seqlens_k`` gives each sequence's key count."""
    from .. import api

    _check_fa2(dropout_p, alibi_slopes)
    q, k, v, softmax_scale, head_dim_v = _pad_head_dim(q, k, v, softmax_scale)
    res = api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale=softmax_scale, causal=causal, return_lse=bool(return_attn_probs),
                                     window_size=window_size, softcap=softcap, page_table=block_table)
    return _result(_unpad_head_dim(res, head_dim_v), return_attn_probs, q)


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


class BlockTableOverflowError(ValueError, RuntimeError):
    """A sequence's ``cache_seqlens`` exceeds what its ``block_table`` row addresses. A ``RuntimeError``, as
    flash-attn 2 raises it, and a ``ValueError``, as leanfa raises bad input."""


def _check_table_capacity(cache_seqlens, block_table, k_cache) -> None:
    """flash-attn 2's check of a paged ``flash_attn_with_kvcache`` call: ``max(cache_seqlens)`` fits the table's
    ``max_pages * page_size`` keys. A GPU ``cache_seqlens`` is read on the host, as flash-attn 2 reads it (one
    synchronization), except under CUDA graph capture or ``torch.compile``, where it cannot be read."""
    if not (isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and isinstance(k_cache, torch.Tensor)
            and k_cache.dim() == 4 and cache_seqlens is not None):
        return  # (not a paged call, or one the API's checks refuse)
    capacity = block_table.shape[1] * k_cache.shape[1]
    if isinstance(cache_seqlens, torch.Tensor):
        if (not cache_seqlens.numel() or torch.compiler.is_compiling()
                or (cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing())):
            return
        longest = int(cache_seqlens.max())
    else:
        longest = cache_seqlens
    if isinstance(longest, int) and longest > capacity:
        raise BlockTableOverflowError(
            f"cache_seqlens ({longest}) exceeds the keys a block_table row addresses ({block_table.shape[1]} pages "
            f"of {k_cache.shape[1]} = {capacity}): give the block_table more columns")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2 ``flash_attn_with_kvcache`` without its in-place append and rotary options: ``q``
    ``(B, Sq, H, D)`` over the first ``cache_seqlens[b]`` keys of each sequence's cache (int, int32 ``(B,)``, or
    None: the whole cache); caches dense ``(B_cache >= B, S_cache, Hkv, D)`` or, with ``block_table``, paged
    ``(num_pages, page_size, Hkv, D)``; ``cache_leftpad`` (int32 ``(B,)``, dense caches): sequence ``b``'s keys start
    at row ``cache_leftpad[b]``. Returns ``out``, or ``(out, softmax_lse)`` (``(B, H, Sq)``) with
    ``return_softmax_lse``. With ``block_table``, ``cache_seqlens`` longer than a table row raises
    :class:`BlockTableOverflowError` (read on the host as flash-attn 2 does: :func:`_check_table_capacity`)."""
    from .. import api
    from ..flash_attn_interface import cache_lengths, left_padded_attention

    _check_fa2(0.0, alibi_slopes)
    reject("k/v (appending new keys to the cache in place)", k is not None or v is not None)
    reject("rotary_cos/rotary_sin (rotary embedding)", rotary_cos is not None or rotary_sin is not None)
    reject("cache_batch_idx", cache_batch_idx is not None)
    reject("cache_leftpad with a paged cache (block_table)", cache_leftpad is not None and block_table is not None)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    batch = q.shape[0]
    _check_table_capacity(cache_seqlens, block_table, k_cache)
    if block_table is None and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor) \
            and k_cache.dim() == 4 and k_cache.shape[0] > batch:
        k_cache, v_cache = k_cache[:batch], v_cache[:batch]  # (no cache_batch_idx: sequence b is entry b)
    q, k_cache, v_cache, softmax_scale, head_dim_v = _pad_head_dim(q, k_cache, v_cache, softmax_scale)
    common = dict(softmax_scale=softmax_scale, causal=causal, return_lse=bool(return_softmax_lse),
                  window_size=window_size, softcap=softcap)
    used_k = cache_lengths(cache_seqlens, batch, q.device)
    if cache_leftpad is not None:  # a packed-K call over the flattened cache
        res = left_padded_attention(q, k_cache, v_cache, used_k, cache_leftpad, None, None, **common)
    else:
        res = api.flash_attn_func(q, k_cache, v_cache, seqused_k=used_k, page_table=block_table, **common)
    return _unpad_head_dim(res, head_dim_v)
