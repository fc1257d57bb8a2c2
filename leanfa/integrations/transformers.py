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
* Masks: the mask function registered for these names is transformers' flash-attention one,
  so no dense mask is built: without padding the attention gets ``attention_mask=None`` and runs
  leanfa. **With padding** (a 2-D mask with zeros, or any 4-D mask) leanfa has no kernel for
  it: the call falls back to transformers' SDPA attention with an equivalent boolean mask and a
  one-time warning (correct results, SDPA speed). Unpad your batch (varlen) to stay on leanfa.
* Not supported (``NotImplementedError``): ``dropout > 0`` in training mode, ``softcap``,
  ``sliding_window``, ``output_attentions`` (weights are never materialized; returns None).
"""

from __future__ import annotations

import warnings

import torch

NAMES = {"leanfa": "bf16", "leanfa_fp8": "fp8", "leanfa_fp8qk": "fp8qk"}
_warned_fallback = False


def _padding_fallback(module, query, key, value, attention_mask, scaling, is_causal, **kwargs):
    global _warned_fallback
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn("leanfa attention: the attention mask has padding, which leanfa's kernels do not "
                      "support; falling back to SDPA for masked calls (unpad the batch to use leanfa)",
                      UserWarning, stacklevel=3)
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


def _attention(precision: str):
    def leanfa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                 **kwargs):
        import leanfa

        if dropout and module.training:
            raise NotImplementedError("leanfa attention does not support dropout > 0 (training)")
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("leanfa attention does not support softcap")
        if kwargs.get("sliding_window") is not None:
            raise NotImplementedError("leanfa attention does not support sliding_window")
        is_causal = kwargs.pop("is_causal", None)
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        if attention_mask is not None:
            return _padding_fallback(module, query, key, value, attention_mask, scaling, is_causal, **kwargs)
        out_dtype = query.dtype
        # (B, H, S, D) -> (B, S, H, D) views: leanfa takes any strides
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if q.dtype == torch.float32:
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        out = leanfa.attention(q, k, v, causal=is_causal, precision=precision,
                               softmax_scale=None if scaling is None else float(scaling))
        return out.to(out_dtype), None

    leanfa_attention_forward.__name__ = f"leanfa_{precision}_attention_forward"
    return leanfa_attention_forward


#: the attention functions, by registered name
ATTENTION_FUNCTIONS = {name: _attention(precision) for name, precision in NAMES.items()}


def register() -> None:
    """Register ``"leanfa"``, ``"leanfa_fp8"`` and ``"leanfa_fp8qk"`` with ``transformers.AttentionInterface`` and
    ``AttentionMaskInterface`` (flash-attention style masks: None unless there is padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, flash_attention_mask)


register()
