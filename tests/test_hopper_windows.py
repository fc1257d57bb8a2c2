"""Sliding windows (flash-attn's ``window_size=(left, right)``) in the Hopper kernel.

On the CPU: the kernel's own source run by the emulator (:mod:`leanfa.kernels.hopper.emulate`) through the real
host plan, against the float64 reference (:func:`leanfa.reference.attention_ref`, which builds the window mask on
its own), outputs poisoned with NaN first: windows at the 128-key block edges (left = 0, 1, 127, 128, 129), wider
than the sequence, the general band (``right > 0``, not causal) and a right side only, ``Sq != Sk`` both ways,
GQA, dense and packed varlen, BF16, FP8 and the mixed mode, one tile per program and persistent. The key blocks
each tile reads are exactly those of its band (the emulator also checks that every loaded K/V box is read once by
each consumer: the ring positions of producer and consumers agree). Mutations of the band's bounds are caught.

On an sm90 GPU (``@pytest.mark.gpu``): the real kernel through the public API, same reference.
"""

from __future__ import annotations

import pytest
import torch

import leanfa
from leanfa.reference import attention_ref
from helpers import check_out_lse, cu_seqlens, public_call, quantized_problem

BF16 = torch.bfloat16
BLOCK = 128
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _inputs(lq, lk, hq, hkv, d, seed, varlen):
    """Random Q, K (with a bias channel group, as real keys have) and V: dense ``(1, S, H, D)`` or packed."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = (sum(lq), sum(lk)) if varlen else (lq, lk)
    lead = () if varlen else (1,)
    q = torch.randn(*lead, tq, hq, d, generator=g)
    k = torch.randn(*lead, tk, hkv, d, generator=g)
    k[..., :4] = k[..., :4] * 4 + 2
    v = torch.randn(*lead, tk, hkv, d, generator=g)
    return q.to(BF16), k.to(BF16), v.to(BF16)


def _problem(q, k, v, *, causal, window, precision, lse=True, cu=None):
    return quantized_problem(q, k, v, causal=causal, precision=precision, lse=lse, cu=cu, window_size=window)


def _reference(p, window):
    fp8 = p.is_fp8
    return attention_ref(p.q, p.k, p.v, causal=p.causal, softmax_scale=p.softmax_scale, return_lse=True,
                         window_size=window, cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k,
                         cu_seqlens_v=p.cu_seqlens_v, k_mean=p.k_mean,
                         q_descale=p.q_scale if fp8 else None, k_descale=p.k_scale if fp8 else None,
                         v_descale=p.v_scale if p.pv_fp8 else None)


def _check(out, lse, ref, ref_lse, tol, lse_tol=2e-2):
    """:func:`helpers.check_out_lse` (rows with no visible key: 0, LSE -inf) with this file's LSE bound."""
    check_out_lse(out, lse, ref, ref_lse, tol, lse_tol)


def _band_blocks(rows, sq, sk, left, right, causal, block_n):
    """The key blocks some row of ``rows`` sees (flash-attn's window, bottom-right aligned)."""
    keys = torch.arange(sk)
    pos = rows[:, None] + (sk - sq)
    vis = torch.ones(len(rows), sk, dtype=torch.bool)
    if left >= 0:
        vis &= keys[None, :] >= pos - left
    if causal:
        vis &= keys[None, :] <= pos
    elif right >= 0:
        vis &= keys[None, :] <= pos + right
    return sorted({int(j) // block_n for j in keys[vis.any(0)]})


def _check_band_schedule(p, rep, window):
    """One tile per program (dense): each tile reads exactly the key blocks of its band, in order, once per
    consumer partition; tiles whose band holds no key read nothing."""
    _, sq, hq, dqk = p.q.shape
    sk = p.k.shape[1]
    chunks = 1 if dqk & (dqk - 1) == 0 else dqk // 64
    n_tiles = -(-sq // BLOCK)
    for (_, pid1), per_part in rep.schedule.items():
        m0 = (n_tiles - 1 - pid1) * BLOCK
        want = _band_blocks(torch.arange(m0, min(m0 + BLOCK, sq)), sq, sk, *window, p.causal, BLOCK)
        assert per_part or not want, (pid1, want)
        for reads in per_part.values():
            assert [c[2] // BLOCK for c in reads] == [j for j in want for _ in range(chunks)], (pid1, want)


# ----------------------------------------------------------------------------- CPU: the emulated kernel

emulate_mod = pytest.importorskip("leanfa.kernels.hopper.emulate")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation test (runs where there is no GPU)")

DENSE_CASES = [  # Sq, Sk, window (flash-attn's), causal
    (700, 700, (0, 0), True),
    (700, 700, (1, -1), True),
    (700, 700, (127, 0), True),
    (700, 700, (128, -1), True),
    (700, 700, (129, -1), True),
    (300, 300, (5000, -1), True),  # wider than the sequence: the causal mask (normalized away)
    (640, 640, (256, 256), False),  # the general band, block-aligned sides
    (700, 700, (129, 127), False),
    (700, 700, (-1, 130), False),  # a right side only
    (700, 700, (200, -1), False),  # a left side only
    (300, 700, (129, 5), False),  # Sq < Sk (bottom-right aligned)
    (300, 700, (64, -1), True),
    (700, 300, (1, 3), False),  # Sq > Sk: the first rows' windows hold no key
    (700, 300, (128, -1), True),
    (1, 1500, (300, -1), True),  # one query row: its band is a few blocks at the end
]


@cpu_only
@pytest.mark.parametrize("sq,sk,window,causal", DENSE_CASES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_dense_window_one_tile_per_program(sq, sk, window, causal, precision, monkeypatch):
    """GQA 2:1, head dim 128, one tile per program: the output, the LSE and every tile's key blocks."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    emulate_mod.reset_shadows()
    p = _problem(*_inputs(sq, sk, 2, 1, 128, sq + sk, False), causal=causal, window=window, precision=precision)
    assert p.has_window or window[0] >= sk - 1
    out, lse, rep = emulate_mod.emulate(p)
    _check(out, lse, *_reference(p, window), 4e-2 if precision == "fp8" else 1e-2)
    _check_band_schedule(p, rep, (p.window_left, p.window_right))


@cpu_only
@pytest.mark.parametrize("sq,sk,window,causal", [DENSE_CASES[i] for i in (2, 4, 7, 10, 12)])
@pytest.mark.parametrize("precision,dims", [("bf16", (128, 128)), ("fp8", (128, 128)), ("fp8qk", (128, 128)),
                                            ("fp8", (192, 128)), ("bf16", (64, 64)), ("bf16", (256, 256)),
                                            ("fp8", (256, 256))])
def test_dense_window_default_plan(sq, sk, window, causal, precision, dims, monkeypatch):
    """The default plan (persistent grid and TMA-store epilogue where they apply: a program's ring runs on across
    tiles whose bands start at different blocks), at every head dim; BF16 d256 reads 64-key blocks."""
    for name in ("LEANFA_HOPPER_PERSISTENT", "LEANFA_HOPPER_STORE_TMA"):
        monkeypatch.delenv(name, raising=False)
    emulate_mod.reset_shadows()
    g = torch.Generator().manual_seed(sq)
    q = torch.randn(1, sq, 4, dims[0], generator=g).to(BF16)
    k = torch.randn(1, sk, 2, dims[0], generator=g).to(BF16)
    v = torch.randn(1, sk, 2, dims[1], generator=g).to(BF16)
    p = _problem(q, k, v, causal=causal, window=window, precision=precision)
    out, lse, _ = emulate_mod.emulate(p)
    _check(out, lse, *_reference(p, window), 1e-2 if precision == "bf16" else 4e-2)


VARLEN_CASES = [  # q lengths, k lengths, window, causal
    ([0, 1, 130, 300, 77], [5, 1, 300, 130, 77], (128, -1), True),  # Sq < Sk and Sq > Sk, empty and 1-token
    ([0, 1, 130, 300, 77], [5, 1, 300, 130, 77], (129, 7), False),
    ([257, 300], [700, 129], (1, 0), False),
    ([200, 64, 1000], [900, 64, 3000], (300, -1), True),  # chunked prefill: a cached prefix
]


@cpu_only
@pytest.mark.parametrize("lq,lk,window,causal", VARLEN_CASES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_varlen_window(lq, lk, window, causal, precision, persistent, monkeypatch):
    """Packed sequences (GQA 2:1), each with its own band; the tile table ordered by the band's keys."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", persistent)
    emulate_mod.reset_shadows()
    cu = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    p = _problem(*_inputs(lq, lk, 2, 1, 128, len(lq), True), causal=causal, window=window, precision=precision,
                 cu=cu)
    assert p.has_window
    out, lse, _ = emulate_mod.emulate(p)
    _check(out, lse, *_reference(p, window), 4e-2 if precision == "fp8" else 1e-2)


@cpu_only
def test_window_plan():
    """The plan of a windowed call: WINDOW on, CAUSAL off (the band holds the causal side), the band's sides as
    the kernel's bounds (an unbounded side past every key); a call without a window plans as before."""
    from leanfa.kernels.hopper import launch as L

    assert L.window_bounds(True, (-1, -1), 100, 200) is None
    assert L.window_bounds(True, (5, -1), 100, 200) == (5, 0)
    assert L.window_bounds(False, (-1, 3), 100, 200) == (200, 3)
    assert L.window_bounds(False, (7, -1), 100, 200) == (7, 100)
    q, k, v = _inputs(300, 300, 2, 1, 128, 0, False)
    out = torch.empty(1, 300, 2, 128, dtype=BF16)
    for window, causal, want in (((64, -1), True, (64, 0)), ((-1, -1), True, None), ((10, 20), False, (10, 20))):
        p = _problem(q, k, v, causal=causal, window=window, precision="bf16", lse=False)
        plan = emulate_mod._make_plan_cpu(L, p, out, None)
        assert plan.constexprs["WINDOW"] == (want is not None)
        assert plan.constexprs["CAUSAL"] == (want is None and causal)
        names = [n for n in plan.kernel.arg_names if n not in plan.constexprs]
        bounds = (plan.args[names.index("window_left")], plan.args[names.index("window_right")])
        assert bounds == (want or (0, 0))
    with pytest.raises(ValueError, match="sink"):
        L.make_plan(q, k, v, out, None, *(torch.ones(1, 1, 1),) * 3, None, causal=True, softmax_scale=0.1,
                    return_lse=False, window=(4, -1), sink=(128, q, k, v))


@cpu_only
@pytest.mark.parametrize("fn,old,new", [
    ("window_block_range", "gl.maximum(m_start + shift - window_left, 0) // BLOCK_N",
     "gl.maximum(m_start + shift - window_left - BLOCK_N, 0) // BLOCK_N"),  # one block too early: not read once
    ("window_block_range", "n_lfull = (gl.maximum(last_row + shift - window_left, 0) + BLOCK_N - 1) // BLOCK_N",
     "n_lfull = gl.maximum(last_row + shift - window_left, 0) // BLOCK_N"),  # the left edge block unmasked
    ("mask_band", "offs_n[None, :] >= diag - window_left", "offs_n[None, :] >= diag - window_left - 1"),
    ("window_block_range", "full_keys // BLOCK_N", "(full_keys + BLOCK_N - 1) // BLOCK_N"),  # right edge unmasked
])
def test_window_mutations_caught(fn, old, new, monkeypatch):
    """The checks above fail when the band's bounds are off by one (block or key)."""
    from leanfa.kernels.hopper import masking

    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    jit_fn = getattr(masking, fn)
    src = emulate_mod.inspect.getsource(jit_fn.fn)
    assert old in src
    emulate_mod.reset_shadows()
    try:
        emulate_mod.shadow(jit_fn, src.replace(old, new))
        caught = []
        for sq, sk, window, causal in (DENSE_CASES[2], DENSE_CASES[7], DENSE_CASES[10]):
            p = _problem(*_inputs(sq, sk, 2, 1, 128, 1, False), causal=causal, window=window, precision="bf16")
            try:
                out, lse, rep = emulate_mod.emulate(p)
                _check(out, lse, *_reference(p, window), 1e-2)
                _check_band_schedule(p, rep, (p.window_left, p.window_right))
            except AssertionError:  # (EmulationError is one too)
                caught.append(True)
        assert caught, f"{fn}: {old!r} -> {new!r} not caught"
    finally:
        emulate_mod.reset_shadows()


def test_window_tile_table_orders_by_band():
    """The varlen tile table with a window lists every tile once, ordered by the keys of its band: a long
    sequence's tiles are no heavier than a short one's once both bands are full (interpreter or GPU)."""
    from leanfa.kernels.hopper import varlen_tiles

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lq = [1000, 300, 260]
    cu = cu_seqlens(lq, dev)
    left = 200
    table = varlen_tiles.build(cu, cu, sum(lq), max(lq), True, BLOCK, (left, -1)).cpu()
    n, shift = int(table[0]), varlen_tiles.PAIR_SHIFT.value
    pairs = [(int(x) >> shift, int(x) & ((1 << shift) - 1)) for x in table[1:1 + n]]
    assert sorted(pairs) == sorted((b, m) for b, length in enumerate(lq) for m in range(-(-length // BLOCK)))

    def band_keys(b, m):
        hi = min(lq[b], (m + 1) * BLOCK)
        return max(hi - max(m * BLOCK - left, 0), 0)

    keys = [-(-band_keys(b, m) // 128) for b, m in pairs]
    assert keys == sorted(keys, reverse=True)
    assert pairs[-1][1] == 0  # a first tile (its band is cut by the sequence start) is among the lightest


# ----------------------------------------------------------------------------- GPU: the real kernel

gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm90 (Hopper) GPU")

GPU_DENSE = [  # B, Sq, Sk, Hq, Hkv, window, causal
    (2, 1000, 1000, 4, 2, (0, 0), True),
    (2, 1000, 1000, 4, 2, (127, -1), True),
    (2, 1000, 1000, 4, 2, (128, -1), True),
    (1, 1000, 1000, 4, 2, (129, -1), True),
    (1, 4096, 4096, 8, 2, (1024, -1), True),
    (1, 2000, 2000, 4, 4, (256, 256), False),
    (1, 2000, 2000, 4, 1, (-1, 300), False),
    (1, 700, 3000, 4, 2, (500, -1), True),  # Sq < Sk
    (1, 3000, 700, 4, 2, (100, 20), False),  # Sq > Sk: rows with no key
    (1, 300, 300, 2, 2, (5000, -1), True),  # wider than the sequence
]


def _gpu_call(q, k, v, *, causal, window, precision, cu=None, backend="hopper"):
    """The public API on the Hopper kernel (``backend="hopper"``: it raises where the kernel does not apply)."""
    return public_call(q, k, v, precision=precision, cu=cu, causal=causal, window_size=window, return_lse=True,
                       backend=backend)


@gpu
@needs_sm90
@pytest.mark.parametrize("b,sq,sk,hq,hkv,window,causal", GPU_DENSE)
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8qk"])
def test_gpu_dense_window(b, sq, sk, hq, hkv, window, causal, precision):
    g = torch.Generator().manual_seed(sq + sk)
    q = torch.randn(b, sq, hq, 128, generator=g).to(BF16).cuda()
    k = torch.randn(b, sk, hkv, 128, generator=g).to(BF16).cuda()
    v = torch.randn(b, sk, hkv, 128, generator=g).to(BF16).cuda()
    out, lse = _gpu_call(q, k, v, causal=causal, window=window, precision=precision)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, return_lse=True)
    _check_gpu(out, lse, ref, ref_lse, precision,
               lambda: _gpu_call(q, k, v, causal=causal, window=window, precision=precision, backend="portable"))


def _check_gpu(out, lse, ref, ref_lse, precision, portable):
    """BF16: against float64 of the inputs. FP8 (and fp8qk): against the same call on the portable kernel (the
    same quantized inputs: only the kernels' arithmetic differs), and loosely against float64 of the BF16 inputs
    (a narrow window averages few V rows, so e4m3's rounding of P, V and the scores shows more: H200 run 93 saw
    output errors of 5.1-7.6e-2 and LSE errors up to 0.18 there)."""
    if precision == "bf16":
        _check(out, lse, ref, ref_lse, 1e-2)
        return
    p_out, p_lse = portable()
    _check(out, lse, p_out.double(), p_lse.double(), 2e-2, lse_tol=3e-2)
    _check(out, lse, ref, ref_lse, 1.2e-1, lse_tol=0.35)


@gpu
@needs_sm90
@pytest.mark.parametrize("lq,lk,window,causal", VARLEN_CASES + [([8192, 3001, 100, 2], None, (4096, -1), True)])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_varlen_window(lq, lk, window, causal, precision):
    lk = lk or lq
    q, k, v = (t.cuda() for t in _inputs(lq, lk, 4, 2, 128, len(lq), True))
    cu = dict(cu_seqlens_q=cu_seqlens(lq, "cuda"), cu_seqlens_k=cu_seqlens(lk, "cuda"), max_seqlen_q=max(lq),
              max_seqlen_k=max(lk))
    out, lse = _gpu_call(q, k, v, causal=causal, window=window, precision=precision, cu=cu)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, return_lse=True,
                                 cu_seqlens_q=cu["cu_seqlens_q"], cu_seqlens_k=cu["cu_seqlens_k"])
    _check_gpu(out, lse, ref, ref_lse, precision,
               lambda: _gpu_call(q, k, v, causal=causal, window=window, precision=precision, cu=cu, backend="portable"))


@gpu
@needs_sm90
def test_gpu_window_runs_on_hopper_by_default():
    """``backend="auto"`` sends a windowed call to the Hopper kernel (no portable fallback, no warning)."""
    import warnings

    from leanfa.kernels import dispatch

    q = torch.randn(1, 512, 4, 128, device="cuda", dtype=BF16)
    p = _problem(q, q[:, :, :2], q[:, :, :2], causal=True, window=(100, -1), precision="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose(p, "auto").kernel == "hopper"
