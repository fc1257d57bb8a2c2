"""Soft-capping (flash-attn's ``softcap``: scores ``s -> softcap * tanh(s / softcap)``) in the Hopper kernel.

On the CPU: the kernel's own source run by the emulator (:mod:`leanfa.kernels.hopper.emulate`, ``tanh.approx.f32``
as float32 tanh) through the real host plan, against the float64 reference (:func:`leanfa.reference.attention_ref`,
which caps the true scores), outputs poisoned with NaN first: softcap 5, 15 and 30, logits of +-1e3 (tanh
saturated), causal and not, ``Sq != Sk``, GQA, dense and packed varlen, BF16, FP8 with a smoothed K (the kernel's
``SOFTCAP == 2``: ``q . mean`` inside tanh's argument, not in the LSE) and the mixed mode, windows, every head dim.
Mutations of the capping (no K-mean shift, the mask before the cap, the wrong exp2 scale) are caught.

On an sm90 GPU (``@pytest.mark.gpu``): the real kernel through the public API, same reference, and the hardware
tanh's own error.
"""

from __future__ import annotations

import math

import pytest
import torch

import leanfa
from leanfa.reference import attention_ref
from helpers import check_out_lse, cu_seqlens, public_call, quantized_problem

BF16 = torch.bfloat16
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _inputs(lq, lk, hq, hkv, d, seed, varlen, scale=1.0, dv=None):
    """Random Q, K (with a bias channel group, as real keys have: a smoothed K's mean is far from 0) and V, dense
    ``(1, S, H, D)`` or packed; ``scale`` multiplies Q and K (the logits by its square)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = (sum(lq), sum(lk)) if varlen else (lq, lk)
    lead = () if varlen else (1,)
    q = torch.randn(*lead, tq, hq, d, generator=g) * scale
    k = torch.randn(*lead, tk, hkv, d, generator=g)
    k[..., :4] = k[..., :4] * 4 + 2
    k = k * scale
    v = torch.randn(*lead, tk, hkv, dv or d, generator=g)
    return q.to(BF16), k.to(BF16), v.to(BF16)


def _problem(q, k, v, *, causal, softcap, precision, window=(-1, -1), lse=True, cu=None):
    """(FP8: quantize_fp8 smooths K, so the kernel's SOFTCAP is 2)"""
    return quantized_problem(q, k, v, causal=causal, precision=precision, lse=lse, cu=cu, window_size=window,
                             softcap=softcap)


def _reference(p):
    fp8 = p.is_fp8
    return attention_ref(p.q, p.k, p.v, causal=p.causal, softmax_scale=p.softmax_scale, return_lse=True,
                         window_size=(p.window_left, p.window_right), softcap=p.softcap,
                         cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, cu_seqlens_v=p.cu_seqlens_v,
                         k_mean=p.k_mean, q_descale=p.q_scale if fp8 else None,
                         k_descale=p.k_scale if fp8 else None, v_descale=p.v_scale if p.pv_fp8 else None)


def _check(out, lse, ref, ref_lse, tol, lse_tol=2e-3):
    """:func:`helpers.check_out_lse` (rows with no visible key: 0, LSE -inf) with this file's LSE bound."""
    check_out_lse(out, lse, ref, ref_lse, tol, lse_tol)


def _tol(precision):
    return 1e-2 if precision == "bf16" else 4e-2


# ----------------------------------------------------------------------------- CPU: the emulated kernel

emulate_mod = pytest.importorskip("leanfa.kernels.hopper.emulate")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation test (runs where there is no GPU)")

DENSE_CASES = [  # Sq, Sk, causal, softcap, logit scale
    (300, 300, True, 5.0, 1.0),
    (300, 300, False, 15.0, 1.0),
    (300, 300, True, 30.0, 2.0),
    (200, 450, True, 15.0, 1.5),  # Sq < Sk (bottom-right causal)
    (450, 200, True, 5.0, 1.0),  # Sq > Sk: the first rows see no key
    (300, 300, True, 5.0, 12.0),  # logits ~ +-1e3: tanh saturated
    (300, 300, False, 30.0, 12.0),
]


@cpu_only
@pytest.mark.parametrize("sq,sk,causal,softcap,scale", DENSE_CASES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_dense_softcap(sq, sk, causal, softcap, scale, precision, monkeypatch):
    """GQA 2:1, head dim 128, the default plan (FP8: one tile per program; BF16: persistent, TMA-store)."""
    for name in ("LEANFA_HOPPER_PERSISTENT", "LEANFA_HOPPER_STORE_TMA"):
        monkeypatch.delenv(name, raising=False)
    emulate_mod.reset_shadows()
    p = _problem(*_inputs(sq, sk, 2, 1, 128, sq + sk, False, scale), causal=causal, softcap=softcap,
                 precision=precision)
    assert (p.k_mean is not None) == (precision == "fp8")
    if scale > 4:  # the logits reach +-1e3: tanh is saturated for most of them
        s = p.softmax_scale * (p.q.float()[0, :, 0] @ p.k.float()[0, :, 0].T) if precision == "bf16" else None
        assert s is None or float(s.abs().max()) > 500
    out, lse, _ = emulate_mod.emulate(p)
    _check(out, lse, *_reference(p), _tol(precision))


@cpu_only
@pytest.mark.parametrize("precision,dims", [("fp8qk", (128, 128)), ("fp8", (192, 128)), ("bf16", (192, 128)),
                                            ("bf16", (64, 64)), ("fp8", (64, 64)), ("bf16", (256, 256)),
                                            ("fp8", (256, 256)), ("fp8qk", (256, 256))])
def test_softcap_head_dims_and_mixed(precision, dims, monkeypatch):
    """Every head dim and the mixed mode, the default plan; BF16 d256 reads 64-key blocks."""
    for name in ("LEANFA_HOPPER_PERSISTENT", "LEANFA_HOPPER_STORE_TMA"):
        monkeypatch.delenv(name, raising=False)
    emulate_mod.reset_shadows()
    p = _problem(*_inputs(260, 260, 4, 2, dims[0], dims[0], False, 1.5, dims[1]), causal=True, softcap=15.0,
                 precision=precision)
    out, lse, _ = emulate_mod.emulate(p)
    _check(out, lse, *_reference(p), _tol(precision))


VARLEN_CASES = [  # q lengths, k lengths, causal
    ([0, 1, 130, 300, 77], [5, 1, 300, 130, 77], True),  # Sq < Sk and Sq > Sk, empty and 1-token sequences
    ([257, 300], [700, 129], False),
]


@cpu_only
@pytest.mark.parametrize("lq,lk,causal", VARLEN_CASES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_varlen_softcap(lq, lk, causal, precision, persistent, monkeypatch):
    """Packed sequences (GQA 2:1), one program per table slot and persistent (each sequence's own K mean)."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", persistent)
    emulate_mod.reset_shadows()
    cu = dict(cu_seqlens_q=cu_seqlens(lq), cu_seqlens_k=cu_seqlens(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    p = _problem(*_inputs(lq, lk, 2, 1, 128, len(lq), True, 1.5), causal=causal, softcap=5.0, precision=precision,
                 cu=cu)
    out, lse, _ = emulate_mod.emulate(p)
    _check(out, lse, *_reference(p), _tol(precision))


@cpu_only
@pytest.mark.parametrize("window,causal", [((129, -1), True), ((100, 60), False)])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_softcap_with_window(window, causal, precision, monkeypatch):
    """softcap inside a sliding window: the band's edge blocks are masked after capping."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    emulate_mod.reset_shadows()
    p = _problem(*_inputs(500, 500, 2, 1, 128, 3, False, 1.5), causal=causal, softcap=5.0, precision=precision,
                 window=window)
    assert p.has_window
    out, lse, _ = emulate_mod.emulate(p)
    _check(out, lse, *_reference(p), _tol(precision))


@cpu_only
def test_softcap_plan():
    """The plan of a soft-capped call: SOFTCAP 1 (2 with a smoothed K, whose K-mean term then leaves the LSE:
    HAS_KMEAN off), tanh's argument's scale as ``qk_scale`` and the cap as ``softcap``; FP8 P.V on the one-tile
    grid; a call without softcap plans as before; with BF16 sink keys it is refused."""
    from leanfa.kernels.hopper import launch as L

    def plan_of(precision, softcap, lse=True):
        p = _problem(*_inputs(300, 300, 2, 1, 128, 0, False), causal=True, softcap=softcap, precision=precision,
                     lse=lse)
        out = torch.empty(1, 300, 2, 128, dtype=BF16)
        lse_t = torch.empty(1, 2, 300) if lse else None
        plan = emulate_mod._make_plan_cpu(L, p, out, lse_t)
        names = [n for n in plan.kernel.arg_names if n not in plan.constexprs]
        return p, plan, dict(zip(names, plan.args))

    for precision, softcap, mode in (("bf16", 0.0, 0), ("bf16", 30.0, 1), ("fp8", 0.0, 0), ("fp8", 30.0, 2),
                                     ("fp8qk", 5.0, 2)):
        p, plan, args = plan_of(precision, softcap)
        c = plan.constexprs
        assert c["SOFTCAP"] == mode
        assert c["HAS_KMEAN"] == (p.k_mean is not None and mode == 0)
        assert args["softcap"] == softcap
        want = p.softmax_scale / softcap if mode else p.softmax_scale * L.LOG2E
        assert args["qk_scale"] == pytest.approx(want, rel=1e-12)
        if mode == 2:
            assert args["k_mean_ptr"] is p.k_mean
        if precision == "fp8":  # FP8 P.V with softcap: the one-tile grid (the persistent build spills) ...
            assert c["PERSISTENT"] == (mode == 0 and not c["HAS_KMEAN"])
    assert plan_of("fp8", 0.0, lse=False)[1].constexprs["PERSISTENT"]  # ... persistent without it
    assert not plan_of("fp8", 30.0, lse=False)[1].constexprs["PERSISTENT"]
    q, k, v = _inputs(300, 300, 2, 1, 128, 0, False)
    out = torch.empty(1, 300, 2, 128, dtype=BF16)
    with pytest.raises(ValueError, match="sink"):
        L.make_plan(q, k, v, out, None, *(torch.ones(1, 1, 1),) * 3, None, causal=True, softmax_scale=0.1,
                    return_lse=False, softcap=30.0, sink=(128, q, k, v))


@cpu_only
@pytest.mark.parametrize("fn,old,new,precision", [
    # the smoothed K's q . mean left out of tanh's argument (softmax-exact without softcap, wrong with it)
    ("_softmax_block", "capped_scores(s, c, cap[1], SOFTCAP == 2)", "capped_scores(s, c, cap[1], False)", "fp8"),
    # the cap in the natural-log domain (log2(e) missing)
    ("_consumer_tile", "cap = (softcap * 1.4426950408889634, shift)", "cap = (softcap, shift)", "bf16"),
    # the shift computed with the wrong scale (softmax_scale * q_scale, not / softcap)
    ("_consumer_tile", "stride_kmh, stride_kmd, b, hkv, c_q, WG_WARPS)",
     "stride_kmh, stride_kmd, b, hkv, c_q * 2.0, WG_WARPS)", "fp8"),
])
def test_softcap_mutations_caught(fn, old, new, precision, monkeypatch):
    """The checks above fail when the capping is wrong."""
    from leanfa.kernels.hopper import kernel_pingpong

    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    jit_fn = getattr(kernel_pingpong, fn)
    src = emulate_mod.inspect.getsource(jit_fn.fn)
    assert old in src
    emulate_mod.reset_shadows()
    try:
        emulate_mod.shadow(jit_fn, src.replace(old, new))
        p = _problem(*_inputs(300, 300, 2, 1, 128, 5, False, 1.5), causal=True, softcap=5.0, precision=precision)
        out, lse, _ = emulate_mod.emulate(p)
        with pytest.raises(AssertionError):
            _check(out, lse, *_reference(p), _tol(precision))
    finally:
        emulate_mod.reset_shadows()


@cpu_only
def test_softcap_mask_after_cap_mutation_caught(monkeypatch):
    """Masking before capping (a masked score's tanh(-inf) = -1 gives its key exp(-softcap) weight) is caught."""
    from leanfa.kernels.hopper import kernel_pingpong

    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    src = emulate_mod.inspect.getsource(kernel_pingpong._softmax_block.fn)
    cap = ("    if SOFTCAP:  # tanh(s c + shift) in [-1, 1]; the softmax scales it by softcap * log2(e)\n"
           "        s = capped_scores(s, c, cap[1], SOFTCAP == 2)\n        c = cap[0]\n")
    step = "    p, m_i, l_i, alpha = online_softmax_step("
    assert cap in src and step in src
    emulate_mod.reset_shadows()
    try:
        emulate_mod.shadow(kernel_pingpong._softmax_block, src.replace(cap, "").replace(step, cap + step))
        p = _problem(*_inputs(300, 300, 2, 1, 128, 6, False), causal=True, softcap=2.0, precision="bf16")
        out, lse, _ = emulate_mod.emulate(p)
        with pytest.raises(AssertionError):
            _check(out, lse, *_reference(p), _tol("bf16"))
    finally:
        emulate_mod.reset_shadows()


_AOT_SNIPPET = """
import sys
from leanfa.kernels.hopper.gluon_aot import Variant, compile_variant
dtype, kmean = sys.argv[1], sys.argv[2] == "1"
r = compile_variant(Variant(dtype, 128, 128, causal=True, return_lse=kmean, k_mean=kmean, softcap=30.0))
print(r.ptx.count("tanh.approx.f32"), r.ptx.count("ex2.approx"), r.spill_stores, r.spill_loads)
"""


def _compile_available():
    try:
        from leanfa.kernels.hopper import gluon_aot  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _compile_available(), reason="Gluon/ptxas for sm90 not available")
@pytest.mark.parametrize("dtype,kmean,budget", [("fp8", "1", 64), ("fp8", "0", 64), ("bf16", "0", 128)])
def test_softcap_aot_sm90(dtype, kmean, budget):
    """The soft-capped kernel compiles for sm90 with tanh on the SFU (``tanh.approx.f32``) and within the spill
    budget of its grid (FP8: one tile per program, 0-16 B; BF16 persistent, as without softcap: 52/92 B)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _AOT_SNIPPET, dtype, kmean], env=env, cwd=root, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    tanh, ex2, spill_st, spill_ld = map(int, r.stdout.split()[-4:])
    assert tanh > 0 and ex2 > 0
    assert spill_st <= budget and spill_ld <= budget


# ----------------------------------------------------------------------------- GPU: the real kernel

gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not ON_SM90, reason="needs an sm90 (Hopper) GPU")

#: the hardware tanh (tanh.approx.f32) is within 2^-11 relative (PTX ISA); a capped score moves by at most
#: softcap * 2^-11, and so does the LSE (a shift of every score by <= e moves the LSE by <= e)
TANH_REL_ERR = 2.0 ** -11


def _lse_tol(softcap):
    return 2e-2 + softcap * TANH_REL_ERR


GPU_DENSE = [  # B, Sq, Sk, Hq, Hkv, causal, softcap, logit scale
    (2, 1000, 1000, 4, 2, True, 30.0, 1.0),
    (2, 1000, 1000, 4, 2, False, 5.0, 1.0),
    (1, 4096, 4096, 8, 2, True, 15.0, 1.5),
    (1, 700, 3000, 4, 2, True, 30.0, 2.0),  # Sq < Sk
    (1, 3000, 700, 4, 2, True, 5.0, 1.0),  # Sq > Sk: rows with no key
    (1, 1000, 1000, 4, 4, True, 30.0, 12.0),  # logits ~ +-1e3: tanh saturated
]


def _check_gpu(out, lse, ref, ref_lse, precision, softcap, problem):
    """BF16: the public call against float64 of the inputs. FP8 and fp8qk: the Hopper kernel on the quantized problem
    (``problem()``, :func:`helpers.quantized_problem`) against float64 of that problem and against the portable kernel
    on it (the same quantized inputs: only the kernels' arithmetic and tanh differ), and the public call's output
    loosely against float64 of the BF16 inputs (e4m3 rounding of the inputs: 4-9e-2 on inputs scaled up to 12x, H200
    run 96). Two public calls are not compared with each other: H200 run 97 found their LSEs 7.26 apart at logit
    scale 12 while both kernels matched float64 of the same quantized problem within 7e-3."""
    if precision == "bf16":
        _check(out, lse, ref, ref_lse, 1e-2, _lse_tol(softcap))
        return
    from leanfa.kernels import hopper, portable

    p = problem()
    h_out, h_lse = hopper.run(p)
    _check(h_out, h_lse, *_reference(p), _tol(precision), _lse_tol(softcap))
    p_out, p_lse = portable.run(p)
    _check(h_out, h_lse, p_out.double(), p_lse.double(), 2e-2, _lse_tol(softcap))
    assert not torch.isnan(out).any()
    assert float((out.double() - ref).norm() / ref.norm()) < 1.5e-1


def _gpu_call(q, k, v, *, causal, softcap, precision, cu=None, window=(-1, -1), backend="hopper"):
    """The public API on the Hopper kernel (``backend="hopper"``: it raises where the kernel does not apply)."""
    return public_call(q, k, v, precision=precision, cu=cu, causal=causal, softcap=softcap, window_size=window,
                       return_lse=True, backend=backend)


@gpu
@needs_sm90
@pytest.mark.parametrize("b,sq,sk,hq,hkv,causal,softcap,scale", GPU_DENSE)
@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp8qk"])
def test_gpu_dense_softcap(b, sq, sk, hq, hkv, causal, softcap, scale, precision):
    g = torch.Generator().manual_seed(sq + sk)
    q = (torch.randn(b, sq, hq, 128, generator=g) * scale).to(BF16).cuda()
    k = (torch.randn(b, sk, hkv, 128, generator=g) * scale).to(BF16).cuda()
    v = torch.randn(b, sk, hkv, 128, generator=g).to(BF16).cuda()
    out, lse = _gpu_call(q, k, v, causal=causal, softcap=softcap, precision=precision)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softcap=softcap, return_lse=True)
    _check_gpu(out, lse, ref, ref_lse, precision, softcap,
               lambda: _problem(q, k, v, causal=causal, softcap=softcap, precision=precision))


@gpu
@needs_sm90
@pytest.mark.parametrize("lq,lk,causal", VARLEN_CASES + [([8192, 3001, 100, 2], None, True)])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_varlen_softcap(lq, lk, causal, precision):
    lk = lk or lq
    q, k, v = (t.cuda() for t in _inputs(lq, lk, 4, 2, 128, len(lq), True, 1.5))
    cu = dict(cu_seqlens_q=cu_seqlens(lq, "cuda"), cu_seqlens_k=cu_seqlens(lk, "cuda"), max_seqlen_q=max(lq),
              max_seqlen_k=max(lk))
    out, lse = _gpu_call(q, k, v, causal=causal, softcap=30.0, precision=precision, cu=cu)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, softcap=30.0, return_lse=True,
                                 cu_seqlens_q=cu["cu_seqlens_q"], cu_seqlens_k=cu["cu_seqlens_k"])
    _check_gpu(out, lse, ref, ref_lse, precision, 30.0,
               lambda: _problem(q, k, v, causal=causal, softcap=30.0, precision=precision, cu=cu))


@gpu
@needs_sm90
@pytest.mark.parametrize("precision,dims", [("bf16", (64, 64)), ("fp8", (192, 128)), ("bf16", (256, 256)),
                                            ("fp8", (256, 256))])
def test_gpu_softcap_head_dims_and_window(precision, dims):
    g = torch.Generator().manual_seed(dims[0])
    q = torch.randn(1, 2000, 4, dims[0], generator=g).to(BF16).cuda()
    k = torch.randn(1, 2000, 2, dims[0], generator=g).to(BF16).cuda()
    v = torch.randn(1, 2000, 2, dims[1], generator=g).to(BF16).cuda()
    window = (-1, -1) if precision == "fp8" and dims[1] == 256 else (700, 0)  # (FP8 d256 windows: portable)
    out, lse = _gpu_call(q, k, v, causal=True, softcap=30.0, precision=precision, window=window)
    ref, ref_lse = attention_ref(q, k, v, causal=True, softcap=30.0, window_size=window, return_lse=True)
    _check_gpu(out, lse, ref, ref_lse, precision, 30.0,
               lambda: _problem(q, k, v, causal=True, softcap=30.0, precision=precision, window=window))


@gpu
@needs_sm90
def test_gpu_tanh_approx_error():
    """The hardware tanh the kernel uses (``tanh.approx.f32``) against float64 tanh over [-20, 20]: within
    :data:`TANH_REL_ERR` relative (the bound the LSE tolerance above assumes), exactly +-1 once saturated."""
    import triton
    import triton.language as tl

    @triton.jit
    def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
        tl.store(y_ptr + offs, y, mask=offs < n)

    x = torch.linspace(-20, 20, 1 << 22, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double())
    rel = ((y.double() - want).abs() / want.abs().clamp(min=1e-30)).max().item()
    print(f"tanh.approx.f32: max relative error {rel:.3g} = 2^{math.log2(max(rel, 1e-30)):.2f}")
    assert rel <= TANH_REL_ERR
    assert torch.equal(y[x.abs() >= 10].abs(), torch.ones_like(y[x.abs() >= 10]))


@gpu
@needs_sm90
def test_gpu_softcap_runs_on_hopper_by_default():
    """``backend="auto"`` sends soft-capped calls to the Hopper kernel, BF16, FP8 and the mixed mode alike (no
    portable fallback, no warning)."""
    import warnings

    from leanfa.kernels import dispatch

    q = torch.randn(1, 512, 4, 128, device="cuda", dtype=BF16)
    for precision in ("bf16", "fp8", "fp8qk"):
        p = _problem(q, q[:, :, :2], q[:, :, :2], causal=True, softcap=30.0, precision=precision)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dispatch.choose(p, "auto").kernel == "hopper", precision
