"""Error metrics against the float64 reference, and the reference on a subset of heads.

* relative L2: ``‖out − ref‖₂ / ‖ref‖₂`` over all elements (the project's headline metric);
* max abs: ``max |out − ref|``;
* worst-row relative: the largest ``‖out_r − ref_r‖₂ / ‖ref_r‖₂`` over output rows ``r``
  (one query token of one head), with ``‖ref_r‖`` floored at 1e-3 of the mean row norm so a
  near-zero row cannot dominate.

The speed benchmark checks each implementation before timing it on a *subset* of heads
(:func:`head_subset`: first and last query head with their KV heads, batch 0 only), which
keeps the float64 reference cheap at 32K tokens.
"""

from __future__ import annotations

import torch

#: relative L2 an implementation must stay under for its speed to be reported. FP8's bound
#: is loose on purpose: it rejects broken outputs, not imprecise ones (cuDNN FP8 with
#: per-tensor scales reaches ~0.15 on K-outlier activations, docs/design.md §5).
CHECK_TOL = {"bf16": 2e-2, "fp8": 2.5e-1}


def error_metrics(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """rel_l2, max_abs and worst_row_rel of ``out`` against ``ref`` (same shape; last axis
    is the head dim, so a row is ``out[..., :]``)."""
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    diff = o - r
    if not torch.isfinite(o).all():
        nonfinite = int((~torch.isfinite(o)).sum())
        return {"rel_l2": float("inf"), "max_abs": float("inf"), "worst_row_rel": float("inf"),
                "nonfinite": nonfinite}
    ref_norm = float(r.norm())
    rel = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    row_ref = r.reshape(-1, r.shape[-1]).norm(dim=-1)
    row_err = diff.reshape(-1, r.shape[-1]).norm(dim=-1)
    floor = max(float(row_ref.mean()) * 1e-3, 1e-30)
    worst = float((row_err / row_ref.clamp_min(floor)).max()) if row_ref.numel() else 0.0
    return {"rel_l2": rel, "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
            "worst_row_rel": worst}


def head_subset(heads: int, kv_heads: int) -> tuple[list[int], list[int]]:
    """Query heads ``[0, heads-1]`` and the KV head each one reads (flash-attn grouping:
    query head ``h`` reads KV head ``h // (heads // kv_heads)``)."""
    group = heads // kv_heads
    q_idx = [0] if heads == 1 else [0, heads - 1]
    return q_idx, [h // group for h in q_idx]


def _subset(inputs):
    """(q, k, v, reference kwargs, q_heads, batch0): the head subset the checks run on."""
    heads, kv_heads = inputs.q.shape[-2], inputs.k.shape[-2]
    q_idx, kv_idx = head_subset(heads, kv_heads)
    if inputs.varlen:
        # queries and keys each cut by their own lengths (they differ in a chunked-prefill batch)
        kw = dict(cu_seqlens_q=inputs.cu_seqlens, cu_seqlens_k=inputs.cu_seqlens_k)
        return inputs.q[:, q_idx], inputs.k[:, kv_idx], inputs.v[:, kv_idx], kw, q_idx, False
    return inputs.q[:1, :, q_idx], inputs.k[:1, :, kv_idx], inputs.v[:1, :, kv_idx], {}, q_idx, True


def reference_subset(inputs, causal: bool, window_size=(-1, -1)) -> tuple[torch.Tensor, list[int], bool]:
    """Float64 reference output on the head subset (batch 0 unless varlen).

    Returns ``(ref, q_heads, batch0)``: compare it with ``out[:1, :, q_heads]`` (or
    ``out[:, q_heads]`` for packed varlen output).
    """
    from leanfa.reference import attention_ref

    q, k, v, kw, q_idx, batch0 = _subset(inputs)
    return attention_ref(q, k, v, causal=causal, window_size=window_size, **kw), q_idx, batch0


#: an FP8 row passes its check below max(CHECK_TOL["fp8"], FP8_FLOOR_FACTOR x the FP8 floor)
FP8_FLOOR_FACTOR = 2.0


def fp8_rounding_floor(inputs, causal: bool, ref: torch.Tensor, window_size=(-1, -1)) -> float:
    """Relative L2 error of *exact* attention on Q, K, V rounded to e4m3 with one scale per
    tensor, on the checked head subset: the error any FP8 attention starts from before smarter
    scaling (cuDNN FP8 sits near it). On activations with strong K outliers (Qwen2.5) it
    exceeds the fixed FP8 bound, so the check scales with it instead of rejecting every FP8
    row on that input; a broken kernel (error ~1 or NaN) still fails."""
    from leanfa.reference import attention_ref

    def e4m3(x):
        x = x.double()
        s = x.abs().amax().clamp(min=1e-30) / 448.0
        return (x / s).to(torch.float8_e4m3fn).double() * s

    q, k, v, kw, _, _ = _subset(inputs)
    out = attention_ref(e4m3(q), e4m3(k), e4m3(v), causal=causal, window_size=window_size, **kw)
    return error_metrics(out, ref)["rel_l2"]


def subset_of(out: torch.Tensor, q_heads: list[int], batch0: bool) -> torch.Tensor:
    return out[:1, :, q_heads] if batch0 else out[:, q_heads]
