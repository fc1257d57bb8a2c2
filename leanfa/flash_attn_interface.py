"""FlashAttention-3 style entry points (``hopper/flash_attn_interface.py`` names).

Swap ``from flash_attn_interface import flash_attn_func`` for
``from leanfa.flash_attn_interface import flash_attn_func``. Supported subset (forward only):

* ``q, k, v`` ``(B, S, H, D)`` (or packed ``(total, H, D)`` for varlen), bf16/fp16/fp8 e4m3,
  GQA/MQA, head dims multiples of 8 up to 256, and q/k up to 64 with v up to 512 (FA3's MLA form) (the Hopper kernel: 64/64, 128/128, 192/128, 256/256; others on
  the portable kernel, one warning); also (leanfa's mixed mode) fp8 e4m3 ``q``/``k``
  with a bf16/fp16 ``v``: FP8 Q·K with the Q/K descales, P·V in 16 bits, no ``v_descale``;
* ``softmax_scale``, ``causal`` (bottom-right aligned), ``q_descale``/``k_descale``/
  ``v_descale`` (FA3's ``(B, Hkv)`` float32 per-head descales, and leanfa's other forms);
* ``seqused_q``/``seqused_k`` (int32 ``(B,)``) on :func:`flash_attn_varlen_func`: only the first
  ``seqused_q[b]`` queries and ``seqused_k[b]`` keys of sequence ``b`` are used; output rows past
  ``seqused_q[b]`` are 0 with LSE ``-inf`` (FA3 leaves them unwritten). With ``cu_seqlens_q`` and
  ``cu_seqlens_k`` both None, ``q, k, v`` are dense ``(B, S, H, D)`` tensors, as in FA3. These calls
  run on the Hopper kernel on sm90;
* ``window_size=(left, right)`` (sliding-window local attention: query ``i`` sees keys
  ``[i + Sk - Sq - left, i + Sk - Sq + right]``, -1 unbounded; ``causal`` makes ``right`` 0) and
  ``softcap > 0`` (scores ``softcap * tanh(s / softcap)``), dense and varlen, 16-bit and FP8. Rows
  whose window holds no key are 0 with LSE ``-inf``. Negative sides other than -1, or a negative
  ``softcap``, raise ``ValueError``. Windows run on the Hopper kernel (only the key blocks of each
  query tile's band are read), dense and varlen, BF16/FP16, FP8 and the mixed mode, except FP8 at head
  dim 256, and over the paged caches the Hopper kernel reads (below); so does 16-bit ``softcap`` (tanh on the
  SFU, ``tanh.approx.f32``, as FA3) in 16-bit and FP8, with or without a window, at every head dim the kernel
  runs; windows in FP8 at head dim 256 run on the portable kernel (one warning where the Hopper kernel would have
  run);
* paged K/V and KV caches (prefill, chunked prefill): :func:`flash_attn_with_kvcache` with
  ``cache_seqlens`` (int or int32 ``(B,)``), ``page_table`` (int32 ``(B, max_pages)`` over caches
  ``(num_pages, page_size, Hkv, D)``, ``page_size`` 1, 2, 4, 8, 16, 32, 64 or a multiple of 128; else ``ValueError``) or a
  dense ``(B, S_cache, Hkv, D)`` cache, ``q`` dense or packed (``cu_seqlens_q``/``max_seqlen_q``),
  ``Sq < Sk`` causal bottom-right aligned, GQA, FP8 caches with ``(B, Hkv)`` descales, windows and
  ``softcap``; and vLLM's ``block_table=`` on :func:`flash_attn_varlen_func` (``k``/``v`` the paged
  caches, key lengths from ``cu_seqlens_k`` and/or ``seqused_k``; ``cu_seqlens_k`` may be None). The
  page ids a call reads must lie in ``[0, num_pages)``: checked on CPU tensors only (a check of GPU
  values would synchronize). On sm90 the Hopper kernel reads paged 16-bit and FP8 caches of a power-of-two
  ``page_size`` from 16 keys, the key lengths from ``cu_seqlens_k``, ``seqused_k``/``cache_seqlens`` (vLLM's FA3
  call: ``cu_seqlens_k=None``) or the whole table, with or without a window or ``softcap`` (an FP8 V cache
  through a transposed copy of each sequence's V pages made per call); other page sizes, and a packed ``q`` over
  a dense cache, on the portable kernel (one warning). The Hopper kernel reads the rows of a sequence's last page past its keys
  (masked out of the scores): they must hold finite values (stale keys or zeros do; NaN/Inf there gives
  NaN rows);
* ``attention_chunk > 0`` (Llama-4's chunked local attention: query ``i`` at key position ``pos = i + Sk - Sq``
  sees only keys in ``[pos - pos mod c, pos - pos mod c + c)``, intersected with ``causal`` and ``window_size``;
  per sequence for varlen, ``seqused_k`` and KV caches) and ``qv`` (MLA's absorbed form: scores
  ``softmax_scale * (q.k + qv.v)``, default ``softmax_scale`` ``1/sqrt(d + dv)``; ``qv`` in q's dtype and layout
  with v's head dim, an FP8 ``qv`` dequantized by ``q_descale``), dense, varlen and KV-cache calls, 16-bit and FP8:
  on the portable kernel (one warning on sm90). A negative ``attention_chunk``, or a ``qv`` of the wrong shape,
  dtype or device, raises ``ValueError``;
* empty batches: sequences that are all empty, ``max_seqlen_q = max_seqlen_k = 0``;
* ``return_attn_probs=True`` returns ``(out, softmax_lse)`` as FA3 does;
* ``deterministic``, ``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``,
  ``rotary_interleaved`` (without rotary) are accepted and ignored (leanfa's forward is
  deterministic and needs no splits);
* :func:`flash_attn_with_kvcache` with ``return_softmax_lse=True`` returns FA3's
  ``(out, softmax_lse, out_accum, softmax_lse_accum)``, the last two empty (no splits);
* :func:`flash_attn_combine` merges split results through their LSE as FA3's does (in PyTorch, float32);
  :func:`get_scheduler_metadata` returns an empty tensor: leanfa's KV-cache calls need no metadata (for a
  packed varlen batch's schedule, made once per step, see :func:`leanfa.varlen_schedule`).

Anything else raises ``NotImplementedError`` naming the option: a packed ``q`` with dense ``k``/``v`` in :func:`flash_attn_varlen_func` without ``block_table``
(one of ``cu_seqlens_q``/``cu_seqlens_k`` None); in :func:`flash_attn_with_kvcache` the in-place
append (``k``/``v``, ``cu_seqlens_k_new``), rotary embedding (``rotary_cos``/``rotary_sin``,
``rotary_seqlens``), ``cache_batch_idx``, and ``cache_leftpad`` with a ``page_table`` (with a dense cache it runs:
:func:`left_padded_cache`). Gradients are not implemented.
"""

from __future__ import annotations

import torch

from .compat._common import reject

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "get_scheduler_metadata"]


def flash_attn_func(
    q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False,
):
    """FA3 ``flash_attn_func``: ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs``."""
    from . import api

    return api.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                               k_descale=k_descale, v_descale=v_descale, return_lse=bool(return_attn_probs),
                               window_size=window_size, softcap=softcap, attention_chunk=attention_chunk, qv=qv)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_q=None, seqused_k=None,
    softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
    deterministic=False, sm_margin=0, return_attn_probs=False, *, block_table=None,
):
    """FA3 ``flash_attn_varlen_func``: ``out``, or ``(out, softmax_lse)`` (``(H, total_q)``; with
    ``cu_seqlens_q = cu_seqlens_k = None`` dense ``(B, S, H, D)`` tensors and LSE ``(B, H, Sq)``).
    ``block_table`` (vLLM's FA fork): ``k``/``v`` are paged caches ``(num_pages, page_size, Hkv, D)``; the key
    lengths come from ``cu_seqlens_k`` (its differences) and/or ``seqused_k`` (on sm90 the Hopper kernel runs
    these calls: the module docstring says which). ``cu_seqlens_k``, ``max_seqlen_q`` and
    ``max_seqlen_k`` default to None so that vLLM's keyword call, which leaves ``cu_seqlens_k`` out, binds; a packed
    ``q`` still needs ``max_seqlen_q``."""
    from . import api

    common = dict(softmax_scale=softmax_scale, causal=causal, q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale, return_lse=bool(return_attn_probs), seqused_q=seqused_q,
                  seqused_k=seqused_k, window_size=window_size, softcap=softcap, attention_chunk=attention_chunk,
                  qv=qv)
    if block_table is not None:  # paged K/V: cu_seqlens_k (if any) gives only the key lengths
        if cu_seqlens_q is None:
            reject("cu_seqlens_k with block_table and a dense q", cu_seqlens_k is not None)
            return api.flash_attn_func(q, k, v, page_table=block_table, **common)
        return api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          page_table=block_table, **common)
    reject("cu_seqlens_q/cu_seqlens_k", (cu_seqlens_q is None) != (cu_seqlens_k is None),
           "with one of them None (a packed q with dense k/v, or the reverse)")
    if cu_seqlens_q is None:  # FA3: no cu_seqlens means dense (B, S, H, D) tensors
        return api.flash_attn_func(q, k, v, **common)
    return api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **common)


def left_padded_cache(q, k_cache, v_cache, used_k, cache_leftpad, cu_seqlens_q, max_seqlen_q, descales=None):
    """FA's ``cache_leftpad`` over a dense cache ``(B_cache, S, Hkv, D)``: sequence ``b``'s keys are rows
    ``[cache_leftpad[b], used_k[b])`` of entry ``b`` (``used_k`` None: up to ``S``; causal and windows align on that
    count). Returns the packed call that computes it, made on the device without a host sync: the positional
    arguments of :func:`leanfa.flash_attn_varlen_func` ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)`` and its keywords (``seqused_k`` and the FP8 ``descales`` given, ``(B, Hkv)`` each). The cache is
    flattened to ``(B * S, Hkv, D)`` (a view of a cache whose first two dims are contiguous, else a copy) and an
    empty sequence goes first, holding rows ``[0, cache_leftpad[0])``, so that ``cu_seqlens_k`` starts at 0:
    ``cu_seqlens_k = [0, b * S + cache_leftpad[b] ..., B * S]``, ``seqused_k = [0, used_k - cache_leftpad]`` (the
    descales get a leading row of ones). A dense ``q`` ``(B, Sq, H, D)`` is packed (:func:`unpack_dense` restores
    the output's shape; the empty sequence has no queries, so the packed output is the batch's)."""
    if not isinstance(cache_leftpad, torch.Tensor) or cache_leftpad.dtype != torch.int32:
        raise TypeError(f"cache_leftpad must be an int32 tensor, got {cache_leftpad!r:.80}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"cache_leftpad needs dense caches (B, S, Hkv, D) of one (B, S), got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
    slot, dev = k_cache.shape[1], q.device
    if cache_leftpad.shape != (batch,) or cache_leftpad.device != dev:
        raise ValueError(f"cache_leftpad must have shape ({batch},) on {dev}, got {tuple(cache_leftpad.shape)} "
                         f"on {cache_leftpad.device}")
    if k_cache.shape[0] < batch or batch * slot >= 2 ** 31:
        raise ValueError(f"cache_leftpad needs a cache entry per sequence and fewer than 2**31 cache rows, got "
                         f"{k_cache.shape[0]} entries of {slot} for {batch} sequences")
    used = torch.full_like(cache_leftpad, slot) if used_k is None else used_k
    if dev.type == "cpu" and not torch.compiler.is_compiling() and batch:
        if bool((cache_leftpad < 0).any()) or bool((cache_leftpad > used).any()) or bool((used > slot).any()):
            raise ValueError(f"cache_leftpad must satisfy 0 <= cache_leftpad <= cache_seqlens <= {slot}, got "
                             f"{cache_leftpad.tolist()} and {used.tolist()}")
    k, v = (t[:batch].reshape(batch * slot, *t.shape[2:]) for t in (k_cache, v_cache))
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    starts = torch.arange(batch, dtype=torch.int32, device=dev) * slot + cache_leftpad
    cu_seqlens_k = torch.cat([zero, starts, zero + batch * slot])
    if cu_seqlens_q is None:  # a dense q, packed
        max_seqlen_q = q.shape[1]
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=dev) * max_seqlen_q
        q = q.reshape(batch * max_seqlen_q, *q.shape[2:])
    cu_seqlens_q = torch.cat([zero, cu_seqlens_q])
    keywords = {name: None if d is None else torch.cat([torch.ones_like(d[:1]), d])
                for name, d in (descales or {}).items()}
    keywords["seqused_k"] = torch.cat([zero, used - cache_leftpad])
    return (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, 2 * slot), keywords


def left_padded_attention(q, k_cache, v_cache, used_k, cache_leftpad, cu_seqlens_q, max_seqlen_q, descales=None,
                          **options):
    """Both drop-ins' ``flash_attn_with_kvcache`` with ``cache_leftpad``: :func:`left_padded_cache`'s packed call
    with leanfa's ``options`` (``causal``, ``return_lse`` ...), its result in ``q``'s layout (a dense ``q``:
    :func:`unpack_dense`)."""
    from . import api

    args, keywords = left_padded_cache(q, k_cache, v_cache, used_k, cache_leftpad, cu_seqlens_q, max_seqlen_q,
                                       descales)
    res = api.flash_attn_varlen_func(*args, **keywords, **options)
    return res if cu_seqlens_q is not None else unpack_dense(res, q.shape[0], q.shape[1])


def unpack_dense(res, batch: int, seqlen_q: int):
    """A packed call's ``out`` ``(B * Sq, H, Dv)`` (or ``(out, lse)`` with LSE ``(H, B * Sq)``) in the dense
    shapes ``(B, Sq, H, Dv)`` and ``(B, H, Sq)``."""
    if not isinstance(res, tuple):
        return res.view(batch, seqlen_q, *res.shape[1:])
    out, lse = res
    return (out.view(batch, seqlen_q, *out.shape[1:]),
            lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1).contiguous())


def cache_lengths(cache_seqlens, batch: int, device):
    """FA3's ``cache_seqlens`` as leanfa's ``seqused_k``: None (every key of the cache), an int for every
    sequence (an int32 ``(batch,)`` tensor on ``device``), or the int32 ``(batch,)`` tensor itself."""
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise TypeError(f"cache_seqlens must be an int, an int32 tensor or None, got {type(cache_seqlens).__name__}")
    return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
    max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
    causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False,
):
    """FA3 ``flash_attn_with_kvcache`` without its in-place append and rotary options: attention of ``q``
    (dense ``(B, Sq, H, D)``, or packed ``(total_q, H, D)`` with ``cu_seqlens_q``/``max_seqlen_q``) over the
    first ``cache_seqlens[b]`` keys of each sequence's cache (an int for all, an int32 ``(B,)`` tensor, or None:
    the whole cache). The caches are dense ``(B_cache >= B, S_cache, Hkv, D)`` (sequence ``b`` is entry ``b``),
    or with ``page_table`` (int32 ``(B, max_pages)``) paged ``(num_pages, page_size, Hkv, D)``. ``cache_leftpad``
    (int32 ``(B,)``, dense caches): sequence ``b``'s keys start at row ``cache_leftpad[b]`` (run as a packed call,
    :func:`left_padded_cache`). The causal mask and windows are bottom-right aligned on the sequence's keys (the
    queries are its last ``Sq`` positions: chunked prefill). Returns ``out``, or with ``return_softmax_lse`` FA3's ``(out, softmax_lse, out_accum,
    softmax_lse_accum)`` (LSE ``(B, H, Sq)``, packed ``(H, total_q)``; the two split accumulators are empty:
    leanfa never splits)."""
    from . import api

    reject("k/v (appending new keys to the cache in place)", k is not None or v is not None)
    reject("cu_seqlens_k_new", cu_seqlens_k_new is not None)
    reject("rotary_cos/rotary_sin (rotary embedding)", rotary_cos is not None or rotary_sin is not None)
    reject("rotary_seqlens", rotary_seqlens is not None)
    reject("cache_batch_idx", cache_batch_idx is not None)
    reject("cache_leftpad with a paged cache (page_table)", cache_leftpad is not None and page_table is not None)
    varlen = cu_seqlens_q is not None
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    batch = cu_seqlens_q.numel() - 1 if varlen and isinstance(cu_seqlens_q, torch.Tensor) else q.shape[0]
    if page_table is None and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor) \
            and k_cache.dim() == 4 and k_cache.shape[0] > batch:
        k_cache, v_cache = k_cache[:batch], v_cache[:batch]  # (no cache_batch_idx: sequence b is entry b)
    common = dict(softmax_scale=softmax_scale, causal=causal, q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale, return_lse=bool(return_softmax_lse),
                  seqused_k=cache_lengths(cache_seqlens, batch, q.device), window_size=window_size, softcap=softcap,
                  page_table=page_table, attention_chunk=attention_chunk, qv=qv)
    if cache_leftpad is not None:  # a packed-K call over the flattened cache
        descales = {n: common.pop(n) for n in ("q_descale", "k_descale", "v_descale")}
        res = left_padded_attention(q, k_cache, v_cache, common.pop("seqused_k"), cache_leftpad, cu_seqlens_q,
                                    max_seqlen_q, descales, **common)
    elif varlen:
        res = api.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, None, **common)
    else:
        res = api.flash_attn_func(q, k_cache, v_cache, **common)
    if not return_softmax_lse:
        return res
    out, lse = res
    return out, lse, out.new_empty((0,), dtype=torch.float32), out.new_empty((0,), dtype=torch.float32)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FA3 ``flash_attn_combine``: the attention of the union of ``num_splits`` key sets from each set's result.
    ``out_partial`` ``(num_splits, B, S, H, D)`` (or ``(num_splits, total, H, D)``) and ``lse_partial``
    ``(num_splits, B, S, H)`` (or ``(num_splits, total, H)``), float32; returns ``(out, lse)``: ``out`` of
    ``out_dtype`` (default ``out_partial``'s), written into ``out`` when given, and ``lse`` float32. Splits with
    LSE ``-inf`` contribute nothing; a row whose splits are all ``-inf`` is 0 with LSE ``-inf``."""
    if not isinstance(out_partial, torch.Tensor) or not isinstance(lse_partial, torch.Tensor):
        raise TypeError("out_partial and lse_partial must be torch.Tensors")
    if out_partial.dim() not in (4, 5) or lse_partial.shape != out_partial.shape[:-1]:
        raise ValueError(f"out_partial must be (num_splits, B, S, H, D) or (num_splits, total, H, D) and lse_partial "
                         f"its shape without D, got {tuple(out_partial.shape)} and {tuple(lse_partial.shape)}")
    if out_partial.dtype != torch.float32 or lse_partial.dtype != torch.float32:
        raise ValueError(f"out_partial and lse_partial must be float32, got {out_partial.dtype}, {lse_partial.dtype}")
    lse = torch.logsumexp(lse_partial, dim=0)
    weight = torch.exp(lse_partial - lse)
    weight = torch.where(torch.isfinite(lse), weight, torch.zeros_like(weight))  # (all splits -inf: no key)
    # (a split of weight 0 is not read: its output may be anything, as FA3's kernel skips it)
    merged = torch.where((weight > 0).unsqueeze(-1), weight.unsqueeze(-1) * out_partial, 0.0).sum(0)
    dtype = out_dtype or out_partial.dtype
    if out is None:
        return merged.to(dtype), lse
    if out.shape != merged.shape:
        raise ValueError(f"out must have shape {tuple(merged.shape)}, got {tuple(out.shape)}")
    out.copy_(merged)
    return out, lse


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens=None, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0):
    """FA3 ``get_scheduler_metadata``: an empty int32 tensor (on ``cache_seqlens``' device), which
    :func:`flash_attn_with_kvcache` accepts and ignores (its calls need no metadata). A packed varlen batch's
    tile schedule, made once per step for every layer, is :func:`leanfa.varlen_schedule`'s."""
    device = cache_seqlens.device if isinstance(cache_seqlens, torch.Tensor) else None
    return torch.empty((0,), dtype=torch.int32, device=device)
