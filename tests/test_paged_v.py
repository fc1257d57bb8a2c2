"""The gather of a paged FP8 V cache into the Hopper kernel's transposed layout (:mod:`leanfa.kernels.paged_v`),
against a torch reference that walks the page table.

The caches hold their pages in a random order; unused pages hold NaN bytes (0xFF, e4m3's NaN) and table entries
past a sequence's pages point far outside the cache, so reading either shows. ``torch.empty`` is poisoned with 0xFF
bytes: every column the gather must write (a sequence's keys, then zeros up to its last 128-key block) is checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from leanfa.kernels.paged_v import KEY_BLOCK, gather_paged_v

from helpers import cu_seqlens, poison_empty

FP8 = torch.float8_e4m3fn
I32 = torch.int32
FAR = 1 << 30  # a table entry past a sequence's pages: no such page


def _cache(lengths, page_size, hkv, dv, gen, width=None, device="cpu"):
    """An FP8 V cache ``(num_pages, page_size, hkv, dv)`` of the sequences' random values in shuffled pages, two unused
    NaN pages, and the int32 table (``width`` columns; entries past a sequence's pages: :data:`FAR`)."""
    need = [math.ceil(n / page_size) for n in lengths]
    width = width or max(need)
    num_pages = sum(need) + 2
    order = torch.randperm(num_pages, generator=gen)
    cache = torch.full((num_pages, page_size, hkv, dv), 255, dtype=torch.uint8)
    table = torch.full((len(lengths), width), FAR, dtype=I32)
    i = 0
    for b, n in enumerate(lengths):
        for j in range(need[b]):
            page = int(order[i])
            table[b, j] = page
            cache[page] = (torch.randn((page_size, hkv, dv), generator=gen) * 3).to(FP8).view(torch.uint8)
            i += 1
    return cache.view(FP8).to(device), table.to(device)


def _reference(cache, table, lengths):
    """Per sequence ``b``: its first ``lengths[b]`` keys gathered through the table, ``(Hkv, Dv, n)`` bytes."""
    page_size = cache.shape[1]
    out = []
    for b, n in enumerate(lengths):
        pages = table[b, : math.ceil(n / page_size)].long().cpu()
        keys = cache.cpu().view(torch.uint8)[pages].reshape(-1, *cache.shape[2:])[:n]
        out.append(keys.permute(1, 2, 0))
    return out


def _check(got, cache, table, lengths):
    room = table.shape[1] * cache.shape[1]
    assert got.dtype == FP8 and tuple(got.shape) == (table.shape[0], room, *cache.shape[2:])
    assert got.stride(1) == 1 and (got.stride(3) * 1) % 16 == 0, "tokens innermost, rows 16-byte aligned (TMA)"
    rows = got.permute(0, 2, 3, 1).view(torch.uint8)  # (B, Hkv, Dv, room)
    for b, (want, n) in enumerate(zip(_reference(cache, table, lengths), lengths)):
        assert torch.equal(rows[b, :, :, :n].cpu(), want), f"sequence {b}: keys"
        written = min(-(-n // KEY_BLOCK) * KEY_BLOCK, room)
        assert (rows[b, :, :, n:written] == 0).all(), f"sequence {b}: zeros up to its last key block"


@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
def test_varlen_lengths(device, page_size, monkeypatch):
    """Key lengths from ``cu_seqlens_k`` (not multiples of the page, one of a single key, one empty), GQA heads,
    shuffled pages, a table wider than any sequence needs."""
    poison_empty(monkeypatch)
    gen = torch.Generator().manual_seed(page_size)
    lengths = [300, 1, 129, 0, 2 * page_size + 5]
    cache, table = _cache(lengths, page_size, 2, 64, gen, width=math.ceil(300 / page_size) + 2, device=device)
    got = gather_paged_v(cache, table, cu_seqlens(lengths, device))
    _check(got, cache, table, lengths)


@pytest.mark.parametrize("page_size", [16, 128])
def test_whole_table(device, page_size, monkeypatch):
    """Without key lengths (dense q over the whole table) every sequence has the table's capacity."""
    poison_empty(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    width = 3
    lengths = [width * page_size] * 2
    cache, table = _cache(lengths, page_size, 1, 128, gen, device=device)
    _check(gather_paged_v(cache, table), cache, table, lengths)


@pytest.mark.parametrize("tile", [(1, 16), (4, 32), (256, 128), (128, 128)])
def test_tiles(device, tile, monkeypatch):
    """Any tile gives the same copy (rows cut to a power of two dividing Hkv * Dv)."""
    poison_empty(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    lengths = [77, 200]
    cache, table = _cache(lengths, 16, 3, 64, gen, device=device)
    _check(gather_paged_v(cache, table, cu_seqlens(lengths, device), tile=tile), cache, table, lengths)


def test_strided_cache(device, monkeypatch):
    """A cache view with other strides (every other head of a wider cache, as a fused K/V cache's half is)."""
    poison_empty(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    lengths = [90, 64]
    cache, table = _cache(lengths, 32, 4, 64, gen, device=device)
    view = cache[:, :, ::2]
    assert not view.is_contiguous()
    _check(gather_paged_v(view, table, cu_seqlens(lengths, device)), view.contiguous(), table, lengths)


def test_strided_table(device, monkeypatch):
    """A page table with a column stride (every other entry of a wider table)."""
    poison_empty(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    lengths = [100, 40]
    cache, table = _cache(lengths, 16, 1, 64, gen, device=device)
    wide = torch.full((2, 2 * table.shape[1]), FAR, dtype=I32, device=device)
    wide[:, ::2] = table
    _check(gather_paged_v(cache, wide[:, ::2], cu_seqlens(lengths, device)), cache, table, lengths)


def test_bad_tile():
    cache, table = _cache([16], 16, 1, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="must divide"):
        gather_paged_v(cache, table, tile=(64, 256))
