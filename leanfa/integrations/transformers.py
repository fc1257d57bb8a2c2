"""Hugging Face transformers attention implementations ``"leanfa"`` (BF16), ``"leanfa_fp8"`` and ``"leanfa_fp8qk"``.

    import leanfa.integrations.transformers as lt
    lt.register()                                   # idempotent; done on import too
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="leanfa_fp8")
    # or: model.set_attn_implementation("leanfa")

Behaviour:

* Called with transformers' ``(batch, heads, seq, head_dim)`` tensors; returns
  ``(attn_output (batch, seq, heads, head_dim), None)`` in the query's dtype.
* GQA/MQA natively (K/V are never repeated); causal with flash-attn's bottom-right alignment
  (so prefill and prefill-with-cache both work); ``scaling`` is passed as ``softmax_scale``.
* ``"leanfa"`` runs the 16-bit kernel: float32 models are cast to bf16 for the attention
  only (fp16/bf16 models run in their own dtype). ``"leanfa_fp8"`` quantizes Q/K/V with
  :func:`leanfa.quantize_fp8` (per-block scales, K smoothing) and runs the FP8 kernel;
  ``"leanfa_fp8qk"`` the mixed mode (``attention(precision="fp8qk")``: FP8 Q·K, P·V in BF16).
* Masks: the mask function registered for these names is transformers' flash-attention one, so no
  dense mask is ever built: without padding the attention gets ``attention_mask=None`` and runs
  leanfa's dense kernel. **With padding** (a 2-D ``(batch, kv_len)`` mask with zeros) the call is
  unpadded, as transformers' own flash-attention path does: sequence lengths ``mask.sum(-1)`` and
  ``cu_seqlens`` (cumsum) are computed on the device, the kept tokens gathered, leanfa's varlen
  kernel run, and the output scattered back with zeros at padded query positions (:func:`unpad_mask`,
  :func:`pad_output`). Queries are the last ``q_len`` columns of the mask (prefill: all of them;
  a prompt continued on a KV cache: the new ones). The causal mask is bottom-right aligned per
  sequence, which equals SDPA's masked causal attention for any 2-D mask, left or right padding
  (the ``i``-th kept query of a sequence sees its first ``i + 1 + (kept keys - kept queries)``
  kept keys, exactly the kept keys at or before its column).
  **Host syncs:** a padded forward synchronizes once: :func:`unpad_mask` reads ``max_seqlen_q``,
  ``max_seqlen_k`` and the token counts in one device-to-host copy (a ``nonzero`` needs its output
  size; ``nonzero_static`` is then given it), and the result is cached for the mask object, so the
  other layers of the same forward (which get the same mask tensor) reuse it without a sync.
* Padded **decoding steps** (``q_len == 1`` with a longer KV cache and a padding mask) fall back to
  transformers' SDPA attention with an equivalent boolean mask and a one-time warning (leanfa is a
  prefill kernel: a 1-query tile would waste its 128-row tiles). Decoding steps without padding run
  leanfa's dense kernel. Any 4-D mask falls back to SDPA the same way.
* Variants with other :func:`leanfa.attention` levers (``smooth_k=False``, ``rotate=True``, ``bf16_sink_keys``):
  :func:`attention_function` builds the function, to register under a name of one's own (``leanfa accuracy
  --model`` does, :mod:`leanfa.bench.model_accuracy`).
* ``softcap`` (Gemma-2's logit soft-capping) and ``sliding_window`` (Mistral's, Gemma's local layers) are
  passed to :func:`leanfa.attention` as flash-attention's ``softcap`` and ``window_size`` (``sliding_window - 1``
  keys back, as transformers' flash-attention path does).
* Not supported (``NotImplementedError``): ``dropout > 0`` in training mode, ``output_attentions`` (weights are
  never materialized; returns None).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch

NAMES = {"leanfa": "bf16", "leanfa_fp8": "fp8", "leanfa_fp8qk": "fp8qk"}
_warned_fallback = False


@dataclasses.dataclass(frozen=True)
class Unpadded:
    """Where the kept tokens of a padded batch are: flat row indices into the ``(B * q_len)`` queries and
    the ``(B * kv_len)`` keys (int64, ascending), the int32 ``cu_seqlens`` and the host ``max_seqlen``s."""

    indices_q: torch.Tensor
    indices_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def unpad_mask(mask: torch.Tensor, q_len: int) -> Unpadded:
    """The varlen layout of a padded batch from its 2-D mask ``(B, kv_len)`` (nonzero = keep), whose
    last ``q_len`` columns are the queries' positions. Lengths, ``cu_seqlens`` and indices are
    computed on the mask's device with one host sync (the max lengths and token counts, read together)."""
    if mask.dim() != 2 or not 1 <= q_len <= mask.shape[1]:
        raise ValueError(f"unpad_mask takes a (batch, kv_len) mask and 1 <= q_len <= kv_len, got "
                         f"{tuple(mask.shape)} and q_len={q_len}")
    keep_k = mask.bool()
    keep_q = keep_k[:, -q_len:]
    lens_k = keep_k.sum(-1, dtype=torch.int32)
    lens_q = lens_k if q_len == mask.shape[1] else keep_q.sum(-1, dtype=torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    cu_k = torch.cat((zero, lens_k.cumsum(0, dtype=torch.int32)))
    cu_q = cu_k if lens_q is lens_k else torch.cat((zero, lens_q.cumsum(0, dtype=torch.int32)))
    # the one host sync: max lengths (the kernels' grid) and token counts (the gathers' sizes)
    max_q, max_k, total_q, total_k = torch.stack((lens_q.max(), lens_k.max(), cu_q[-1], cu_k[-1])).tolist()
    indices_k = torch.nonzero_static(keep_k.flatten(), size=total_k).flatten()
    indices_q = indices_k if cu_q is cu_k else torch.nonzero_static(keep_q.flatten(), size=total_q).flatten()
    return Unpadded(indices_q, indices_k, cu_q, cu_k, max_q, max_k)


# the last mask unpadded: every layer of a forward gets the same mask tensor, so only the first syncs
_cache: tuple | None = None


def _unpad_cached(mask: torch.Tensor, q_len: int) -> Unpadded:
    global _cache
    if torch.compiler.is_compiling() or mask.is_inference():
        # no Python-side cache inside a traced graph, nor for an inference-mode mask: it has no version counter to
        # tell an in-place edit (such a forward syncs once per layer)
        return unpad_mask(mask, q_len)
    if _cache is not None:
        ref, version, cached_q_len, unpadded = _cache
        if ref() is mask and mask._version == version and cached_q_len == q_len:
            return unpadded
    unpadded = unpad_mask(mask, q_len)
    _cache = (weakref.ref(mask), mask._version, q_len, unpadded)
    return unpadded


def _gather(x: torch.Tensor, indices: torch.Tensor, seq: int) -> torch.Tensor:
    """Rows ``indices`` (flat in ``(B * seq)``) of transformers' ``(B, H, seq, D)`` tensor, as ``(n, H, D)``:
    one gather, no copy of the padded tensor."""
    return x[indices // seq, :, indices % seq]


def pad_output(out: torch.Tensor, indices: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Packed ``(n, H, D)`` rows scattered back to ``(batch, seq, H, D)``, zeros at padded positions."""
    padded = out.new_zeros(batch * seq, *out.shape[1:])
    padded.index_copy_(0, indices, out)
    return padded.view(batch, seq, *out.shape[1:])


def _padding_fallback(module, query, key, value, attention_mask, scaling, is_causal, why, **kwargs):
    global _warned_fallback
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") or kwargs.get("sliding_window") is not None:  # (the SDPA mask below has neither)
        raise NotImplementedError(f"leanfa attention: {why} with softcap or sliding_window is not supported")

    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"leanfa attention: {why}, which leanfa's kernels do not run; falling back to SDPA for "
                      "such calls", UserWarning, stacklevel=3)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask.dim() == 2:  # (B, kv_len_total) of 1 = keep, from flash_attention_mask
        keep = attention_mask[:, -kv_len:].bool()[:, None, None, :]
        if is_causal:
            i = torch.arange(q_len, device=query.device)[:, None]
            j = torch.arange(kv_len, device=query.device)[None, :]
            keep = keep & (j <= i + (kv_len - q_len))
    else:
        keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        keep = keep[..., :kv_len]
    # rows with no visible key (padding queries) see everything: finite, and never read
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return sdpa_attention_forward(module, query, key, value, keep, scaling=scaling, is_causal=False, **kwargs)


def attention_function(precision: str = "fp8", **levers):
    """A transformers attention function (the signature ``AttentionInterface.register`` takes) that runs
    ``leanfa.attention(..., precision=precision, **levers)``: the registered names are
    ``attention_function("bf16")``, ``("fp8")`` and ``("fp8qk")``; ``levers`` are further keyword arguments of
    :func:`leanfa.attention` (``smooth_k=False``, ``rotate=True``, ``bf16_sink_keys=128``, ``granularity``...),
    for registering a variant under a name of one's own. Names ``attention`` sets itself are refused
    (``ValueError``)."""
    own = {"causal", "precision", "softmax_scale", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    taken = sorted(own & set(levers))
    if taken:
        raise ValueError(f"attention_function sets {taken} itself; pass levers of leanfa.attention only")
    return _attention(precision, levers)


def _attention(precision: str, levers: dict | None = None):
    levers = dict(levers or {})

    def leanfa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                 **kwargs):
        import leanfa

        if dropout and module.training:
            raise NotImplementedError("leanfa attention does not support dropout > 0 (training)")
        # Gemma-2's logit soft-capping and Mistral/Gemma's sliding windows, as transformers' flash-attention path
        # passes them: window_size (sliding_window - 1, sliding_window - 1) (causal calls use its left side)
        options = dict(levers)
        if kwargs.get("softcap"):
            options["softcap"] = float(kwargs["softcap"])
        if kwargs.get("sliding_window") is not None:
            options["window_size"] = (int(kwargs["sliding_window"]) - 1,) * 2
        is_causal = kwargs.pop("is_causal", None)
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        scale = None if scaling is None else float(scaling)
        out_dtype = query.dtype
        to_half = (lambda t: t.to(torch.bfloat16)) if query.dtype == torch.float32 else (lambda t: t)
        if attention_mask is not None:
            batch, q_len = query.shape[0], query.shape[2]
            if attention_mask.dim() != 2:
                return _padding_fallback(module, query, key, value, attention_mask, scaling, is_causal,
                                         "the attention mask is 4-D", **kwargs)
            # a static cache holds more key slots than the mask covers: the mask's columns are the first ones
            kv_len = attention_mask.shape[1]
            key, value = key[:, :, :kv_len], value[:, :, :kv_len]
            if q_len == 1 and kv_len > 1:
                return _padding_fallback(module, query, key, value, attention_mask, scaling, is_causal,
                                         "a padded decoding step (q_len 1 on a KV cache)", **kwargs)
            u = _unpad_cached(attention_mask, q_len)
            q = to_half(_gather(query, u.indices_q, q_len))
            k, v = (to_half(_gather(t, u.indices_k, kv_len)) for t in (key, value))
            out = leanfa.attention(q, k, v, causal=is_causal, precision=precision, softmax_scale=scale,
                                   cu_seqlens_q=u.cu_seqlens_q, cu_seqlens_k=u.cu_seqlens_k,
                                   max_seqlen_q=u.max_seqlen_q, max_seqlen_k=u.max_seqlen_k, **options)
            return pad_output(out.to(out_dtype), u.indices_q, batch, q_len), None
        # (B, H, S, D) -> (B, S, H, D) views: leanfa takes any strides
        q, k, v = (to_half(t.transpose(1, 2)) for t in (query, key, value))
        out = leanfa.attention(q, k, v, causal=is_causal, precision=precision, softmax_scale=scale, **options)
        return out.to(out_dtype), None

    suffix = "".join(f"_{k}_{v}" for k, v in levers.items())
    leanfa_attention_forward.__name__ = f"leanfa_{precision}{suffix}_attention_forward"
    return leanfa_attention_forward


#: the attention functions, by registered name
ATTENTION_FUNCTIONS = {name: attention_function(precision) for name, precision in NAMES.items()}


def register() -> None:
    """Register ``"leanfa"``, ``"leanfa_fp8"`` and ``"leanfa_fp8qk"`` with ``transformers.AttentionInterface`` and
    ``AttentionMaskInterface`` (flash-attention style masks: None unless there is padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, flash_attention_mask)


register()
