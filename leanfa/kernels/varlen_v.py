"""Packed FP8 V in the aligned layout the Hopper kernel's TMA loads read: every sequence on a multiple of
``V_TOKEN_ALIGN`` tokens.

FP8 V is stored transposed (tokens innermost), so key block ``j`` of packed sequence ``b`` starts at byte
``start_b + 128 j`` of a row, which TMA refuses unless it is a multiple of 16 (an unaligned box makes the kernel
die with "illegal instruction" on the H200). The aligned layout: rows ``(H, Dv)`` of :func:`repacked_tokens`
tokens, sequence ``b`` from token ``cu_seqlens_v[b]`` (the lengths before it, each rounded up to 16), zeros up to
its next multiple of 16, and zeros for at least :data:`ALIGNED_V_TAIL` tokens after the last sequence (the keys
past a sequence's end that its last box reads must be finite: their P is 0, and 0 x NaN is not 0).

:func:`leanfa.quantize_fp8` writes a packed batch's V in this layout directly (:mod:`.quantize`). An FP8 V
given in any other layout (e.g. FA3-style token-major inputs) is copied into it by :func:`align_varlen_v`, one
Triton launch, no host sync on the lengths: program ``(rb, b, t)`` copies byte blocks ``t, t + grid2, ...`` of a
few rows (head channels) of sequence ``b``, and finds its sequence's new start by summing the rounded-up lengths
of the sequences before it; programs ``b = batch`` zero the tail. One launch instead of ~17 PyTorch ops (a
``searchsorted`` per token and a byte-wise ``index_copy_``) because those cost an FP8 ``flash_attn_varlen_func``
call 0.61-0.72 ms of host time on the H200 (0.12-0.20 ms for the same tokens as a dense call) and 0.21-0.42 ms of
GPU time for the re-pack of 32 MB, against 0.03 for this kernel (docs/perf-notes.md, "FP8 varlen: the V re-pack
in one kernel").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..problem import V_TOKEN_ALIGN
from .launcher import DirectLaunch

#: a program's tile: ROWS rows of V (head channels) x BLOCK_T bytes. GPU: 4 x 512 (16 bytes per thread at 4 warps)
#: copies 32 MB at 2.0-2.1 TB/s (0.031-0.034 ms) on the H200, against 1.0-1.7 TB/s for 8 x 256 and 1 x 1024,
#: 0.45-0.56 for 128 x 64 and 0.16-0.32 for the PyTorch ops (``scripts/varlen_v_time.py``; docs/perf-notes.md).
#: The CPU interpreter runs fewer, larger programs faster.
GPU_TILE = (4, 512)
CPU_TILE = (64, 256)
BLOCK_B = 256  # sequences per step of the new-start sum
#: zero tokens after the last sequence's rounded end: a 128-key box that starts inside the last sequence
#: ends at most 112 tokens past it (the kernel's TMA zero-fills past the rows' end)
ALIGNED_V_TAIL = 128


@triton.jit
def aligned_start(CU, b, ALIGN: tl.constexpr, BLOCK_B: tl.constexpr):
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
                          DV: tl.constexpr, ROWS_TOTAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_B: tl.constexpr, ALIGN: tl.constexpr):
    """``V`` (total, H, DV) bytes, any strides; ``OUT`` (H * DV, room) contiguous bytes; ``CU`` the packed
    starts (batch + 1); ``CU_V`` receives the re-packed ones (batch + 1). Program ``(rb, b, t)``: rows
    ``rb * ROWS ...`` (row ``r`` is head ``r // DV``, channel ``r % DV``) of sequence ``b``, byte columns
    ``t, t + grid2, ...`` in ``BLOCK_T`` steps."""
    rblk = tl.program_id(0)
    b = tl.program_id(1)
    t_first = tl.program_id(2)
    t_step = tl.num_programs(2)
    dest = tl.multiple_of(aligned_start(CU, b, ALIGN, BLOCK_B), ALIGN)
    if (rblk == 0) & (t_first == 0):
        tl.store(CU_V + b, dest)
    r = rblk * ROWS + tl.arange(0, ROWS)
    r_ok = (r < ROWS_TOTAL)[:, None]
    out_rows = OUT + (r.to(tl.int64) * room + dest)[:, None]
    offs = tl.arange(0, BLOCK_T)
    if b < batch:
        start = tl.load(CU + b).to(tl.int64)
        n = (tl.load(CU + b + 1) - start).to(tl.int32)
        n_padded = (n + ALIGN - 1) // ALIGN * ALIGN
        src_rows = V + ((r // DV).to(tl.int64) * stride_vh + (r % DV).to(tl.int64) * stride_vd
                        + start * stride_vt)[:, None]
        for t0 in range(t_first * BLOCK_T, n_padded, t_step * BLOCK_T):
            t = t0 + offs
            x = tl.load(src_rows + (t.to(tl.int64) * stride_vt)[None, :], mask=r_ok & (t < n)[None, :],
                        other=0)  # the gap: zeros
            tl.store(out_rows + t[None, :], x, mask=r_ok & (t < n_padded)[None, :])
    else:  # the rows after the last sequence
        for t0 in range(t_first * BLOCK_T, room - dest, t_step * BLOCK_T):
            t = t0 + offs
            tl.store(out_rows + t[None, :], tl.zeros([ROWS, BLOCK_T], tl.uint8),
                     mask=r_ok & (t < room - dest)[None, :])


_ALIGN_VARLEN_V = DirectLaunch(align_varlen_v_kernel)


def repacked_tokens(total: int, batch: int) -> int:
    """Token columns of :func:`align_varlen_v`'s rows: room for the worst case (every one of ``batch`` sequences
    padded by ``V_TOKEN_ALIGN - 1``), a multiple of ``V_TOKEN_ALIGN`` (TMA strides), at least one group."""
    return max(-(-(total + (V_TOKEN_ALIGN - 1) * batch) // V_TOKEN_ALIGN) * V_TOKEN_ALIGN, V_TOKEN_ALIGN)


def align_varlen_v(v: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int | None = None,
                   tile: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of a packed FP8 V ``(total, H, Dv)`` (any layout; :func:`leanfa.quantize_fp8` writes tokens
    innermost) stored transposed, every sequence starting on a multiple of ``V_TOKEN_ALIGN`` tokens, zeros
    in between and after; and those starts ``cu_seqlens_v`` (int32, ``batch + 1``). ``max_seqlen_k`` only
    sizes the grid (every token is copied whatever it says); ``tile``: (rows, bytes) per program (timing)."""
    total, H, Dv = v.shape
    batch = cu_seqlens_k.shape[0] - 1
    room = repacked_tokens(total, batch)
    out = torch.empty((H, Dv, room), dtype=torch.uint8, device=v.device)
    cu_v = torch.empty(batch + 1, dtype=torch.int32, device=v.device)
    longest = total if max_seqlen_k is None else min(int(max_seqlen_k), total)
    rows, block_t = tile or (CPU_TILE if v.device.type == "cpu" else GPU_TILE)
    grid = (triton.cdiv(H * Dv, rows), batch + 1, min(max(1, triton.cdiv(longest, block_t)), 65535))
    src = v.view(torch.uint8)
    _ALIGN_VARLEN_V[grid](src, out, cu_seqlens_k, cu_v, batch, room, *src.stride(),
                          DV=Dv, ROWS_TOTAL=H * Dv, ROWS=rows, BLOCK_T=block_t, BLOCK_B=BLOCK_B,
                          ALIGN=V_TOKEN_ALIGN, num_warps=4)
    return out.view(v.dtype).permute(2, 0, 1), cu_v
