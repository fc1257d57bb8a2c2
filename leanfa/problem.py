"""The validated attention call every layer passes down, and the layout constants they share.

:class:`Problem` is what :mod:`leanfa.api` builds from a call's arguments and what
:mod:`leanfa.ops`, :mod:`leanfa.kernels.dispatch` and the kernels' host code read. This module
depends on no other leanfa module, so any layer may import it (docs/design.md §3.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: V is stored transposed with its token axis padded to this many elements (16-byte rows)
V_TOKEN_ALIGN = 16


@dataclass(frozen=True)
class Problem:
    """A validated attention call, in the layout the kernels take."""

    q: torch.Tensor  # (B, Sq, Hq, Dqk) or (total_q, Hq, Dqk)
    k: torch.Tensor
    v: torch.Tensor
    batch: int
    heads: int
    kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    causal: bool
    softmax_scale: float
    q_scale: torch.Tensor  # float32 (B, Hq, nblk)
    k_scale: torch.Tensor  # float32 (B, Hkv, nblk)
    v_scale: torch.Tensor  # float32 (B, Hkv, Dv)
    k_mean: torch.Tensor | None  # float32 (B, Hkv, Dqk): K was smoothed by this mean
    out_dtype: torch.dtype
    return_lse: bool
    #: FP8 calls only: keys [0, sink_keys) are attended in 16 bits from these tensors (the
    #: unquantized q, k, v; same layout as q, k, v), the rest from the FP8 ones
    sink_keys: int = 0
    sink_q: torch.Tensor | None = None
    sink_k: torch.Tensor | None = None
    sink_v: torch.Tensor | None = None
    #: FA3's ``seqused_q``/``seqused_k``: int32 ``(batch,)``; sequence ``b`` has only its first
    #: ``seqused_q[b]`` queries and ``seqused_k[b]`` keys (None: the whole sequence)
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    #: flash-attn's ``window_size=(left, right)`` (sliding-window attention), normalized by the API:
    #: query ``i`` of a sequence of ``Sq`` queries and ``Sk`` keys sits at key position
    #: ``i + Sk - Sq`` (bottom-right) and sees keys ``pos - window_left <= j <= pos + window_right``;
    #: -1 is unbounded on that side. With ``causal`` the right side is the causal mask's
    #: (``window_right`` is -1); a window that covers every key is stored as (-1, -1).
    window_left: int = -1
    window_right: int = -1
    #: flash-attn's ``softcap``: scores ``s = softmax_scale * q.k`` become ``softcap * tanh(s / softcap)``
    #: before the softmax (0: off)
    softcap: float = 0.0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def has_seqused(self) -> bool:
        return self.seqused_q is not None or self.seqused_k is not None

    @property
    def has_window(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def is_fp8(self) -> bool:
        """Q and K are FP8 (e4m3, with their descales): the QK side of the call."""
        return self.q.dtype == FP8_DTYPE

    @property
    def pv_fp8(self) -> bool:
        """V is FP8 too (P is rounded to e4m3 for the PV product); False for 16-bit calls and for the mixed
        mode (:attr:`is_mixed`)."""
        return self.v.dtype == FP8_DTYPE

    @property
    def is_mixed(self) -> bool:
        """The mixed-precision mode (``attention(precision="fp8qk")``): FP8 Q and K, a 16-bit V, and P in
        V's dtype for the PV product."""
        return self.is_fp8 and not self.pv_fp8
