"""FlashAttention-3 style entry points (``hopper/flash_attn_interface.py`` names).

Swap ``from flash_attn_interface import flash_attn_func`` for
``from leanfa.flash_attn_interface import flash_attn_func``. Supported subset (forward only):

* ``q, k, v`` ``(B, S, H, D)`` (or packed ``(total, H, D)`` for varlen), bf16/fp16/fp8 e4m3,
  GQA/MQA, head dims 64/64, 128/128, 192/128, 256/256; also (leanfa's mixed mode) fp8 e4m3 ``q``/``k``
  with a bf16/fp16 ``v``: FP8 Q·K with the Q/K descales, P·V in 16 bits, no ``v_descale``;
* ``softmax_scale``, ``causal`` (bottom-right aligned), ``q_descale``/``k_descale``/
  ``v_descale`` (FA3's ``(B, Hkv)`` float32 per-head descales, and leanfa's other forms);
* ``seqused_q``/``seqused_k`` (int32 ``(B,)``) on :func:`flash_attn_varlen_func`: only the first
  ``seqused_q[b]`` queries and ``seqused_k[b]`` keys of sequence ``b`` are used; output rows past
  ``seqused_q[b]`` are 0 with LSE ``-inf`` (FA3 leaves them unwritten). With ``cu_seqlens_q`` and
  ``cu_seqlens_k`` both None, ``q, k, v`` are dense ``(B, S, H, D)`` tensors, as in FA3. These calls
  run on the portable kernel (the Hopper kernel does not read ``seqused`` yet: one warning);
* ``window_size=(left, right)`` (sliding-window local attention: query ``i`` sees keys
  ``[i + Sk - Sq - left, i + Sk - Sq + right]``, -1 unbounded; ``causal`` makes ``right`` 0) and
  ``softcap > 0`` (scores ``softcap * tanh(s / softcap)``), dense and varlen, 16-bit and FP8. Rows
  whose window holds no key are 0 with LSE ``-inf``. Negative sides other than -1, or a negative
  ``softcap``, raise ``ValueError``. These calls run on the portable kernel (one warning where the
  Hopper kernel would have run);
* empty batches: sequences that are all empty, ``max_seqlen_q = max_seqlen_k = 0``;
* ``return_attn_probs=True`` returns ``(out, softmax_lse)`` as FA3 does;
* ``deterministic``, ``num_splits``, ``pack_gqa``, ``sm_margin`` are accepted and ignored
  (leanfa's forward is deterministic and needs no splits).

Anything else raises ``NotImplementedError`` naming the option: ``qv``, ``attention_chunk != 0``,
a packed ``q`` with dense ``k``/``v`` (one of ``cu_seqlens_q``/``cu_seqlens_k`` None), and
``flash_attn_with_kvcache`` as a whole. Gradients are not implemented.
"""

from __future__ import annotations

from .compat._common import reject

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _check_fa3(qv, attention_chunk):
    reject("qv", qv is not None)
    reject("attention_chunk", attention_chunk != 0, attention_chunk)


def flash_attn_func(
    q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False,
):
    """FA3 ``flash_attn_func``: ``out``, or ``(out, softmax_lse)`` with ``return_attn_probs``."""
    from . import api

    _check_fa3(qv, attention_chunk)
    return api.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
                               k_descale=k_descale, v_descale=v_descale, return_lse=bool(return_attn_probs),
                               window_size=window_size, softcap=softcap)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
    softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
    deterministic=False, sm_margin=0, return_attn_probs=False,
):
    """FA3 ``flash_attn_varlen_func``: ``out``, or ``(out, softmax_lse)`` (``(H, total_q)``; with
    ``cu_seqlens_q = cu_seqlens_k = None`` dense ``(B, S, H, D)`` tensors and LSE ``(B, H, Sq)``)."""
    from . import api

    _check_fa3(qv, attention_chunk)
    reject("cu_seqlens_q/cu_seqlens_k", (cu_seqlens_q is None) != (cu_seqlens_k is None),
           "with one of them None (a packed q with dense k/v, or the reverse)")
    common = dict(softmax_scale=softmax_scale, causal=causal, q_descale=q_descale, k_descale=k_descale,
                  v_descale=v_descale, return_lse=bool(return_attn_probs), seqused_q=seqused_q,
                  seqused_k=seqused_k, window_size=window_size, softcap=softcap)
    if cu_seqlens_q is None:  # FA3: no cu_seqlens means dense (B, S, H, D) tensors
        return api.flash_attn_func(q, k, v, **common)
    return api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **common)


def flash_attn_with_kvcache(*args, **kwargs):
    """Not implemented: leanfa is a prefill kernel (no KV-cache/paged decode)."""
    raise NotImplementedError(
        "flash_attn_with_kvcache is not implemented by leanfa (prefill attention only); "
        "use flash_attn_varlen_func on the packed prefill tokens")
