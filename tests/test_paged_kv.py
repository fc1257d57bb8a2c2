"""Paged K/V (issue 25 item 1) on the portable kernel: FA3's ``page_table`` / flash-attn 2's and vLLM's
``block_table`` over caches ``(num_pages, page_size, Hkv, D)``.

Every paged call is checked against the float64 reference (which gathers the pages to contiguous K/V) and, bit
for bit, against the same call on contiguous K/V (the portable kernel visits the same key blocks in the same
order: only the addresses differ). The caches are built with their pages in a random order; every row no call
should read (unused pages, the tail of a sequence's last page, table entries past a sequence's keys, which
point at a garbage page) holds a large finite value, so a wrong gather gives a wrong (not NaN) answer. Outputs
are poisoned with NaN before each launch (conftest). Shapes are small for the CPU interpreter (32x32 tiles
there: page sizes 1, 4 and 16 gather several pages per key tile, 32 one, 64-256 read a tile inside one page).
"""

import dataclasses
import math
import warnings

import pytest
import torch

import leanfa
from leanfa import flash_attn_interface as fa3
from leanfa.compat import flash_attn as fa2
from leanfa.problem import KEY_TILES, Problem, page_size_supported
from leanfa.reference import attention_ref

from helpers import TOL, cu_seqlens, hopper_accepts_everything, rel_l2

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
I32 = torch.int32
#: what unread cache rows hold: large and finite in the cache's dtype
GARBAGE = {BF16: 1.0e4, FP8: 448.0}


def _seqs(lengths, hkv, d, gen):
    """Per-sequence K and V ``(L_b, Hkv, D)``, float32."""
    return ([torch.randn((n, hkv, d), generator=gen) for n in lengths],
            [torch.randn((n, hkv, d), generator=gen) for n in lengths])


def _paged(ks, vs, page_size, dtype, device, gen, spare=3):
    """The sequences ``ks``/``vs`` in paged caches ``(num_pages, page_size, Hkv, D)`` with the pages in a random
    order, ``spare`` pages of garbage, and an int32 table ``(B, max_pages)`` whose entries past a sequence's
    pages point at a garbage page."""
    need = [math.ceil(k.shape[0] / page_size) for k in ks]
    width = max(need) + 1
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages, generator=gen)
    hkv, dk, dv = ks[0].shape[1], ks[0].shape[2], vs[0].shape[2]
    kc = torch.full((num_pages, page_size, hkv, dk), GARBAGE[dtype])
    vc = torch.full((num_pages, page_size, hkv, dv), GARBAGE[dtype])
    table = torch.full((len(ks), width), int(order[-1]), dtype=I32)  # the last page stays garbage
    i = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        for j in range(need[b]):
            page, rows = int(order[i]), slice(j * page_size, (j + 1) * page_size)
            table[b, j] = page
            kc[page, : k[rows].shape[0]] = k[rows]
            vc[page, : v[rows].shape[0]] = v[rows]
            i += 1
    return kc.to(dtype).to(device), vc.to(dtype).to(device), table.to(device)


def _dense(xs, dtype, device):
    """The sequences as a dense ``(B, max L, H, D)`` tensor (garbage past each length)."""
    width = max(x.shape[0] for x in xs)
    out = torch.full((len(xs), width, *xs[0].shape[1:]), GARBAGE[dtype])
    for b, x in enumerate(xs):
        out[b, : x.shape[0]] = x
    return out.to(dtype).to(device)

def _paged_matches(q, kc, vc, table, ks, vs, used, dtype, device, **kw):
    """The portable kernel's dense-q call over paged K/V (key counts ``used``) agrees with the float64 reference and,
    bit for bit, with its call on the same keys stored contiguously (sm90's Hopper kernel, where ``backend="auto"``
    sends these calls: tests/test_hopper_paged.py and tests/test_hopper_seqused.py)."""
    out, lse = leanfa.flash_attn_func(q, kc, vc, return_lse=True, page_table=table, seqused_k=used,
                                      backend="portable", **kw)
    ref, ref_lse = attention_ref(q, kc, vc, return_lse=True, page_table=table, seqlens_k=used, **kw)
    _check(out, lse, ref, ref_lse, dtype)
    want, want_lse = leanfa.flash_attn_func(q, _dense(ks, dtype, device), _dense(vs, dtype, device), return_lse=True,
                                            seqused_k=used, backend="portable", **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)



def _packed(xs, dtype, device):
    return torch.cat(xs).to(dtype).to(device)


def _fp8_descales(batch, hkv, device, gen):
    return {n: (torch.rand((batch, hkv), generator=gen) + 0.5).to(device) for n in ("q_descale", "k_descale",
                                                                                   "v_descale")}


def _check(out, lse, ref, ref_lse, dtype):
    assert rel_l2(out, ref) < TOL[dtype]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse.double() - ref_lse)[finite].abs().max().item() < (0.3 if dtype == FP8 else 1e-3)


# ----------------------------------------------------------------------------- dense q (FA3 kvcache's form)

@pytest.mark.parametrize("page_size", [1, 4, 16, 32, 64, 128, 256])
def test_chunked_prefill_dense_q(device, page_size):
    """Dense q, the last ``Sq`` positions of each sequence (chunked prefill, causal bottom-right), GQA, key lengths
    from ``seqused_k`` (FA3's cache_seqlens): equal to the contiguous call and to the reference."""
    gen = torch.Generator().manual_seed(page_size)
    lens, sq, hq, hkv, d = [150, 97], 40, 4, 2, 64
    ks, vs = _seqs(lens, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, page_size, BF16, device, gen)
    q = torch.randn((2, sq, hq, d), generator=gen).to(BF16).to(device)
    used = torch.tensor(lens, dtype=I32, device=device)
    out, lse = leanfa.flash_attn_func(q, kc, vc, causal=True, return_lse=True, page_table=table, seqused_k=used,
                                      backend="portable")  # (sm90's Hopper kernel: its own tests)
    ref, ref_lse = attention_ref(q, kc, vc, causal=True, return_lse=True, page_table=table, seqlens_k=used)
    _check(out, lse, ref, ref_lse, BF16)
    want, want_lse = leanfa.flash_attn_func(q, _dense(ks, BF16, device), _dense(vs, BF16, device), causal=True,
                                            return_lse=True, seqused_k=used, backend="portable")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_whole_table_without_lengths(device):
    """Without key lengths every sequence has its table row's capacity (max_pages * page_size keys)."""
    gen = torch.Generator().manual_seed(1)
    ks, vs = _seqs([64, 64], 1, 64, gen)
    kc, vc, table = _paged(ks, vs, 32, BF16, device, gen)
    table = table[:, :2].contiguous()  # exactly the sequences' pages
    q = torch.randn((2, 20, 2, 64), generator=gen).to(BF16).to(device)
    out = leanfa.flash_attn_func(q, kc, vc, causal=True, page_table=table, backend="portable")  # (sm90: Hopper's
    want = leanfa.flash_attn_func(q, _dense(ks, BF16, device), _dense(vs, BF16, device), causal=True,  # own test)
                                  backend="portable")
    assert torch.equal(out, want)


def test_fp8_caches_with_descales(device):
    """FP8 (e4m3) q and caches with FA3's per-head (B, Hkv) descales."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    gen = torch.Generator().manual_seed(2)
    lens, sq, hq, hkv, d = [100, 61], 33, 4, 2, 64
    ks, vs = _seqs(lens, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, 16, FP8, device, gen)
    q = torch.randn((2, sq, hq, d), generator=gen).to(FP8).to(device)
    desc = _fp8_descales(2, hkv, device, gen)
    used = torch.tensor(lens, dtype=I32, device=device)
    _paged_matches(q, kc, vc, table, ks, vs, used, FP8, device, causal=True, **desc)


@pytest.mark.parametrize("window,causal,softcap", [((24, -1), True, 0.0), ((20, 9), False, 5.0)])
def test_window_and_softcap_compose_with_paging(device, window, causal, softcap):
    gen = torch.Generator().manual_seed(3)
    lens, sq, hq, hkv, d = [130, 75], 50, 2, 1, 64
    ks, vs = _seqs(lens, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, 16, BF16, device, gen)
    q = torch.randn((2, sq, hq, d), generator=gen).to(BF16).to(device)
    used = torch.tensor(lens, dtype=I32, device=device)
    _paged_matches(q, kc, vc, table, ks, vs, used, BF16, device, causal=causal, window_size=window, softcap=softcap)


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_model_like_inputs(device, dtype):
    """Model-like activations (qwen2.5-7b preset: K bias, outlier channels, an attention sink) in a chunked
    prefill over 64-key pages; FP8 caches quantized per (sequence, KV head) with FA3-style descales."""
    from leanfa.activations import make_qkv

    if dtype == FP8 and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    q, k, v = make_qkv("qwen2.5-7b", 2, 48, heads=4, kv_heads=1, seqlen_k=160, seed=3)
    lens = [160, 121]
    desc = {}
    if dtype == FP8:  # per (sequence, head) scales: q_descale (B, Hq), k/v_descale (B, Hkv)
        def quant(x):
            d = x.float().abs().amax(dim=(1, 3)).clamp(min=1e-6) / 448.0
            return (x.float() / d[:, None, :, None]).to(FP8), d

        (q, qd), (k, kd), (v, vd) = quant(q), quant(k), quant(v)
        desc = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    ks = [k[b, :n].float() for b, n in enumerate(lens)]
    vs = [v[b, :n].float() for b, n in enumerate(lens)]
    gen = torch.Generator().manual_seed(13)
    kc, vc, table = _paged(ks, vs, 64, dtype, device, gen)
    q = q.to(device)
    desc = {n: t.to(device) for n, t in desc.items()}
    used = torch.tensor(lens, dtype=I32, device=device)
    _paged_matches(q, kc, vc, table, ks, vs, used, dtype, device, causal=True, **desc)


# ----------------------------------------------------------------------------- packed q (varlen)

@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("lengths_from", ["cu_seqlens_k", "seqused_k"])
def test_varlen_q_paged(device, lengths_from, page_size):
    """Packed q with ``cu_seqlens_q``: key lengths from ``cu_seqlens_k`` (flash-attn 2's block_table form) or,
    with ``cu_seqlens_k=None``, from ``seqused_k`` (vLLM's FA3 call). Sequences: a chunk of a longer one, a whole
    prompt (Sq = Sk), one with no query, one shorter than a page."""
    gen = torch.Generator().manual_seed(4)
    lens_q, lens_k, hq, hkv, d = [17, 45, 0, 5], [90, 45, 30, 9], 4, 1, 64
    ks, vs = _seqs(lens_k, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, page_size, BF16, device, gen)
    q = torch.randn((sum(lens_q), hq, d), generator=gen).to(BF16).to(device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    if lengths_from == "cu_seqlens_k":
        keys = dict(cu_seqlens_k=cu_k, max_seqlen_k=max(lens_k))
    else:
        keys = dict(cu_seqlens_k=None, max_seqlen_k=None, seqused_k=torch.tensor(lens_k, dtype=I32, device=device))
    out, lse = leanfa.flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q), causal=True,
                                             return_lse=True, page_table=table, backend="portable", **keys)
    ref, ref_lse = attention_ref(q, kc, vc, causal=True, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 page_table=table)
    _check(out, lse, ref, ref_lse, BF16)
    want, want_lse = leanfa.flash_attn_varlen_func(q, _packed(ks, BF16, device), _packed(vs, BF16, device), cu_q,
                                                   cu_k, max(lens_q), max(lens_k), causal=True, return_lse=True,
                                                   backend="portable")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_varlen_q_dense_cache(device):
    """Packed q over a dense ``(B, S_cache, Hkv, D)`` cache (FA3 kvcache with cu_seqlens_q and no page_table)."""
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k, hq, hkv, d = [12, 0, 40], [50, 7, 40], 2, 2, 64
    ks, vs = _seqs(lens_k, hkv, d, gen)
    q = torch.randn((sum(lens_q), hq, d), generator=gen).to(BF16).to(device)
    cu_q = cu_seqlens(lens_q, device)
    used = torch.tensor(lens_k, dtype=I32, device=device)
    kd, vd = _dense(ks, BF16, device), _dense(vs, BF16, device)
    out, lse = leanfa.flash_attn_varlen_func(q, kd, vd, cu_q, None, max(lens_q), None, causal=True, return_lse=True,
                                             seqused_k=used)
    ref, ref_lse = attention_ref(q, kd, vd, causal=True, return_lse=True, cu_seqlens_q=cu_q, seqlens_k=used)
    _check(out, lse, ref, ref_lse, BF16)
    got3, lse3, *rest = fa3.flash_attn_with_kvcache(q, kd, vd, cache_seqlens=used, cu_seqlens_q=cu_q,
                                                    max_seqlen_q=max(lens_q), causal=True, return_softmax_lse=True)
    assert torch.equal(got3, out) and torch.equal(lse3, lse) and [r.numel() for r in rest] == [0, 0]


# ----------------------------------------------------------------------------- the drop-ins

def test_drop_ins_equal_native(device):
    """FA3 ``flash_attn_with_kvcache`` (page_table, int and tensor cache_seqlens, dense and packed q), FA3/vLLM
    ``flash_attn_varlen_func(block_table=)``, flash-attn 2's ``flash_attn_varlen_func(block_table=)`` and
    ``flash_attn_with_kvcache(block_table=)``: the native call's bits. (8-key pages: every form runs on the portable
    kernel, also on sm90, so that all give the same bits.)"""
    gen = torch.Generator().manual_seed(6)
    lens, sq, hq, hkv, d = [70, 70], 30, 4, 2, 64
    ks, vs = _seqs(lens, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, 8, BF16, device, gen)
    q = torch.randn((2, sq, hq, d), generator=gen).to(BF16).to(device)
    used = torch.tensor(lens, dtype=I32, device=device)
    want, want_lse = leanfa.flash_attn_func(q, kc, vc, causal=True, return_lse=True, page_table=table, seqused_k=used)
    got = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=70, page_table=table, causal=True)
    assert torch.equal(got, want)
    got, lse, out_accum, lse_accum = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used, page_table=table,
                                                                 causal=True, return_softmax_lse=True, num_splits=0)
    assert torch.equal(got, want) and torch.equal(lse, want_lse) and out_accum.numel() == lse_accum.numel() == 0
    got, lse = fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used, block_table=table, causal=True,
                                           return_softmax_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    # packed q: the same queries, one sequence after the other
    qp, cu_q, cu_k = q.reshape(-1, hq, d), cu_seqlens([sq, sq], device), cu_seqlens(lens, device)
    want_p = leanfa.flash_attn_varlen_func(qp, kc, vc, cu_q, cu_k, sq, 70, causal=True, page_table=table)
    assert torch.equal(want_p, want.reshape(-1, hq, d))
    assert torch.equal(fa3.flash_attn_with_kvcache(qp, kc, vc, cache_seqlens=used, page_table=table, cu_seqlens_q=cu_q,
                                                   max_seqlen_q=sq, causal=True), want_p)
    assert torch.equal(fa3.flash_attn_varlen_func(qp, kc, vc, cu_q, None, sq, 70, seqused_k=used, causal=True,
                                                  block_table=table), want_p)
    assert torch.equal(fa3.flash_attn_varlen_func(q, kc, vc, None, None, None, None, seqused_k=used, causal=True,
                                                  block_table=table), want)
    # vLLM's keyword call leaves cu_seqlens_k out
    assert torch.equal(fa3.flash_attn_varlen_func(q=qp, k=kc, v=vc, cu_seqlens_q=cu_q, max_seqlen_q=sq, seqused_k=used,
                                                  max_seqlen_k=70, causal=True, block_table=table), want_p)
    assert torch.equal(fa2.flash_attn_varlen_func(qp, kc, vc, cu_q, cu_k, sq, 70, causal=True, block_table=table),
                       want_p)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_fa2_kvcache_table_capacity(device, as_tensor):
    """flash-attn 2's paged ``flash_attn_with_kvcache`` refuses ``cache_seqlens`` past the keys a ``block_table``
    row holds (a ``RuntimeError``, as flash-attn 2's test expects, and a ``ValueError``); at the capacity it runs."""
    gen = torch.Generator().manual_seed(8)
    kc = torch.randn((4, 16, 1, 64), generator=gen).to(BF16).to(device)
    q = torch.randn((1, 1, 1, 64), generator=gen).to(BF16).to(device)
    table = torch.zeros((1, 1), dtype=I32, device=device)
    lengths = (lambda n: torch.tensor([n], dtype=I32, device=device)) if as_tensor else (lambda n: n)
    for error in (RuntimeError, ValueError):
        with pytest.raises(error, match="block_table"):
            fa2.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lengths(17), block_table=table)
    got = fa2.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lengths(16), block_table=table)
    assert torch.equal(got, leanfa.flash_attn_func(q, kc[:1], kc[:1]))


@pytest.mark.parametrize("variant", ["causal", "full", "window"])
def test_kvcache_leftpad(device, variant):
    """``cache_leftpad`` over a dense cache (both drop-ins; FA3's dense and packed q): sequence ``b``'s keys are rows
    ``[leftpad[b], cache_seqlens[b])`` of its entry, causal and windows bottom-right on that count; against the
    float64 reference of each sequence's keys alone, the LSE included. Rows outside hold a large finite value."""
    gen = torch.Generator().manual_seed(9)
    sq, slot, hq, hkv, d = 24, 96, 4, 2, 64
    pads, ends = [5, 0, 40], [70, 96, 52]  # sequence 2 has fewer keys (12) than queries (24)
    kc = torch.full((4, slot, hkv, d), 30.0)  # one spare cache entry
    vc = torch.full((4, slot, hkv, d), -30.0)
    for b, (lo, hi) in enumerate(zip(pads, ends)):
        kc[b, lo:hi] = torch.randn((hi - lo, hkv, d), generator=gen)
        vc[b, lo:hi] = torch.randn((hi - lo, hkv, d), generator=gen)
    kc, vc = kc.to(BF16).to(device), vc.to(BF16).to(device)
    q = torch.randn((3, sq, hq, d), generator=gen).to(BF16).to(device)
    kw = dict(causal=variant != "full", window_size=(16, 0) if variant == "window" else (-1, -1))
    lp, used = (torch.tensor(x, dtype=I32, device=device) for x in (pads, ends))
    got, lse, *_ = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used, cache_leftpad=lp,
                                               return_softmax_lse=True, **kw)
    assert got.shape == q.shape and lse.shape == (3, hq, sq) and lse.is_contiguous()
    for b, (lo, hi) in enumerate(zip(pads, ends)):
        want, want_lse = attention_ref(q[b:b + 1], kc[b:b + 1, lo:hi], vc[b:b + 1, lo:hi], return_lse=True, **kw)
        assert rel_l2(got[b:b + 1], want) < TOL[BF16], b
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse[b:b + 1]), fin)
        assert float((lse[b:b + 1].double() - want_lse)[fin].abs().max()) < 1e-3
    packed = fa3.flash_attn_with_kvcache(q.flatten(0, 1), kc, vc, cache_seqlens=used, cache_leftpad=lp,
                                         cu_seqlens_q=cu_seqlens([sq] * 3, device), max_seqlen_q=sq, **kw)
    assert torch.equal(packed, got.flatten(0, 1))
    assert torch.equal(fa2.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used, cache_leftpad=lp, **kw), got)


def test_kvcache_leftpad_refusals(device):
    """``cache_leftpad`` with a paged cache is refused by name; a wrong dtype, shape or value range is a clear
    error (values: on CPU tensors)."""
    kc = torch.randn((2, 16, 1, 64)).to(BF16).to(device)
    q = torch.randn((2, 4, 1, 64)).to(BF16).to(device)
    table = torch.zeros((2, 1), dtype=I32, device=device)
    lp = torch.zeros(2, dtype=I32, device=device)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        fa3.flash_attn_with_kvcache(q, kc, kc, cache_leftpad=lp, page_table=table)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        fa2.flash_attn_with_kvcache(q, kc, kc, cache_leftpad=lp, block_table=table)
    with pytest.raises(TypeError, match="int32"):
        fa3.flash_attn_with_kvcache(q, kc, kc, cache_leftpad=lp.long())
    with pytest.raises(ValueError, match="shape"):
        fa3.flash_attn_with_kvcache(q, kc, kc, cache_leftpad=lp[:1])
    if device == "cpu":
        with pytest.raises(ValueError, match="cache_leftpad must satisfy"):
            fa3.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=8, cache_leftpad=lp + 9)


def test_kvcache_dense_cache(device):
    """``flash_attn_with_kvcache`` without a page table: a dense cache with more entries than the batch, used
    lengths from ``cache_seqlens`` (both drop-ins)."""
    gen = torch.Generator().manual_seed(7)
    kd = torch.randn((3, 80, 1, 64), generator=gen).to(BF16).to(device)
    vd = torch.randn((3, 80, 1, 64), generator=gen).to(BF16).to(device)
    q = torch.randn((2, 16, 2, 64), generator=gen).to(BF16).to(device)
    used = torch.tensor([80, 33], dtype=I32, device=device)
    want = leanfa.flash_attn_func(q, kd[:2], vd[:2], causal=True, seqused_k=used)
    assert torch.equal(fa3.flash_attn_with_kvcache(q, kd, vd, cache_seqlens=used, causal=True), want)
    assert torch.equal(fa2.flash_attn_with_kvcache(q, kd, vd, cache_seqlens=used, causal=True), want)
    ref = attention_ref(q, kd[:2], vd[:2], causal=True, seqlens_k=used)
    assert rel_l2(want, ref) < TOL[BF16]


# ----------------------------------------------------------------------------- bad input, dispatch

Q = torch.zeros(1, 8, 2, 64, dtype=BF16)
KC = torch.zeros(4, 16, 1, 64, dtype=BF16)
TABLE = torch.tensor([[2, 0]], dtype=I32)

BAD = [  # (id, call, exception, message)
    ("table dtype", lambda: leanfa.flash_attn_func(Q, KC, KC, page_table=TABLE.long()), TypeError, "int32"),
    ("table rank", lambda: leanfa.flash_attn_func(Q, KC, KC, page_table=TABLE[0]), ValueError, "max_pages_per_seq"),
    ("table batch", lambda: leanfa.flash_attn_func(Q, KC, KC, page_table=TABLE.repeat(2, 1)), ValueError,
     "max_pages_per_seq"),
    ("page size 48", lambda: leanfa.flash_attn_func(Q, torch.zeros(4, 48, 1, 64, dtype=BF16),
                                                    torch.zeros(4, 48, 1, 64, dtype=BF16), page_table=TABLE),
     ValueError, "page size 48"),
    ("page size 96", lambda: leanfa.flash_attn_func(Q, torch.zeros(2, 96, 1, 64, dtype=BF16),
                                                    torch.zeros(2, 96, 1, 64, dtype=BF16), page_table=TABLE),
     ValueError, "page size 96"),
    ("page size 3", lambda: leanfa.flash_attn_func(Q, KC[:, :3], KC[:, :3], page_table=TABLE), ValueError,
     "page size 3"),
    ("k not paged", lambda: leanfa.flash_attn_varlen_func(Q[0], KC[0], KC[0], torch.tensor([0, 8], dtype=I32),
                                                          torch.tensor([0, 8], dtype=I32), 8, 8, page_table=TABLE),
     ValueError, "paged cache"),
    ("page id out of range", lambda: leanfa.flash_attn_func(Q, KC, KC, page_table=torch.tensor([[4, 0]], dtype=I32)),
     ValueError, "num_pages"),
    ("keys past the table", lambda: leanfa.flash_attn_varlen_func(Q[0], KC, KC, torch.tensor([0, 8], dtype=I32),
                                                                  torch.tensor([0, 40], dtype=I32), 8, 40,
                                                                  page_table=TABLE), ValueError, "page_table row"),
    ("fa3 append", lambda: fa3.flash_attn_with_kvcache(Q, KC, KC, k=Q[:, :, :1], v=Q[:, :, :1], page_table=TABLE),
     NotImplementedError, "appending"),
    ("fa3 rotary", lambda: fa3.flash_attn_with_kvcache(Q, KC, KC, rotary_cos=torch.ones(8, 32),
                                                       rotary_sin=torch.ones(8, 32), page_table=TABLE),
     NotImplementedError, "rotary"),
    ("fa3 cache_batch_idx", lambda: fa3.flash_attn_with_kvcache(Q, KC, KC, cache_batch_idx=TABLE[0]),
     NotImplementedError, "cache_batch_idx"),
    ("fa3 cache_leftpad paged", lambda: fa3.flash_attn_with_kvcache(Q, KC, KC, cache_leftpad=TABLE[0, :1],
                                                                     page_table=TABLE),
     NotImplementedError, "cache_leftpad"),
    ("fa3 qv dtype", lambda: fa3.flash_attn_with_kvcache(Q, KC, KC, qv=Q.half(), page_table=TABLE), ValueError,
     "qv"),
    ("fa3 k_new", lambda: fa3.flash_attn_with_kvcache(Q, KC, KC, cu_seqlens_k_new=TABLE[0]), NotImplementedError,
     "cu_seqlens_k_new"),
    ("fa2 append", lambda: fa2.flash_attn_with_kvcache(Q, KC, KC, k=Q[:, :, :1], v=Q[:, :, :1], block_table=TABLE),
     NotImplementedError, "appending"),
    ("fa2 rotary", lambda: fa2.flash_attn_with_kvcache(Q, KC, KC, rotary_cos=torch.ones(8, 32),
                                                       rotary_sin=torch.ones(8, 32), block_table=TABLE),
     NotImplementedError, "rotary"),
    ("fa2 alibi", lambda: fa2.flash_attn_with_kvcache(Q, KC, KC, alibi_slopes=torch.ones(2), block_table=TABLE),
     NotImplementedError, "alibi_slopes"),
    ("fa2 block_table dtype", lambda: fa2.flash_attn_varlen_func(Q[0], KC, KC, torch.tensor([0, 8], dtype=I32),
                                                                 torch.tensor([0, 8], dtype=I32), 8, 8,
                                                                 block_table=TABLE.long()), TypeError, "int32"),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bad inputs are CPU tensors (checked where CI runs: the "
                    "CPU, under the interpreter); a GPU refuses CPU tensors first")
@pytest.mark.parametrize("call,exc,msg", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_page_sizes_table():
    """The accepted page sizes: each divides every key tile of the portable kernel (:data:`KEY_TILES`, which must
    hold every tile it launches) or is a multiple of it."""
    from leanfa.kernels import portable

    tiles = {c.kwargs["BLOCK_N"] for c in portable._configs()} | {portable.INTERPRETER_TILE["BLOCK_N"],
                                                                   portable.SMALL_TILE["BLOCK_N"]}
    assert tiles <= set(KEY_TILES)
    ok = [p for p in range(1, 1100) if page_size_supported(p)]
    assert ok == [1, 2, 4, 8, 16, 32, 64, *range(128, 1100, 128)]
    for p in ok:
        assert all(t % p == 0 or p % t == 0 for t in tiles)


def test_hopper_dispatch_refuses_paged_with_one_warning(monkeypatch):
    """Where the Hopper kernel would run a call, a paged call it does not read (packed q without cu_seqlens_k; the
    others: tests/test_hopper_paged.py) runs on the portable kernel instead, with one warning per process;
    ``backend="hopper"`` raises. A paged call it reads goes there."""
    dispatch = hopper_accepts_everything(monkeypatch)
    plain = Problem(q=Q, k=Q, v=Q, batch=1, heads=2, kv_heads=2, head_dim_qk=64, head_dim_v=64,
                    max_seqlen_q=8, max_seqlen_k=8, cu_seqlens_q=None, cu_seqlens_k=None, causal=True,
                    softmax_scale=0.125, q_scale=None, k_scale=None, v_scale=None, k_mean=None,
                    out_dtype=BF16, return_lse=False)
    assert dispatch.hopper_applies(plain) == (True, "")
    paged = dataclasses.replace(plain, k=KC, v=KC, kv_heads=1, max_seqlen_k=32, page_table=TABLE)
    assert dispatch.hopper_applies(paged) == (True, "")
    per_sequence = dataclasses.replace(paged, q=Q[0], cu_seqlens_q=torch.tensor([0, 8], dtype=I32))
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_VALIDATED", False)  # (until its GPU validation)
    with pytest.warns(UserWarning, match="paged K/V .* not yet validated"):
        assert dispatch.choose(per_sequence, "auto").kernel == "portable"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second refusal is silent
        assert not dispatch.hopper_applies(per_sequence)[0]
    assert dispatch.choose(per_sequence, "hopper").kernel == "hopper"  # (development: tests/test_hopper_seqused.py)
    packed = dataclasses.replace(plain, q=Q[0], cu_seqlens_q=torch.tensor([0, 8], dtype=I32))
    with pytest.warns(UserWarning, match="per-sequence"):
        assert not dispatch.hopper_applies(packed)[0]


# ----------------------------------------------------------------------------- GPU sizes

@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_gpu_chunked_prefill(device, page_size, dtype):
    """A serving-sized chunked prefill batch on the GPU: packed q chunks over paged caches (vLLM's call), against
    the reference and the contiguous portable call (autotuned tiles: compared within the tolerance)."""
    gen = torch.Generator().manual_seed(page_size)
    lens_q, lens_k, hq, hkv, d = [512, 1000, 77, 2048], [3000, 1000, 4100, 2048], 16, 4, 128
    ks, vs = _seqs(lens_k, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, page_size, dtype, device, gen)
    q = torch.randn((sum(lens_q), hq, d), generator=gen).to(dtype).to(device)
    desc = _fp8_descales(len(lens_q), hkv, device, gen) if dtype == FP8 else {}
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    used = torch.tensor(lens_k, dtype=I32, device=device)
    out, lse = fa3.flash_attn_varlen_func(q, kc, vc, cu_q, None, max(lens_q), max(lens_k), seqused_k=used,
                                          causal=True, return_attn_probs=True, block_table=table, **desc)
    ref, ref_lse = attention_ref(q, kc, vc, causal=True, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 page_table=table, **desc)
    _check(out, lse, ref, ref_lse, dtype)
    want = leanfa.flash_attn_varlen_func(q, _packed(ks, dtype, device), _packed(vs, dtype, device), cu_q, cu_k,
                                         max(lens_q), max(lens_k), causal=True, backend="portable", **desc)
    assert rel_l2(out, want.float()) < TOL[dtype] / 4


@pytest.mark.gpu
def test_gpu_window_paged_dense_q(device):
    gen = torch.Generator().manual_seed(11)
    lens, hq, hkv, d = [4096, 2500], 8, 2, 128
    ks, vs = _seqs(lens, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, 64, BF16, device, gen)
    q = torch.randn((2, 1024, hq, d), generator=gen).to(BF16).to(device)
    used = torch.tensor(lens, dtype=I32, device=device)
    kw = dict(causal=True, window_size=(700, 0), softcap=30.0, return_lse=True)
    out, lse = fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=used, page_table=table,
                                           causal=True, window_size=(700, 0), softcap=30.0,
                                           return_softmax_lse=True)[:2]
    ref, ref_lse = attention_ref(q, kc, vc, page_table=table, seqlens_k=used, **kw)
    _check(out, lse, ref, ref_lse, BF16)


@pytest.mark.gpu
def test_gpu_dispatch_paged_seqused(device, monkeypatch):
    """On the GPU a paged call with ``seqused_k`` asks the real Hopper ``supports``: on sm90 it runs on the Hopper
    kernel without a warning (``dispatch.HOPPER_SEQUSED_VALIDATED``), elsewhere on the portable kernel; the result
    agrees with the float64 reference."""
    from leanfa import api
    from leanfa.kernels import dispatch

    monkeypatch.setattr(dispatch, "_WARNED", set())
    gen = torch.Generator().manual_seed(12)
    ks, vs = _seqs([300, 200], 2, 128, gen)
    kc, vc, table = _paged(ks, vs, 64, BF16, device, gen)
    q = torch.randn((2, 128, 8, 128), generator=gen).to(BF16).to(device)
    used = torch.tensor([300, 200], dtype=I32, device=device)
    problem = api._build_problem(q, kc, vc, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                 max_seqlen_k=None, softmax_scale=None, causal=True, q_descale=None, k_descale=None,
                                 v_descale=None, k_mean=None, return_lse=False, out_dtype=None, seqused_k=used,
                                 page_table=table)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert dispatch.choose(problem, "auto").kernel == ("hopper" if sm90 else "portable")
    if sm90:
        assert not any("seqused" in str(w.message) for w in seen)
    out = leanfa.flash_attn_func(q, kc, vc, causal=True, page_table=table, seqused_k=used)
    ref = attention_ref(q, kc, vc, causal=True, page_table=table, seqlens_k=used)
    assert rel_l2(out, ref) < TOL[BF16]


# ----------------------------------------------------------------------------- FP8 paged on the Hopper kernel (sm90)

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _fp8_hopper_varlen(page_size, causal=True, window=(-1, -1), seed=0):
    """vLLM's FP8 chunked-prefill call on the Hopper kernel (packed q chunks, Sq < Sk, ``cu_seqlens_k``, GQA 16:4,
    FA3's (B, Hkv) descales, shuffled FP8 pages): the float64 reference, and the bits of the same call over
    contiguous FP8 K/V on the Hopper kernel; ``backend="auto"`` picks the Hopper kernel."""
    from leanfa import api
    from leanfa.kernels import dispatch

    gen = torch.Generator().manual_seed(seed + page_size)
    lens_q, lens_k, hq, hkv, d = [512, 1000, 77, 2048, 1], [3000, 1000, 4100, 2048, 700], 16, 4, 128
    ks, vs = _seqs(lens_k, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, page_size, FP8, "cuda", gen)
    q = torch.randn((sum(lens_q), hq, d), generator=gen).to(FP8).cuda()
    desc = _fp8_descales(len(lens_q), hkv, "cuda", gen)
    cu_q, cu_k = cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda")
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    kw = dict(causal=causal, window_size=window, **desc)
    problem = api._build_problem(q, kc, vc, varlen=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=args[2],
                                 max_seqlen_k=args[3], softmax_scale=None, k_mean=None, return_lse=True,
                                 out_dtype=None, page_table=table, **kw)
    assert dispatch.choose(problem, "auto").kernel == "hopper"
    out, lse = leanfa.flash_attn_varlen_func(q, kc, vc, *args, return_lse=True, page_table=table, backend="hopper",
                                             **kw)
    ref, ref_lse = attention_ref(q, kc, vc, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, page_table=table,
                                 **kw)
    _check(out, lse, ref, ref_lse, FP8)
    want, want_lse = leanfa.flash_attn_varlen_func(q, _packed(ks, FP8, "cuda"), _packed(vs, FP8, "cuda"), *args,
                                                   return_lse=True, backend="hopper", **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "not the contiguous FP8 call's bits"
    got = fa3.flash_attn_varlen_func(q, kc, vc, *args, block_table=table, **kw)  # the drop-in (vLLM's fork)
    assert torch.equal(got, out)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
def test_gpu_fp8_paged_hopper_varlen(page_size):
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    _fp8_hopper_varlen(page_size)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("window,causal", [((1024, -1), True), ((700, 300), False)])
def test_gpu_fp8_paged_hopper_window(page_size, window, causal):
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    _fp8_hopper_varlen(page_size, causal, window, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
def test_gpu_fp8_paged_hopper_dense_q(page_size):
    """``flash_attn_func``'s paged form in FP8: dense q chunks (Sq < Sk, causal) over the whole table, GQA, descales,
    on the Hopper kernel: the reference, and the bits of the same call over dense token-major FP8 K/V (V transposed per
    call) on the Hopper kernel."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    gen = torch.Generator().manual_seed(page_size)
    cap, sq, hq, hkv, d = 2048, 700, 8, 2, 128
    ks, vs = _seqs([cap] * 3, hkv, d, gen)
    kc, vc, table = _paged(ks, vs, page_size, FP8, "cuda", gen)
    table = table[:, : cap // page_size].contiguous()  # exactly the sequences' pages
    q = torch.randn((3, sq, hq, d), generator=gen).to(FP8).cuda()
    desc = _fp8_descales(3, hkv, "cuda", gen)
    out, lse = leanfa.flash_attn_func(q, kc, vc, causal=True, return_lse=True, page_table=table, backend="hopper",
                                      **desc)
    ref, ref_lse = attention_ref(q, kc, vc, causal=True, return_lse=True, page_table=table, **desc)
    _check(out, lse, ref, ref_lse, FP8)
    want, want_lse = leanfa.flash_attn_func(q, _dense(ks, FP8, "cuda"), _dense(vs, FP8, "cuda"), causal=True,
                                            return_lse=True, backend="hopper", **desc)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "not the contiguous FP8 call's bits"
    again = leanfa.flash_attn_func(q, kc, vc, causal=True, page_table=table, **desc)  # backend="auto": the same
    assert torch.equal(again, out)
