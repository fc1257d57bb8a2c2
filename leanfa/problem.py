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
#: the key tiles (keys per block) of the portable kernel's configurations (``kernels.portable``: autotuned,
#: fixed small tile, interpreter tile); a paged cache's page size must fit each (:func:`page_size_supported`)
KEY_TILES = (32, 64, 128)


def page_size_supported(page_size: int) -> bool:
    """Whether a paged K/V cache may have ``page_size`` keys per page: for every key tile of :data:`KEY_TILES` the
    page size divides the tile (the tile spans whole pages) or is a multiple of it (the tile lies inside one page):
    1, 2, 4, 8, 16, 32, 64, and multiples of 128."""
    return page_size >= 1 and all(t % page_size == 0 or page_size % t == 0 for t in KEY_TILES)


@dataclass(frozen=True)
class Problem:
    """A validated attention call, in the layout the kernels take."""

    q: torch.Tensor  # (B, Sq, Hq, Dqk) or (total_q, Hq, Dqk)
    #: (B, Sk, Hkv, D), (total_k, Hkv, D) with ``cu_seqlens_k``, or with ``page_table`` the paged caches
    #: (num_pages, page_size, Hkv, D)
    k: torch.Tensor
    v: torch.Tensor
    batch: int
    heads: int
    kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int
    #: packed queries (``varlen``); ``cu_seqlens_k`` None with ``cu_seqlens_q`` set: K/V are indexed per
    #: sequence (``kv_per_sequence``: a dense ``(B, Sk, Hkv, D)`` cache, or pages)
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
    #: paged K/V: int32 ``(B, max_pages_per_seq)``; key position ``n`` of sequence ``b`` is row
    #: ``n % page_size`` of page ``page_table[b, n // page_size]`` of ``k``/``v``
    #: ``(num_pages, page_size, Hkv, D)``. Its capacity ``max_pages_per_seq * page_size`` is the dense key slot
    #: (``max_seqlen_k``) unless ``cu_seqlens_k`` gives the key lengths. (None: K/V are not paged)
    page_table: torch.Tensor | None = None
    #: packed FP8 calls whose V is :func:`leanfa.quantize_fp8`'s aligned layout: int32 ``(batch + 1)``, sequence
    #: ``b``'s keys from token ``cu_seqlens_v[b]`` of ``v`` (a multiple of :data:`V_TOKEN_ALIGN`); None: V's
    #: tokens are K's (``cu_seqlens_k``)
    cu_seqlens_v: torch.Tensor | None = None
    #: FA3's ``attention_chunk`` (Llama-4's chunked local attention): query ``i`` at key position
    #: ``pos = i + Sk - Sq`` sees only keys in ``[pos - pos mod c, pos - pos mod c + c)`` (floor modulo), on top of
    #: ``causal`` and the window; 0: off (a chunk that holds every key of a dense call is stored as 0)
    attention_chunk: int = 0
    #: FA3's ``qv`` (DeepSeek MLA's absorbed form): ``(B, Sq, Hq, Dv)`` (packed ``(total_q, Hq, Dv)``), q's dtype;
    #: the scores become ``softmax_scale * (q.k + qv.v)``, an FP8 ``qv`` dequantized by q's descale table
    qv: torch.Tensor | None = None
    #: packed calls: the Hopper kernel's tile table made once for the batch by :func:`leanfa.varlen_schedule`
    #: (reused by every layer's call; None: the call makes its own)
    scheduler_metadata: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    @property
    def page_size(self) -> int:
        """Keys per page of a paged call (0 when not paged)."""
        return self.k.shape[1] if self.page_table is not None else 0

    @property
    def kv_per_sequence(self) -> bool:
        """Packed queries with K/V indexed per sequence (a dense cache or pages), not packed by ``cu_seqlens_k``."""
        return self.cu_seqlens_q is not None and self.cu_seqlens_k is None

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
