"""Paged K/V in the Hopper kernel (issue 25 item 1): the producer loads each key block page by page
(:func:`leanfa.kernels.hopper.pipeline.load_kv_paged`).

On the CPU the kernel's own source runs in the emulator (:mod:`leanfa.kernels.hopper.emulate`) through the real host
plan, against the float64 reference (which gathers the pages) and, bit for bit, against the same batch with contiguous
K/V (the same key blocks in the same order). The caches hold their pages in a random order; pages no sequence uses
and table entries past a sequence's pages (pointing at such a page) hold NaN, so reading one shows; the rows of a
sequence's last page past its keys are read (their scores are masked) and hold a large finite value. Outputs are
poisoned with NaN. The ``gpu`` tests run the real kernel on sm90.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import leanfa
from leanfa.problem import Problem
from leanfa.reference import attention_ref
from helpers import TOL, cu_seqlens, hopper_accepts_everything, mutated, rel_l2

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
I32 = torch.int32
UNREAD = float("nan")  # pages no call may read
TAIL = 1.0e4  # rows of a sequence's last page past its keys: read, masked


def _caches(ks, vs, page_size, gen, dtype=BF16, spare=2):
    """The sequences' K/V ``(L_b, Hkv, D)`` in caches ``(num_pages, page_size, Hkv, D)``, pages shuffled, ``spare``
    unused pages; the int32 table ``(B, max_pages + 1)`` points past each sequence's pages at an unused one."""
    need = [math.ceil(k.shape[0] / page_size) for k in ks]
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages, generator=gen)
    hkv, dk, dv = ks[0].shape[1], ks[0].shape[2], vs[0].shape[2]
    kc = torch.full((num_pages, page_size, hkv, dk), UNREAD)
    vc = torch.full((num_pages, page_size, hkv, dv), UNREAD)
    table = torch.full((len(ks), max(need) + 1), int(order[-1]), dtype=I32)
    i = 0
    for b, (k, v) in enumerate(zip(ks, vs)):
        for j in range(need[b]):
            page, rows = int(order[i]), slice(j * page_size, (j + 1) * page_size)
            table[b, j] = page
            kc[page], vc[page] = TAIL, TAIL
            kc[page, : k[rows].shape[0]] = k[rows]
            vc[page, : v[rows].shape[0]] = v[rows]
            i += 1
    return kc.to(dtype), vc.to(dtype), table


def _problem(q, k, v, causal=True, **kw):
    from leanfa.api import _build_problem

    args = dict(varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                softmax_scale=None, causal=causal, q_descale=None, k_descale=None, v_descale=None, k_mean=None,
                return_lse=True, out_dtype=None)
    args.update(kw)
    return _build_problem(q, k, v, **args)


def _varlen(lens_q, lens_k, hq, hkv, d, page_size, causal, seed=0, device="cpu", window=(-1, -1)):
    """A packed chunked-prefill batch over paged caches, and the same batch with packed (contiguous) K/V
    (``window``: flash-attn's ``window_size``, on both)."""
    gen = torch.Generator().manual_seed(seed)
    ks = [torch.randn((n, hkv, d), generator=gen) + 0.5 for n in lens_k]
    vs = [torch.randn((n, hkv, d), generator=gen) for n in lens_k]
    kc, vc, table = (t.to(device) for t in _caches(ks, vs, page_size, gen))
    q = torch.randn((sum(lens_q), hq, d), generator=gen).to(BF16).to(device)
    cu = dict(varlen=True, cu_seqlens_q=cu_seqlens(lens_q, device), cu_seqlens_k=cu_seqlens(lens_k, device),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    paged = _problem(q, kc, vc, causal, page_table=table, window_size=window, **cu)
    contiguous = _problem(q, torch.cat(ks).to(BF16).to(device), torch.cat(vs).to(BF16).to(device), causal,
                          window_size=window, **cu)
    return paged, contiguous


def _emulate_and_check(paged, contiguous):
    from leanfa.kernels.hopper.emulate import emulate

    out, lse, _ = emulate(paged)
    p = paged
    ref, ref_lse = attention_ref(p.q, p.k, p.v, causal=p.causal, return_lse=True, cu_seqlens_q=p.cu_seqlens_q,
                                 cu_seqlens_k=p.cu_seqlens_k, page_table=p.page_table,
                                 window_size=(p.window_left, p.window_right))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN (unwritten, or a page not to read)"
    assert rel_l2(out, ref) < 1e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < 1e-3
    want, want_lse, _ = emulate(contiguous)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "not the contiguous call's bits"
    return out


# ----------------------------------------------------------------------------- emulated (CPU)

emulation = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation test (runs where there is no GPU)")

#: (query lengths, key lengths): chunks (Sq < Sk) ending mid-page, a whole prompt, an empty and a one-token chunk
LENS = ([40, 130, 0, 1, 77], [300, 130, 50, 129, 333])


@emulation
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_emulated_chunked_prefill(page_size, causal, persistent, monkeypatch):
    """Packed chunks over shuffled pages (GQA 2:1, head dim 64, odd lengths): the reference, and the contiguous
    call's bits; one tile per program and persistent."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", persistent)
    _emulate_and_check(*_varlen(*LENS, 4, 2, 64, page_size, causal, seed=page_size))


@emulation
@pytest.mark.parametrize("page_size", [64, 128])
def test_emulated_head_dims(page_size):
    """Head dim 128 (one 128-element box row) and 256 (BF16: 64-key blocks, so a 128-key page holds two)."""
    for d, lens in ((128, ([65, 200], [300, 200])), (256, ([33, 70], [150, 70]))):
        _emulate_and_check(*_varlen(*lens, 2, 1, d, page_size, True, seed=d))


def _dense_q_over_whole_table(seed, keys, queries, page_size=64, dtype=BF16, **kw):
    """``flash_attn_func``'s paged form on the emulated kernel: dense q over two sequences' ``page_size``-key pages,
    the table cut to exactly their pages (every sequence the table's capacity, ``keys``), with ``kw`` (window,
    softcap, ``scale`` of Q and K); checked against the reference, and bit for bit against the same call over
    contiguous K/V. FP8 (``dtype``): token-major FP8 caches with (B, Hkv) descales (V transposed per call)."""
    from leanfa.kernels.hopper.emulate import emulate

    gen = torch.Generator().manual_seed(seed)
    scale = kw.pop("scale", 1.0)
    ks = [scale * torch.randn((keys, 1, 64), generator=gen) for _ in range(2)]
    vs = [torch.randn((keys, 1, 64), generator=gen) for _ in range(2)]
    kc, vc, table = _caches(ks, vs, page_size, gen, dtype=dtype)
    table = table[:, :keys // page_size].contiguous()
    q = (scale * torch.randn((2, queries, 2, 64), generator=gen)).to(dtype)
    if dtype == FP8:
        kw.update({n: torch.rand((2, 1), generator=gen) + 0.5 for n in ("q_descale", "k_descale", "v_descale")})
    tol, lse_tol = (4e-2, 1e-2) if dtype == FP8 else (1e-2, 1e-3)
    out, lse, _ = emulate(_problem(q, kc, vc, page_table=table, **kw))
    ref, ref_lse = attention_ref(q, kc, vc, causal=True, return_lse=True, page_table=table, **kw)
    assert rel_l2(out, ref) < tol and float((lse.double() - ref_lse).abs().max()) < lse_tol
    want, want_lse, _ = emulate(_problem(q, torch.stack(ks).to(dtype), torch.stack(vs).to(dtype), **kw))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@emulation
def test_emulated_dense_q_whole_table():
    """``flash_attn_func``'s form: dense q, every sequence the table's capacity (chunked: Sq < Sk, bottom-right)."""
    _dense_q_over_whole_table(7, 192, 70)


@emulation
def test_emulated_model_like_inputs():
    """Model-like activations (qwen2.5-7b preset: K bias, outlier channels, an attention sink), 64-key pages."""
    from leanfa.activations import make_qkv

    q, k, v = make_qkv("qwen2.5-7b", 2, 48, heads=4, kv_heads=1, seqlen_k=200, seed=3)
    lens_k = [200, 131]
    ks = [k[b, :n].float() for b, n in enumerate(lens_k)]
    vs = [v[b, :n].float() for b, n in enumerate(lens_k)]
    gen = torch.Generator().manual_seed(13)
    kc, vc, table = _caches(ks, vs, 64, gen)
    qp = q.reshape(-1, *q.shape[2:])
    cu = dict(varlen=True, cu_seqlens_q=cu_seqlens([48, 48]), cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=48,
              max_seqlen_k=200)
    _emulate_and_check(_problem(qp, kc, vc, page_table=table, **cu),
                       _problem(qp, torch.cat(ks).to(BF16), torch.cat(vs).to(BF16), **cu))


def _mixed(p):
    """``p`` in the mixed mode (``precision="fp8qk"``): e4m3 Q and K cache (unit descales), the 16-bit V cache."""
    q8 = p.q.to(FP8)
    k8 = p.k.float().clamp(-448, 448).to(FP8)  # (the tail rows' 1e4 as e4m3's largest; unread NaN pages stay NaN)
    kw = dict(varlen=p.varlen, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
              max_seqlen_k=p.max_seqlen_k, window_size=(p.window_left, p.window_right))
    return _problem(q8, k8, p.v, p.causal, page_table=p.page_table, **kw) if p.paged else _problem(q8, k8, p.v,
                                                                                                   p.causal, **kw)


@emulation
@pytest.mark.parametrize("page_size", [64, 128])
def test_emulated_mixed_mode(page_size):
    """The mixed mode (FP8 Q/K, BF16 V) over paged caches: the reference, and the contiguous call's bits."""
    paged, contiguous = _varlen(*LENS, 4, 2, 64, page_size, True, seed=3)
    p = _mixed(paged)
    assert p.is_mixed
    _emulate_and_check(p, _mixed(contiguous))


def _fp8(p, descales: bool = False, seed: int = 0):
    """``(problem, descales)``: ``p`` with e4m3 Q and K/V (caches or packed; the tail rows' 1e4 as e4m3's largest,
    unread NaN pages stay NaN), with FA3's per-head ``(B, Hkv)`` descales when ``descales`` (else ``{}``): the FP8 paged
    form the Hopper kernel reads with V from its pages' transposed copy (:func:`leanfa.kernels.paged_v.gather_paged_v`)."""
    e4m3 = lambda t: t.float().clamp(-448, 448).to(FP8)  # noqa: E731
    kw = dict(varlen=p.varlen, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
              max_seqlen_k=p.max_seqlen_k, window_size=(p.window_left, p.window_right))
    desc = {}
    if descales:
        gen = torch.Generator().manual_seed(seed)
        desc = {n: (torch.rand((p.batch, p.kv_heads), generator=gen) + 0.5).to(p.q.device)
                for n in ("q_descale", "k_descale", "v_descale")}
    if p.paged:
        kw["page_table"] = p.page_table
    return _problem(e4m3(p.q), e4m3(p.k), e4m3(p.v), p.causal, **kw, **desc), desc


def _emulate_fp8_and_check(paged, contiguous, tol=4e-2):
    """The emulated FP8 paged call (``(problem, descales)`` of :func:`_fp8`) against the float64 reference (descales
    included) and, bit for bit, the same call over contiguous FP8 K/V (its V re-packed or transposed instead of
    gathered: the same bytes per key block)."""
    paged, desc = paged
    contiguous, _ = contiguous
    from leanfa.kernels.hopper.emulate import emulate

    assert paged.pv_fp8 and paged.paged
    out, lse, _ = emulate(paged)
    p = paged
    ref, ref_lse = attention_ref(p.q, p.k, p.v, causal=p.causal, return_lse=True, cu_seqlens_q=p.cu_seqlens_q,
                                 cu_seqlens_k=p.cu_seqlens_k, page_table=p.page_table,
                                 window_size=(p.window_left, p.window_right), **desc)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN (unwritten, or a page not to read)"
    assert rel_l2(out, ref) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < 1e-2
    want, want_lse, _ = emulate(contiguous)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "not the contiguous FP8 call's bits"


@emulation
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
def test_emulated_fp8_chunked_prefill(page_size):
    """FP8 paged caches (packed chunks, GQA 2:1, odd lengths, shuffled pages, FA3's (B, Hkv) descales): K page by
    page, V from the transposed copy of its pages; the reference, and the contiguous FP8 call's bits."""
    paged, contiguous = _varlen(*LENS, 4, 2, 64, page_size, True, seed=page_size + 2)
    _emulate_fp8_and_check(_fp8(paged, True, page_size), _fp8(contiguous, True, page_size))


@emulation
def test_emulated_fp8_one_tile_grid_and_full(monkeypatch):
    """Non-causal, on the one-tile grid (FP8's default is persistent), head dim 128, 64-key pages."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    paged, contiguous = _varlen([65, 200], [300, 200], 2, 1, 128, 64, False, seed=4)
    _emulate_fp8_and_check(_fp8(paged), _fp8(contiguous))


@emulation
@pytest.mark.parametrize("window,causal", [((70, -1), True), ((200, 50), False)])
def test_emulated_fp8_window_over_pages(window, causal):
    """A sliding window over FP8 paged caches: the band's absolute key blocks, K through the table and V from the
    copy."""
    paged, contiguous = _varlen(*LENS, 4, 2, 64, 64, causal, seed=9, window=window)
    _emulate_fp8_and_check(_fp8(paged, True, 9), _fp8(contiguous, True, 9))


@emulation
def test_emulated_fp8_dense_q_whole_table():
    """``flash_attn_func``'s form in FP8: dense q over the whole table of 16-key pages (chunked: Sq < Sk,
    bottom-right), descales; against the reference and the same call over dense token-major FP8 K/V."""
    _dense_q_over_whole_table(21, 192, 70, page_size=16, dtype=FP8)


@emulation
@pytest.mark.parametrize("module,fn,edits", [
    ("pipeline", "load_kv_paged", [("[b, hkv, 0, n0]", "[0, hkv, 0, n0]")]),  # every sequence's V from row 0
    ("pipeline", "load_kv_paged", [("[b, hkv, 0, n0]", "[b, hkv, 0, n0 + 16]")]),  # V one group late
    ("kernel_pingpong", "_producer", [("kv_b = b  #", "kv_b = tma_b  #")]),  # varlen: the packed batch's index 0
])
def test_emulated_fp8_mutations_caught(module, fn, edits):
    """The FP8 paged V load must read its own sequence's row of the transposed copy, at the block's keys."""
    import importlib

    _mutated_catches(getattr(importlib.import_module(f"leanfa.kernels.hopper.{module}"), fn), edits, fp8=True)


def _mutated_catches(fn, edits, window=(-1, -1), fp8=False):
    """``fn`` with each ``(old, new)`` of ``edits`` made makes the emulated paged call (with ``window``; e4m3 caches
    when ``fp8``) fail (an emulator error, NaN, or a wrong answer)."""
    from leanfa.kernels.hopper.emulate import EmulationError, emulate

    p, _ = _varlen(*LENS, 4, 2, 64, 64, True, seed=1, window=window)
    if fp8:
        p, _ = _fp8(p)
    with mutated(fn, edits):
        try:
            out, _, _ = emulate(p)
        except EmulationError:
            return
        ref = attention_ref(p.q, p.k, p.v, causal=True, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                            page_table=p.page_table, window_size=window)
        assert torch.isnan(out).any() or rel_l2(out, ref) > (1e-1 if fp8 else 1e-2), "mutation not caught"


@emulation
@pytest.mark.parametrize("fn,edits", [
    # a box past the sequence's keys reads the table's next entry (either guard alone keeps it off: both removed)
    ("page_box", [("gl.where(n < seqlen_k, page, -1)", "page"), ("gl.minimum(n, seqlen_k - 1)", "n")]),
    ("page_box", [("n % PAGE_SIZE", "n % (2 * PAGE_SIZE)")]),  # the row inside the page
    ("page_box", [("// PAGE_SIZE) * stride", "// PAGE_SIZE + 1) * stride")]),  # the page of the key
    ("box_rows", [("buf.slice(i * BOX, BOX, dim=2)", "buf.slice(0, BOX, dim=2)")]),  # every box into rows 0..
    ("load_kv_paged", [("BOXES * QK_CHUNKS * k_desc", "QK_CHUNKS * k_desc")]),  # expect one box of K only
])
def test_emulated_mutations_caught(fn, edits):
    from leanfa.kernels.hopper import pipeline

    _mutated_catches(getattr(pipeline, fn), edits)


#: (window_size, causal): a causal window at a block edge and inside one, the general band, a right side alone
WINDOWS = [((128, -1), True), ((70, -1), True), ((200, 50), False), ((-1, 100), False)]


@emulation
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("window,causal", WINDOWS)
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_emulated_window_over_pages(page_size, window, causal, persistent, monkeypatch):
    """Sliding windows over paged K/V: the producer starts at the band's first key block, an absolute block of the
    sequence, and loads it through the page table: the reference, and the bits of the same window over contiguous
    K/V (the same band blocks in the same order)."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", persistent)
    paged, contiguous = _varlen(*LENS, 4, 2, 64, page_size, causal, seed=page_size + 1, window=window)
    assert paged.has_window
    _emulate_and_check(paged, contiguous)


@emulation
def test_emulated_window_over_pages_dense_q_and_mixed():
    """A window over the whole table with dense q (``flash_attn_func``'s form), and the mixed mode with a window."""
    _dense_q_over_whole_table(11, 384, 300, window_size=(100, -1))
    paged, contiguous = _varlen(*LENS, 4, 2, 64, 64, True, seed=5, window=(129, -1))
    _emulate_and_check(_mixed(paged), _mixed(contiguous))


@emulation
def test_emulated_window_over_pages_mutation_caught():
    """The paged load must get the absolute key block: a block relative to the band's first is caught."""
    from leanfa.kernels.hopper import pipeline

    _mutated_catches(pipeline.produce_kv, [("load_kv_paged(k_desc, v_desc, hkv, j,",
                                            "load_kv_paged(k_desc, v_desc, hkv, j - FIRST,")], window=(100, -1))


# ----------------------------------------------------------------------------- host side (CPU)

def test_paged_problem_reasons():
    """Which paged calls the kernel reads: V caches stored token-major (16-bit, and FP8 through its pages' transposed
    copy), pages of a power of two >= 16 (``None``: a V the plan prepared, the page size alone)."""
    from leanfa.kernels.hopper import launch as L

    v = torch.zeros(4, 64, 2, 128, dtype=BF16)
    assert L.paged_problem(64, v) is None and L.paged_problem(16, v) is None and L.paged_problem(1024, v) is None
    assert "power of two" in L.paged_problem(8, v) and "power of two" in L.paged_problem(384, v)
    assert L.paged_problem(64, v.to(FP8)) is None and L.paged_problem(64, None) is None
    assert "power of two" in L.paged_problem(8, v.to(FP8)) and "power of two" in L.paged_problem(48, None)
    kmajor = torch.zeros(4, 2, 128, 64, dtype=BF16).permute(0, 3, 1, 2)
    assert "token-major" in L.paged_problem(64, kmajor)


Q = torch.zeros(1, 8, 2, 64, dtype=BF16)
KC = torch.zeros(4, 64, 1, 64, dtype=BF16)
TABLE = torch.tensor([[2, 0]], dtype=I32)


def _plain():
    return Problem(q=Q, k=Q, v=Q, batch=1, heads=2, kv_heads=2, head_dim_qk=64, head_dim_v=64, max_seqlen_q=8,
                   max_seqlen_k=8, cu_seqlens_q=None, cu_seqlens_k=None, causal=True, softmax_scale=0.125,
                   q_scale=None, k_scale=None, v_scale=None, k_mean=None, out_dtype=BF16, return_lse=False)


def test_dispatch_routes_paged(monkeypatch):
    """Paged calls the Hopper kernel reads go there with no warning, with a sliding window too, FP8 caches too (dense
    q and packed with cu_seqlens_k, packed q without cu_seqlens_k and seqused_k: vLLM's call); pages of 8 keys run on
    the portable kernel with one warning."""
    dispatch = hopper_accepts_everything(monkeypatch)
    paged = dataclasses.replace(_plain(), k=KC, v=KC, kv_heads=1, max_seqlen_k=128, page_table=TABLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.hopper_applies(paged) == (True, "")
    packed = dict(q=Q[0], cu_seqlens_q=torch.tensor([0, 8], dtype=I32))
    varlen = dataclasses.replace(paged, **packed, cu_seqlens_k=torch.tensor([0, 100], dtype=I32))
    assert dispatch.hopper_applies(varlen) == (True, "")
    with warnings.catch_warnings():  # a sliding window over the pages: the Hopper kernel too
        warnings.simplefilter("error")
        assert dispatch.hopper_applies(dataclasses.replace(varlen, window_left=100)) == (True, "")
        assert dispatch.hopper_applies(dataclasses.replace(paged, window_left=30, window_right=5)) == (True, "")
    per_sequence = dataclasses.replace(paged, **packed)
    used = dataclasses.replace(paged, seqused_k=torch.tensor([100], dtype=I32))
    with warnings.catch_warnings():  # vLLM's call (no cu_seqlens_k) and seqused_k: the Hopper kernel
        warnings.simplefilter("error")
        assert dispatch.hopper_applies(per_sequence) == (True, "")
        assert dispatch.hopper_applies(dataclasses.replace(per_sequence, seqused_k=torch.tensor([100], dtype=I32))) \
            == (True, "")
        assert dispatch.hopper_applies(used) == (True, "")
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_VALIDATED", False)  # the gate still routes them when off
    with pytest.warns(UserWarning, match="packed queries and no cu_seqlens_k"):
        assert not dispatch.hopper_applies(per_sequence)[0]
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_VALIDATED", True)
    from leanfa.kernels import hopper

    fp8 = dataclasses.replace(paged, q=Q.to(FP8), k=KC.to(FP8), v=KC.to(FP8))  # FP8 caches: the Hopper kernel too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.hopper_applies(fp8) == (True, "")
        assert dispatch.hopper_applies(dataclasses.replace(fp8, **packed, cu_seqlens_k=varlen.cu_seqlens_k)) == (
            True, "")
    from leanfa.kernels import hopper

    monkeypatch.setattr(dispatch, "_hopper", lambda: hopper)  # the real page rule (supports() needs a GPU)
    assert dispatch.portable_only_reason(fp8) == ""
    assert dispatch.portable_only_reason(dataclasses.replace(fp8, v=KC)) == ""  # the mixed mode's 16-bit V
    small = dataclasses.replace(paged, k=KC[:, :8], v=KC[:, :8])
    assert "page_size 8" in dispatch.portable_only_reason(small)
    assert dispatch.portable_only_reason(paged) == ""


def test_plan_signature_holds_the_page_table(monkeypatch):
    """The plan cache's key includes the page table's layout (a template binds it as an input)."""
    from leanfa.kernels import hopper

    monkeypatch.delenv("LEANFA_HOPPER_PLAN_CACHE", raising=False)
    paged = dataclasses.replace(_plain(), k=KC, v=KC, kv_heads=1, max_seqlen_k=128, page_table=TABLE)
    wider = dataclasses.replace(paged, page_table=torch.tensor([[2, 0, 1]], dtype=I32))
    strided = dataclasses.replace(paged, page_table=torch.tensor([[2, 9, 0, 9]], dtype=I32)[:, ::2])
    keys = [hopper._signature(p) for p in (paged, wider, strided)]
    assert None not in keys and len(set(keys)) == 3


def test_make_plan_paged():
    """The plan of a paged call: descriptors over the caches in page boxes with the whole block's shared layout, the
    table and its strides, ``PAGE_SIZE``/``KV_BOXES``; FP8: V's descriptor over its pages' transposed copy
    (``V_KMAJOR``); other page sizes refused; without paging the defaults."""
    from leanfa.kernels.hopper import launch as L

    q = torch.zeros(1, 100, 2, 128, dtype=BF16)
    out = torch.empty_like(q)
    kc = torch.zeros(6, 64, 1, 128, dtype=BF16)
    table = torch.zeros(1, 3, dtype=I32)
    ones = torch.ones(1, 1, 1)
    common = dict(causal=True, softmax_scale=0.1, return_lse=False)
    scales = (ones.expand(1, 2, 1), ones.expand(1, 1, 1), ones.expand(1, 1, 128), None)
    plan = L.make_plan(q, kc, kc, out, None, *scales, page_table=table, **common)
    k_desc = plan.args[1]
    assert list(k_desc.block_shape) == [1, 1, 64, 128] and list(k_desc.shape) == [6, 1, 64, 128]
    assert k_desc.layout == L._smem_layout((1, 1, 128, 128), BF16)
    assert plan.constexprs["PAGE_SIZE"] == 64 and plan.constexprs["KV_BOXES"] == 2
    at = next(i for i, a in enumerate(plan.args) if a is table)  # (then its strides)
    assert tuple(plan.args[at + 1:at + 3]) == table.stride() and plan.args[at - 1] is None  # (cu_seqlens_v)
    big = L.make_plan(q, kc.reshape(3, 128, 1, 128), kc.reshape(3, 128, 1, 128), out, None, *scales,
                      page_table=table[:, :2], **common)
    assert big.constexprs["KV_BOXES"] == 1 and list(big.args[1].block_shape) == [1, 1, 128, 128]
    both = L.make_plan(q, kc, kc, out, None, *scales, page_table=table, window=(50, -1), **common)  # + a window
    assert both.constexprs["WINDOW"] and not both.constexprs["CAUSAL"] and both.constexprs["PAGE_SIZE"] == 64
    assert both.args[at] is table and list(both.args[1].block_shape) == [1, 1, 64, 128]
    with pytest.raises(ValueError, match="power of two"):
        L.make_plan(q, kc[:, :8], kc[:, :8], out, None, *scales, page_table=table, **common)
    # FP8: K in page boxes, V from its pages' transposed copy (B, Hkv, Dv, 3 * 64) in one box per key block
    fp8 = L.make_plan(q.to(FP8), kc.to(FP8), kc.to(FP8), out, None, *scales, page_table=table, **common)
    k_desc, v_desc = fp8.args[1], fp8.args[2]
    assert list(k_desc.block_shape) == [1, 1, 64, 128] and list(k_desc.shape) == [6, 1, 64, 128]
    assert list(v_desc.block_shape) == [1, 1, 128, 128] and list(v_desc.shape) == [1, 1, 128, 192]
    assert v_desc.strides[-1] == 1 and v_desc.strides[-2] == 256  # (rows a whole key block apart: 16-byte aligned)
    c = fp8.constexprs
    assert c["PAGE_SIZE"] == 64 and c["KV_BOXES"] == 2 and c["V_KMAJOR"] and c["IS_FP8"] and not c["MIXED"]
    assert fp8.args[at] is table and fp8.args[at - 1] is None  # (no varlen V starts: the copy has a row per sequence)
    plain = L.make_plan(q, q[:, :, :1], q[:, :, :1], out, None, *scales, **common)
    assert plain.constexprs["PAGE_SIZE"] == 0 and plain.constexprs["KV_BOXES"] == 1
    assert plain.args[at - 1:at + 3] == (None, None, None, None)


# ----------------------------------------------------------------------------- the real kernel (H200)

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128, 256])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_chunked_prefill(page_size, d, causal):
    """A serving-sized chunked prefill batch (vLLM's ``block_table`` call with ``cu_seqlens_k``) over shuffled pages on
    the Hopper kernel: the reference, and the bits of the same batch with contiguous K/V on the Hopper kernel."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    gen = torch.Generator().manual_seed(page_size + d)
    lens_q, lens_k, hq, hkv = [512, 1000, 77, 2048, 1], [3000, 1000, 4100, 2048, 700], 16, 4
    ks = [torch.randn((n, hkv, d), generator=gen) for n in lens_k]
    vs = [torch.randn((n, hkv, d), generator=gen) for n in lens_k]
    kc, vc, table = (t.cuda() for t in _caches(ks, vs, page_size, gen))
    q = torch.randn((sum(lens_q), hq, d), generator=gen).to(BF16).cuda()
    cu_q, cu_k = cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda")
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = leanfa.flash_attn_varlen_func(q, kc, vc, *args, causal=causal, return_lse=True, page_table=table,
                                             backend="hopper")
    ref, ref_lse = attention_ref(q, kc, vc, causal=causal, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 page_table=table)
    assert rel_l2(out, ref) < TOL[BF16]
    assert float((lse.double() - ref_lse).abs().max()) < 1e-3
    k, v = torch.cat(ks).to(BF16).cuda(), torch.cat(vs).to(BF16).cuda()
    want, want_lse = leanfa.flash_attn_varlen_func(q, k, v, *args, causal=causal, return_lse=True, backend="hopper")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # the drop-in (vLLM's flash-attn fork: block_table=) and backend="auto" take the Hopper kernel too
    from leanfa import flash_attn_interface as fa3
    from leanfa.kernels import dispatch

    got = fa3.flash_attn_varlen_func(q, kc, vc, *args, causal=causal, block_table=table)
    assert torch.equal(got, out)
    p = _problem(q, kc, vc, causal, varlen=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                 max_seqlen_k=max(lens_k), page_table=table)
    assert dispatch.choose(p, "auto").kernel == "hopper"


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 128])
def test_gpu_dense_q_and_cache_reuse(page_size):
    """``flash_attn_func`` over the whole table (dense q, chunked), twice with new page ids (the kept plan binds
    the new table), against the reference."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    gen = torch.Generator().manual_seed(page_size)
    cap = 1024
    for rep in range(2):
        ks = [torch.randn((cap, 2, 128), generator=gen) for _ in range(3)]
        vs = [torch.randn((cap, 2, 128), generator=gen) for _ in range(3)]
        kc, vc, table = (t.cuda() for t in _caches(ks, vs, page_size, gen))
        table = table[:, : cap // page_size].contiguous()
        q = torch.randn((3, 300, 8, 128), generator=gen).to(BF16).cuda()
        out, lse = leanfa.flash_attn_func(q, kc, vc, causal=True, return_lse=True, page_table=table,
                                          backend="hopper")
        ref, ref_lse = attention_ref(q, kc, vc, causal=True, return_lse=True, page_table=table)
        assert rel_l2(out, ref) < TOL[BF16], rep
        assert float((lse.double() - ref_lse).abs().max()) < 1e-3, rep


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 128])
def test_gpu_mixed_mode(page_size):
    """FP8 Q and K cache with a BF16 V cache (the mixed mode) on the Hopper kernel: the contiguous call's bits."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    lens_q, lens_k = [300, 1000, 5], [2000, 1000, 900]
    paged, contiguous = _varlen(lens_q, lens_k, 8, 2, 128, page_size, True, seed=page_size, device="cuda")
    got, want = _mixed(paged), _mixed(contiguous)
    from leanfa.kernels import dispatch

    assert dispatch.choose(got, "hopper").kernel == "hopper"
    out, _ = dispatch.run(got, "hopper")
    ref, _ = dispatch.run(want, "hopper")
    assert torch.equal(out, ref)
    p = got
    gold = attention_ref(p.q, p.k, p.v, causal=True, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                         page_table=p.page_table)
    assert rel_l2(out, gold) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("window,causal", [((1024, -1), True), ((700, 300), False)])
def test_gpu_window_over_pages(page_size, window, causal):
    """A sliding window over paged caches (vLLM's ``block_table`` call with ``cu_seqlens_k``) on the Hopper kernel:
    ``backend="auto"`` picks it, the reference, and the bits of the same window over contiguous K/V."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    from leanfa.kernels import dispatch

    lens_q, lens_k = [512, 1000, 77, 2048, 1], [3000, 1000, 4100, 2048, 700]
    paged, contiguous = _varlen(lens_q, lens_k, 16, 4, 128, page_size, causal, seed=page_size, device="cuda",
                                window=window)
    assert dispatch.choose(paged, "auto").kernel == "hopper"
    out, lse = dispatch.run(paged, "hopper")
    p = paged
    ref, ref_lse = attention_ref(p.q, p.k, p.v, causal=causal, return_lse=True, cu_seqlens_q=p.cu_seqlens_q,
                                 cu_seqlens_k=p.cu_seqlens_k, page_table=p.page_table, window_size=window)
    assert rel_l2(out, ref) < TOL[BF16]
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < 1e-3
    want, want_lse = dispatch.run(contiguous, "hopper")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.gpu
def test_gpu_fp8_paged_runs_hopper(monkeypatch):
    """FP8 paged caches run on the Hopper kernel with ``backend="auto"`` and no warning (K page by page, V from its
    pages' transposed copy), against the reference."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    from leanfa.kernels import dispatch

    monkeypatch.setattr(dispatch, "_WARNED", set())
    gen = torch.Generator().manual_seed(3)
    ks = [torch.randn((320, 2, 128), generator=gen) for _ in range(2)]
    kc, vc, table = (t.cuda() for t in _caches(ks, ks, 64, gen, dtype=FP8))
    q = torch.randn((2, 64, 4, 128), generator=gen).to(FP8).cuda()
    table = table[:, :5].contiguous()  # exactly the sequences' pages: every key is attended
    p = _problem(q, kc, vc, page_table=table)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose(p, "auto").kernel == "hopper"
        out = leanfa.flash_attn_func(q, kc, vc, causal=True, page_table=table)
    ref = attention_ref(q, kc, vc, causal=True, page_table=table)
    assert rel_l2(out, ref) < TOL[FP8]


@emulation
def test_emulated_softcap_over_pages():
    """softcap (the consumers' scores) over paged K/V (the producer's loads) compose: a dense q over the whole
    table with softcap 5 and a window, scores of ~+-30 where tanh saturates."""
    _dense_q_over_whole_table(13, 384, 300, softcap=5.0, window_size=(100, -1), scale=4.0)
