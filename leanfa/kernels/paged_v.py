"""A paged FP8 V cache gathered into the transposed (K-major) layout the Hopper kernel's FP8 P.V reads.

The Hopper kernel reads a paged K cache ``(num_pages, page_size, Hkv, D)`` page by page through the page table, but
its FP8 wgmma takes V K-major (tokens innermost), and a paged V cache is token-major. :func:`gather_paged_v` makes,
per call, a dense copy ``(B, Hkv, Dv, room)`` of each sequence's V pages with tokens innermost (``room`` = the
table's capacity, ``max_pages * page_size``; rows ``room_alloc`` = ``room`` rounded up to :data:`KEY_BLOCK` apart),
which the kernel reads with one TMA box per key block (``[b, hkv, 0, block * 128]``), as it reads a dense FP8 V
that :func:`leanfa.quantize_fp8` stored transposed.

One Triton launch, no host sync on the lengths: program ``(t, rb, b)`` copies token columns
``[t * BLOCK_T, (t + 1) * BLOCK_T)`` of ``ROWS`` rows (head channels; row ``r`` is head ``r // Dv``, channel
``r % Dv``) of sequence ``b``: each token's page from the table, the ``ROWS`` bytes of the token's row (contiguous
when the cache's head dim is) loaded and stored along the tokens (Triton transposes the tile through shared memory).

What is written, for a sequence of ``n`` keys (``cu_seqlens_k``'s lengths; without them every sequence has
``room``): tokens ``[0, n)`` are its V; tokens ``[n, ceil(n / KEY_BLOCK) * KEY_BLOCK)`` are zero (the kernel's last
key block of the sequence reads them: finite, their P is 0); tokens after that are left unwritten. The Hopper
kernel's FP8 key blocks are :data:`KEY_BLOCK` keys and it reads no block past a sequence's last key, so it never
reads an unwritten column. No table entry past a sequence's ``ceil(n / page_size)`` pages is read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import DirectLaunch

#: the Hopper kernel's FP8 key block: each sequence's copy is written (zeros past its keys) up to a multiple of it
KEY_BLOCK = 128
#: a program's tile: ROWS rows (head channels) x BLOCK_T tokens (BLOCK_T divides KEY_BLOCK). GPU: 128 x 128 (16 KB;
#: a token's 128 bytes of one d128 head read as 8 x 16-byte loads, 16-byte stores along the tokens), predicted at
#: 2.0-2.5 TB/s (read + write) on the H200 like the varlen V re-pack's 4 x 512 (varlen_v.GPU_TILE, measured
#: 2.0-2.1 TB/s); not yet timed (docs/perf-notes.md, "Session 20: FP8 paged K/V on the Hopper kernel").
#: The CPU interpreter runs fewer, larger programs faster.
GPU_TILE = (128, 128)
CPU_TILE = (256, 128)


@triton.jit
def gather_paged_v_kernel(V, OUT, TABLE, CU, room, room_alloc, stride_vp, stride_vr, stride_vh, stride_vd,
                          stride_tb, stride_tn,
                          DV: tl.constexpr, ROWS_TOTAL: tl.constexpr, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK_T: tl.constexpr, KEY_BLOCK: tl.constexpr, HAS_CU: tl.constexpr):
    """``V`` the cache's bytes ``(num_pages, PAGE_SIZE, H, DV)``, any strides; ``OUT`` ``(B, H * DV, room_alloc)``
    contiguous bytes; ``TABLE`` int32 ``(B, max_pages)``; ``CU`` (``HAS_CU``) the key lengths' ``cu_seqlens_k``,
    else every sequence has ``room`` keys. ``ROWS`` divides ``ROWS_TOTAL``, ``BLOCK_T`` divides ``KEY_BLOCK``."""
    t_blk = tl.program_id(0)
    rblk = tl.program_id(1)
    b = tl.program_id(2)
    if HAS_CU:
        n = tl.load(CU + b + 1) - tl.load(CU + b)
    else:
        n = room
    t0 = t_blk * BLOCK_T
    if t0 < (n + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK:  # (a whole tile inside the written columns)
        r = rblk * ROWS + tl.arange(0, ROWS)
        t = t0 + tl.arange(0, BLOCK_T)
        keys = t < n
        page = tl.load(TABLE + b.to(tl.int64) * stride_tb + (t // PAGE_SIZE) * stride_tn, mask=keys, other=0)
        token = page.to(tl.int64) * stride_vp + (t % PAGE_SIZE).to(tl.int64) * stride_vr
        channel = (r // DV).to(tl.int64) * stride_vh + (r % DV).to(tl.int64) * stride_vd
        x = tl.load(V + channel[:, None] + token[None, :], mask=keys[None, :], other=0)  # past the keys: zeros
        dest = OUT + (b.to(tl.int64) * ROWS_TOTAL + r)[:, None] * room_alloc + t[None, :]
        tl.store(dest, x)


_GATHER_PAGED_V = DirectLaunch(gather_paged_v_kernel)


def _rows(rows_total: int, rows: int) -> int:
    """The largest power of two up to ``rows`` that divides ``rows_total``."""
    while rows > 1 and rows_total % rows:
        rows //= 2
    return rows


def gather_paged_v(v_cache: torch.Tensor, page_table: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None,
                   tile: tuple[int, int] | None = None) -> torch.Tensor:
    """Each sequence's V pages of an FP8 cache ``(num_pages, page_size, Hkv, Dv)`` (head dim contiguous, or any
    strides) through ``page_table`` int32 ``(B, max_pages)``, as a transposed copy: storage ``(B, Hkv, Dv,
    room_alloc)`` viewed as ``(B, room, Hkv, Dv)`` (``room = max_pages * page_size``; tokens innermost, rows
    ``room_alloc`` = ``room`` rounded up to :data:`KEY_BLOCK` bytes apart: 16-byte aligned for TMA).
    ``cu_seqlens_k``: the sequences' key lengths (varlen), else each has ``room`` keys; what is written past a
    sequence's keys: the module's docstring. ``tile``: (rows, tokens) per program (timing)."""
    num_pages, page_size, hkv, dv = v_cache.shape
    batch, max_pages = page_table.shape
    room = max_pages * page_size
    room_alloc = max(-(-room // KEY_BLOCK) * KEY_BLOCK, KEY_BLOCK)
    out = torch.empty((batch, hkv, dv, room_alloc), dtype=torch.uint8, device=v_cache.device)
    rows, block_t = tile or (CPU_TILE if v_cache.device.type == "cpu" else GPU_TILE)
    if KEY_BLOCK % block_t:
        raise ValueError(f"gather_paged_v: the tile's {block_t} tokens must divide {KEY_BLOCK}")
    rows = _rows(hkv * dv, rows)
    if batch:
        grid = (room_alloc // block_t, hkv * dv // rows, batch)
        src = v_cache.view(torch.uint8)
        cu = cu_seqlens_k if cu_seqlens_k is not None else page_table
        _GATHER_PAGED_V[grid](src, out, page_table, cu, room, room_alloc, *src.stride(), *page_table.stride(),
                              DV=dv, ROWS_TOTAL=hkv * dv, PAGE_SIZE=page_size, ROWS=rows, BLOCK_T=block_t,
                              KEY_BLOCK=KEY_BLOCK, HAS_CU=cu_seqlens_k is not None, num_warps=4)
    return out.view(v_cache.dtype)[..., :room].permute(0, 3, 1, 2)
