"""FlashAttention-3 as a peer in ``leanfa bench`` and ``leanfa accuracy``: the module that
provides it, the FP8 scaling its API takes, and the call that is timed.

Module (:data:`MODULES`, first importable wins): ``fa3_fwd_interface``, from the ``fa3-fwd``
wheel (FA3's forward pass, stable-ABI build), else ``flash_attn_interface``, from
flash-attention's ``hopper/`` build. Both are top-level modules; :func:`module` refuses a
module whose file lies inside the leanfa package, so leanfa's own flash-attn compatible API
(``leanfa.flash_attn_interface``) is never taken for FA3, whatever ``sys.path`` holds.

FP8 (``fa3-fp8``): Q, K and V are quantized to e4m3 before the timing with one scale per
(sequence, KV head) — the granularity of FA3's ``q_descale``/``k_descale``/``v_descale``,
float32 tensors of shape ``(batch, kv_heads)``: ``scale = 448 / amax``, ``x8 = x·scale``,
``descale = 1 / scale``. Q's amax for (sequence b, KV head h) is taken over all query heads
that read h. The timed call is the kernel alone on those inputs; FA3 returns BF16 for FP8
inputs, so its output needs no dequantization.

The wheel's ``flash_attn_func``/``flash_attn_varlen_func`` return the output alone (the
output and the LSE with ``return_attn_probs=True``); :func:`output_of` takes the output from
either form, as older ``flash_attn_interface`` builds return a tuple.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import torch

#: modules that provide FA3, tried in order
MODULES = ("fa3_fwd_interface", "flash_attn_interface")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448

_LEANFA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _inside_leanfa(mod) -> bool:
    path = getattr(mod, "__file__", None)
    if not path:
        return False
    return os.path.commonpath([os.path.abspath(path), _LEANFA_DIR]) == _LEANFA_DIR


def module():
    """The first importable module of :data:`MODULES` that is not part of leanfa.

    Raises ImportError naming why each candidate was refused."""
    reasons = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # ImportError, or its CUDA extension failing to load
            reasons.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            continue
        if _inside_leanfa(mod):
            reasons.append(f"{name}: resolved to leanfa's own {mod.__file__}, not FA3")
            continue
        if not hasattr(mod, "flash_attn_func"):
            reasons.append(f"{name}: has no flash_attn_func")
            continue
        return mod
    raise ImportError("FlashAttention-3 not importable (" + "; ".join(reasons) + ")")


def available() -> tuple[bool, str]:
    try:
        mod = module()
    except ImportError as e:
        return False, str(e)[:300]
    return True, mod.__name__


def _amax_per_kv_head(t: torch.Tensor, kv_heads: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """max |t| per (sequence, KV head): ``(batch, kv_heads)`` float32. ``t`` is ``(B, S, H, D)``,
    or packed ``(total, H, D)`` cut by ``cu_seqlens``; query head ``h`` belongs to KV head
    ``h // (H // kv_heads)`` (flash-attn grouping)."""
    heads = t.shape[-2]
    if heads % kv_heads:
        raise ValueError(f"{heads} heads are not a multiple of {kv_heads} KV heads")
    x = t.detach().abs()
    if cu_seqlens is None:
        b, s, _, d = t.shape
        return x.reshape(b, s, kv_heads, heads // kv_heads, d).amax(dim=(1, 3, 4)).float()
    total = t.shape[0]
    per_token = x.reshape(total, kv_heads, -1).amax(dim=-1).float()  # (total, kv_heads)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=t.device), lengths,
                                  output_size=total)
    out = torch.zeros(lengths.numel(), kv_heads, dtype=torch.float32, device=t.device)
    return out.scatter_reduce_(0, seq[:, None].expand(-1, kv_heads), per_token, "amax")


def quantize_per_kv_head(t: torch.Tensor, kv_heads: int, cu_seqlens: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t8, descale)``: ``t`` in e4m3 scaled per (sequence, KV head), and the float32
    ``(batch, kv_heads)`` descale that FA3 multiplies back (``t ≈ t8 · descale``)."""
    amax = _amax_per_kv_head(t, kv_heads, cu_seqlens).clamp_min(1e-12)
    scale = FP8_MAX / amax  # (batch, kv_heads)
    heads = t.shape[-2]
    group = heads // kv_heads
    if cu_seqlens is None:
        per = scale[:, None, :, None, None]  # (B, 1, Hkv, 1, 1)
        shaped = t.float().reshape(*t.shape[:2], kv_heads, group, t.shape[-1])
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        per = torch.repeat_interleave(scale, lengths, dim=0, output_size=t.shape[0])[:, :, None, None]
        shaped = t.float().reshape(t.shape[0], kv_heads, group, t.shape[-1])
    t8 = (shaped * per).clamp_(-FP8_MAX, FP8_MAX).reshape(t.shape).to(FP8)
    return t8, (1.0 / scale).contiguous()


def output_of(result: Any) -> torch.Tensor:
    """The attention output of an FA3 call (``out``, or the first item of ``(out, lse, ...)``)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def unsupported(e: BaseException) -> bool:
    """FA3 refusing a shape or a build option (reported "n/a"), not a failure."""
    msg = str(e).lower()
    return any(s in msg for s in ("does not support", "not supported", "unsupported", "only support"))


def call(case, x, fp8: bool) -> tuple[Callable[[], torch.Tensor], str]:
    """``(run, note)``: ``run()`` is one FA3 forward on ``x`` (a :class:`~.inputs.Inputs` of
    ``case``) returning the ``(B, S, Hq, Dv)`` (or packed) output; with ``fp8`` the inputs are
    quantized here, before any timing."""
    fa3 = module()
    q, k, v = x.q, x.k, x.v
    kw: dict = {"causal": case.causal}
    if case.window_left >= 0:  # a causal sliding window (the window sweep)
        kw["window_size"] = case.window_size
    note = fa3.__name__
    if fp8:
        # Q's scales per sequence of queries, K's and V's per sequence of keys (longer in a
        # chunked-prefill batch)
        cu_q = x.cu_seqlens if x.varlen else None
        cu_k = x.cu_seqlens_k if x.varlen else None
        q, dq = quantize_per_kv_head(x.q, case.kv_heads, cu_q)
        k, dk = quantize_per_kv_head(x.k, case.kv_heads, cu_k)
        v, dv = quantize_per_kv_head(x.v, case.kv_heads, cu_k)
        kw.update(q_descale=dq, k_descale=dk, v_descale=dv)
        note += "; e4m3 with one scale per (sequence, KV head)"
    if x.varlen:
        cu_q, cu_k, m_q, m_k = x.cu_seqlens, x.cu_seqlens_k, x.max_seqlen, x.max_seqlen_k
        return (lambda: output_of(fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, m_q, m_k, **kw))), note
    return (lambda: output_of(fa3.flash_attn_func(q, k, v, **kw))), note
