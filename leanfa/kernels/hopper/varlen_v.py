"""Packed FP8 V re-packed for TMA: every sequence on a multiple of ``V_TOKEN_ALIGN`` tokens.

:func:`leanfa.quantize_fp8` stores V transposed (tokens innermost), so key block ``j`` of packed sequence
``b`` starts at byte ``cu_seqlens_k[b] + 128 j`` of a row, which TMA refuses unless it is a multiple of 16
(H200 run 15: "illegal instruction"). :func:`align_varlen_v` copies V into rows where every sequence starts
on a multiple of 16 tokens, with zeros in the gaps and after the last sequence (the keys past a sequence's
end that its last box reads must be finite: their P is 0, and 0 x NaN is not 0).

One Triton launch, no host sync on the lengths: program ``(t, b, h)`` copies token blocks ``t, t + grid0,
...`` of sequence ``b``, head ``h``, and finds its sequence's new start by summing the rounded-up lengths of
the sequences before it; programs ``b = batch`` zero the tail. It replaced ~17 PyTorch ops (a
``searchsorted`` per token and a byte-wise ``index_copy_``): with them, H200 run 54 measured 0.61-0.72 ms of
host time per FP8 ``flash_attn_varlen_func`` call against 0.12-0.20 ms for the same tokens as a dense call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import V_TOKEN_ALIGN
from ..launcher import DirectLaunch

BLOCK_T = 64  # tokens per copied tile (a [BLOCK_D, BLOCK_T] byte tile: 8 KB at head dim 128)
BLOCK_B = 256  # sequences per step of the new-start sum


@triton.jit
def _aligned_start(CU, b, ALIGN: tl.constexpr, BLOCK_B: tl.constexpr):
    """Where sequence ``b`` starts in the re-packed rows: the lengths of sequences ``0 .. b-1``, each rounded
    up to ``ALIGN``."""
    acc = tl.zeros([BLOCK_B], tl.int32)
    for i0 in range(0, b, BLOCK_B):
        i = i0 + tl.arange(0, BLOCK_B)
        m = i < b
        n = (tl.load(CU + i + 1, mask=m, other=0) - tl.load(CU + i, mask=m, other=0)).to(tl.int32)
        acc += (n + ALIGN - 1) // ALIGN * ALIGN
    return tl.sum(acc, axis=0)


@triton.jit
def align_varlen_v_kernel(V, OUT, CU, CU_V, batch, room, stride_vt, stride_vh, stride_vd,
                          DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_B: tl.constexpr, ALIGN: tl.constexpr):
    """``V`` (total, H, DV) bytes, any strides; ``OUT`` (H, DV, room) contiguous bytes; ``CU`` the packed
    starts (batch + 1); ``CU_V`` receives the re-packed ones (batch + 1)."""
    t_first = tl.program_id(0)
    t_step = tl.num_programs(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    dest = _aligned_start(CU, b, ALIGN, BLOCK_B)
    if (t_first == 0) & (h == 0):
        tl.store(CU_V + b, dest)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DV
    out_rows = OUT + h.to(tl.int64) * DV * room + offs_d[:, None].to(tl.int64) * room
    if b < batch:
        start = tl.load(CU + b).to(tl.int64)
        n = (tl.load(CU + b + 1) - start).to(tl.int32)
        n_padded = (n + ALIGN - 1) // ALIGN * ALIGN
        src_rows = V + h.to(tl.int64) * stride_vh + offs_d[:, None].to(tl.int64) * stride_vd
        for t0 in range(t_first * BLOCK_T, n_padded, t_step * BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            x = tl.load(src_rows + (start + offs_t)[None, :] * stride_vt,
                        mask=d_ok[:, None] & (offs_t < n)[None, :], other=0)  # the gap: zeros
            tl.store(out_rows + (dest + offs_t)[None, :], x, mask=d_ok[:, None] & (offs_t < n_padded)[None, :])
    else:  # the rows after the last sequence
        for t0 in range(dest + t_first * BLOCK_T, room, t_step * BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            tl.store(out_rows + offs_t[None, :], tl.zeros([BLOCK_D, BLOCK_T], tl.uint8),
                     mask=d_ok[:, None] & (offs_t < room)[None, :])


_ALIGN_VARLEN_V = DirectLaunch(align_varlen_v_kernel)


def align_varlen_v(v: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of a packed FP8 V ``(total, H, Dv)`` (any layout; :func:`leanfa.quantize_fp8` writes tokens
    innermost) stored transposed, every sequence starting on a multiple of ``V_TOKEN_ALIGN`` tokens, zeros
    in between and after; and those starts ``cu_seqlens_v`` (int32, ``batch + 1``). ``max_seqlen_k`` only
    sizes the grid (every token is copied whatever it says)."""
    total, H, Dv = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    # room for the worst case (every sequence padded by 15), a multiple of 16 tokens: TMA strides
    room = max(-(-(total + (V_TOKEN_ALIGN - 1) * batch) // V_TOKEN_ALIGN) * V_TOKEN_ALIGN, V_TOKEN_ALIGN)
    out = torch.empty((H, Dv, room), dtype=torch.uint8, device=v.device)
    cu_v = torch.empty(batch + 1, dtype=torch.int32, device=v.device)
    longest = total if max_seqlen_k is None else min(int(max_seqlen_k), total)
    grid = (max(1, triton.cdiv(longest, BLOCK_T)), batch + 1, H)
    src = v.view(torch.uint8)
    _ALIGN_VARLEN_V[grid](src, out, cu_seqlens_k, cu_v, batch, room, *src.stride(),
                          DV=Dv, BLOCK_D=triton.next_power_of_2(Dv), BLOCK_T=BLOCK_T, BLOCK_B=BLOCK_B,
                          ALIGN=V_TOKEN_ALIGN, num_warps=4)
    return out.view(v.dtype).permute(2, 0, 1), cu_v
