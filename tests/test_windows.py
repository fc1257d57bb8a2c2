"""Sliding-window attention (flash-attn's ``window_size=(left, right)``) and ``softcap`` on the portable
kernel, through the public API and the flash-attn drop-ins.

Every call is checked against the float64 reference (:func:`leanfa.reference.attention_ref`, which
builds the same mask on its own): output within the precision's tolerance, LSE ``-inf`` exactly where
the reference's is (rows whose window holds no key: output 0), finite LSEs close. Outputs are poisoned
with NaN before each launch (conftest: ``LEANFA_POISON_OUTPUTS``), so an unwritten element fails.
Inputs are fresh random draws (never zero); shapes are small for the CPU interpreter (32x32 tiles
there: windows start and end inside tiles, and tiles lie wholly outside some windows).
"""

import dataclasses
import warnings

import pytest
import torch

import leanfa
from leanfa import flash_attn_interface as fa3
from leanfa.compat import flash_attn as fa2
from leanfa.problem import Problem
from leanfa.reference import attention_ref

from helpers import TOL, cu_seqlens, hopper_accepts_everything, rel_l2

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
I32 = torch.int32


def _rand(shape, device, dtype=BF16, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype).to(device)


def _check(out, lse, ref, ref_lse, tol):
    """Output within ``tol`` of float64 (no NaN: every element written), LSE -inf exactly where the
    reference's is (there the output is 0), finite LSEs close."""
    assert rel_l2(out, ref) < tol
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no key in the window"
    finite = ~empty
    if finite.any():
        err = (lse.double() - ref_lse)[finite].abs().max().item()
        assert err < (0.3 if tol > 5e-2 else 2e-3), err
    rows_out = out.transpose(-3, -2) if out.dim() == 4 else out.transpose(0, 1)  # (.., H, S, D) like the LSE
    assert (rows_out[empty] == 0).all(), "rows with no key are 0"


def _fp8(q, k, v, device):
    """FP8 inputs with FA3-style per-head (B, Hkv) descales (inputs scaled into the e4m3 range)."""
    b, hkv = q.shape[0], k.shape[2]
    d = [torch.rand(b, hkv, device=device) + 0.5 for _ in range(3)]
    return (q.to(FP8), k.to(FP8), v.to(FP8)), dict(q_descale=d[0], k_descale=d[1], v_descale=d[2])


# (id, causal, window_size, Sq, Sk): GQA (2 query heads on 1 KV head) throughout
DENSE = [
    ("left", False, (17, -1), 100, 100),
    ("right", False, (-1, 9), 100, 100),
    ("both", False, (20, 5), 100, 100),
    ("causal+left", True, (33, -1), 100, 100),
    ("causal-ignores-right", True, (6, 40), 70, 70),  # flash-attn: causal makes the right side 0
    ("diagonal-only", False, (0, 0), 70, 70),  # one key per row, narrower than a tile
    ("sq<sk-both", False, (10, 3), 45, 130),
    ("sq<sk-causal+left", True, (40, -1), 45, 130),
    ("sq>sk-both", False, (5, 2), 130, 60),  # the first rows' windows hold no key: 0, LSE -inf
    ("sq>sk-left", False, (3, -1), 100, 40),
    # one key short of covering every key (the last row misses key 0; the first row the last key): a window
    # one longer is no window (test_window_normalization_bit_identical)
    ("left-one-short", False, (48, -1), 40, 50),
    ("right-one-short", False, (-1, 38), 40, 50),
]


@pytest.mark.parametrize("causal,window,sq,sk", [c[1:] for c in DENSE], ids=[c[0] for c in DENSE])
def test_dense_window_bf16(device, causal, window, sq, sk):
    q, k, v = _rand((1, sq, 2, 64), device), _rand((1, sk, 1, 64), device), _rand((1, sk, 1, 64), device)
    out, lse = leanfa.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert out.shape == (1, sq, 2, 64) and lse.shape == (1, 2, sq)
    _check(out, lse, ref, ref_lse, TOL[BF16])
    if window == (0, 0) and sq == sk:  # each row sees its own key only: out = v at that row, exactly
        assert torch.equal(out, v.expand(-1, -1, 2, -1))


def test_keys_outside_the_band_are_never_loaded(device):
    """One query tile whose windows lie at the end of a long key sequence: the keys in blocks wholly left of
    every window are NaN in K and V, which any load would carry into the output (0 * NaN in P V)."""
    q = _rand((1, 32, 2, 64), device)
    k, v = _rand((1, 256, 1, 64), device), _rand((1, 256, 1, 64), device)
    kw = dict(causal=True, window_size=(20, -1), return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    # rows see keys [i + 224 - 20, i + 224]: keys below 204 are outside every window; the keys below 128 (a
    # multiple of every key block width the kernels use: 32, 64, 128) lie in blocks that hold none of them
    kn, vn = k.clone(), v.clone()
    kn[:, :128], vn[:, :128] = float("nan"), float("nan")
    out, lse = leanfa.flash_attn_func(q, kn, vn, **kw)
    _check(out, lse, ref, ref_lse, TOL[BF16])


@pytest.mark.parametrize("causal,window,cap", [(False, (12, 4), 0.0), (True, (7, -1), 0.0), (False, (9, 9), 3.0)],
                         ids=["both", "causal+left", "both+softcap"])
def test_varlen_window(device, causal, window, cap):
    """Packed sequences of odd lengths, a 1-token and a 0-token sequence, one with queries but no key;
    the window and its bottom-right alignment are per sequence."""
    lens_q, lens_k = [37, 1, 0, 64, 5, 3], [50, 1, 0, 45, 3, 0]
    q = _rand((sum(lens_q), 2, 64), device)
    k, v = _rand((sum(lens_k), 1, 64), device), _rand((sum(lens_k), 1, 64), device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    kw = dict(causal=causal, window_size=window, softcap=cap, return_lse=True)
    out, lse = leanfa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    ref, ref_lse = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    assert lse.shape == (2, sum(lens_q))
    _check(out, lse, ref, ref_lse, TOL[BF16])
    assert torch.isneginf(lse[:, -3:]).all() and (out[-3:] == 0).all()  # the sequence without keys


def test_window_with_seqused(device):
    """FA3's seqused_q/seqused_k with a window and softcap: the call equals the truncated problem (the window
    aligned to the used lengths); rows past seqused_q are 0 with LSE -inf."""
    q, k, v = _rand((2, 50, 2, 64), device), _rand((2, 70, 1, 64), device), _rand((2, 70, 1, 64), device)
    used_q, used_k = torch.tensor([50, 21], dtype=I32, device=device), torch.tensor([40, 70], dtype=I32, device=device)
    kw = dict(window_size=(9, 2), softcap=6.0, return_lse=True)
    out, lse = leanfa.flash_attn_func(q, k, v, seqused_q=used_q, seqused_k=used_k, **kw)
    for b, (uq, uk) in enumerate(zip(used_q.tolist(), used_k.tolist())):
        ref, ref_lse = attention_ref(q[b:b + 1, :uq], k[b:b + 1, :uk], v[b:b + 1, :uk], **kw)
        _check(out[b:b + 1, :uq], lse[b:b + 1, :, :uq], ref, ref_lse, TOL[BF16])
        assert (out[b, uq:] == 0).all() and torch.isneginf(lse[b, :, uq:]).all()


def test_softcap_alone(device):
    """Non-causal, no window, scores large enough (scale 0.5) that the cap changes the result."""
    q, k, v = _rand((2, 70, 2, 64), device), _rand((2, 90, 1, 64), device), _rand((2, 90, 1, 64), device)
    kw = dict(softmax_scale=0.5, softcap=4.0, return_lse=True)
    out, lse = leanfa.flash_attn_func(q, k, v, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    _check(out, lse, ref, ref_lse, TOL[BF16])
    uncapped = attention_ref(q, k, v, softmax_scale=0.5)
    assert rel_l2(uncapped, ref) > 10 * TOL[BF16], "the cap must matter in this test"


def test_softcap_with_window(device):
    q, k, v = _rand((1, 80, 2, 128), device), _rand((1, 96, 1, 128), device), _rand((1, 96, 1, 128), device)
    kw = dict(causal=True, window_size=(25, -1), softcap=2.5, softmax_scale=0.3, return_lse=True)
    out, lse = leanfa.flash_attn_func(q, k, v, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    _check(out, lse, ref, ref_lse, TOL[BF16])


@pytest.mark.parametrize("varlen", [False, True])
def test_fp8_window_softcap(device, varlen):
    """FP8 inputs with (B, Hkv) descales (dense) or a per-tensor descale (varlen), window and softcap."""
    kw = dict(window_size=(30, 6), softcap=3.0, return_lse=True)
    if varlen:
        lens = [41, 1, 0, 70]
        cu = cu_seqlens(lens, device)
        q, k, v = (_rand((sum(lens), h, 64), device) for h in (2, 1, 1))
        d = torch.full((1,), 0.75, device=device)
        q8, k8, v8 = (t.to(FP8) for t in (q, k, v))
        out, lse = leanfa.flash_attn_varlen_func(q8, k8, v8, cu, cu, 70, 70, q_descale=d, k_descale=d,
                                                 v_descale=d, **kw)
        ref, ref_lse = attention_ref(q8, k8, v8, cu_seqlens_q=cu, cu_seqlens_k=cu, q_descale=d, k_descale=d,
                                     v_descale=d, **kw)
    else:
        q, k, v = _rand((2, 60, 2, 64), device), _rand((2, 90, 1, 64), device), _rand((2, 90, 1, 64), device)
        (q8, k8, v8), ds = _fp8(q, k, v, device)
        out, lse = leanfa.flash_attn_func(q8, k8, v8, **ds, **kw)
        ref, ref_lse = attention_ref(q8, k8, v8, **ds, **kw)
    assert out.dtype == BF16
    _check(out, lse, ref, ref_lse, TOL[FP8])


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_attention_smoothed_k_softcap(device, precision):
    """``attention(precision="fp8")`` smooths K (stores K - mean): softcap's tanh must see the true scores
    q.k, not q.(k - mean). K gets a large per-channel mean so the difference is far beyond tolerance."""
    q = _rand((1, 96, 2, 64), device)
    k = (torch.randn((1, 96, 1, 64)) + 2.0 * torch.randn(64)).to(BF16).to(device)
    v = _rand((1, 96, 1, 64), device)
    kw = dict(causal=True, window_size=(40, -1), softcap=2.0, return_lse=True)
    out, lse = leanfa.attention(q, k, v, precision=precision, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    assert out.dtype == BF16
    _check(out, lse, ref, ref_lse, TOL[FP8 if precision == "fp8" else BF16])


def test_window_normalization_bit_identical(device):
    """flash-attn's rules: a window reaching past every key is no window, (-1, 0) is causal, causal makes the
    right side 0; each gives the same bits as the plain call."""
    q, k, v = _rand((1, 40, 2, 64), device), _rand((1, 50, 1, 64), device), _rand((1, 50, 1, 64), device)

    def call(**kw):
        return leanfa.flash_attn_func(q, k, v, return_lse=True, **kw)

    for got, want in [(call(window_size=(49, 39)), call()), (call(window_size=(49, -1)), call()),
                      (call(window_size=(-1, 39)), call()),
                      (call(window_size=(1000, -1), causal=True), call(causal=True)),
                      (call(window_size=(-1, 0)), call(causal=True)),
                      (call(window_size=(8, 30), causal=True), call(window_size=(8, 0)))]:
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_drop_ins_pass_window_and_softcap(device):
    """FA3's and flash-attn 2's functions (also the packed forms) give leanfa's bits."""
    q, k, v = _rand((1, 45, 2, 64), device), _rand((1, 45, 2, 64), device), _rand((1, 45, 2, 64), device)
    kw = dict(window_size=(11, 3), softcap=5.0)
    want, want_lse = leanfa.flash_attn_func(q, k, v, return_lse=True, **kw)
    out3, lse3 = fa3.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert torch.equal(out3, want) and torch.equal(lse3, want_lse)
    assert torch.equal(fa2.flash_attn_func(q, k, v, **kw), want)
    assert torch.equal(fa2.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kw), want)
    lens = [20, 25]
    cu = cu_seqlens(lens, device)
    qp, kp, vp = q[0], k[0], v[0]
    want, want_lse = leanfa.flash_attn_varlen_func(qp, kp, vp, cu, cu, 25, 25, causal=True, return_lse=True, **kw)
    out3, lse3 = fa3.flash_attn_varlen_func(qp, kp, vp, cu, cu, 25, 25, causal=True, return_attn_probs=True, **kw)
    assert torch.equal(out3, want) and torch.equal(lse3, want_lse)
    assert torch.equal(fa2.flash_attn_varlen_kvpacked_func(qp, torch.stack([kp, vp], 1), cu, cu, 25, 25,
                                                           causal=True, **kw), want)
    ref = attention_ref(qp, kp, vp, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, **kw)
    assert rel_l2(want, ref) < TOL[BF16]


# no launch: the checks run before any kernel
BAD = [
    ("left < -1", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, window_size=(-2, 4)), ValueError, "window_size must be"),
    ("right < -1", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, window_size=(4, -5)), ValueError, "right -5 < -1"),
    ("varlen left < -1", lambda Q, CU: leanfa.flash_attn_varlen_func(Q[0], Q[0], Q[0], CU, CU, 8, 8, window_size=(-3, -1)),
     ValueError, "left -3 < -1"),
    ("softcap < 0", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, softcap=-1.0), ValueError, "softcap must be"),
    ("softcap nan", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, softcap=float("nan")), ValueError, "softcap must be"),
    ("softcap tensor", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, softcap=torch.tensor(1.0)), TypeError, "softcap"),
    ("window not a pair", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, window_size=4), TypeError, "window_size"),
    ("window tensor of 3", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, window_size=torch.tensor([1, 2, 3])),
     TypeError, "window_size"),
    ("window float tensor", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, window_size=torch.tensor([1.0, 2.0])),
     TypeError, "window_size"),
    ("window float", lambda Q, CU: leanfa.flash_attn_func(Q, Q, Q, window_size=(4.0, 0)), TypeError, "window_size left"),
    ("fa3 window", lambda Q, CU: fa3.flash_attn_func(Q, Q, Q, window_size=(-7, 0)), ValueError, "window_size must be"),
    ("fa3 varlen softcap", lambda Q, CU: fa3.flash_attn_varlen_func(Q[0], Q[0], Q[0], CU, CU, 8, 8, softcap=-2.0),
     ValueError, "softcap must be"),
    ("fa2 window", lambda Q, CU: fa2.flash_attn_func(Q, Q, Q, window_size=(3, -9)), ValueError, "window_size must be"),
    ("fa2 softcap", lambda Q, CU: fa2.flash_attn_kvpacked_func(Q, torch.stack([Q, Q], 2), softcap=-0.5), ValueError,
     "softcap must be"),
    ("attention window", lambda Q, CU: leanfa.attention(Q, Q, Q, window_size=(-4, 0)), ValueError, "window_size must be"),
    ("sink keys with window", lambda Q, CU: leanfa.attention(Q, Q, Q, bf16_sink_keys=128, window_size=(64, 0)),
     ValueError, "bf16_sink_keys cannot be combined"),
]


@pytest.mark.parametrize("call,exc,msg", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_window_or_softcap(device, call, exc, msg):
    q, cu = torch.ones(1, 8, 2, 64, dtype=BF16, device=device), torch.tensor([0, 8], dtype=I32, device=device)
    with pytest.raises(exc, match=msg):
        call(q, cu)


def _plain_problem():
    q = torch.zeros(1, 8, 2, 64, dtype=BF16)
    return Problem(q=q, k=q, v=q, batch=1, heads=2, kv_heads=2, head_dim_qk=64, head_dim_v=64,
                   max_seqlen_q=8, max_seqlen_k=8, cu_seqlens_q=None, cu_seqlens_k=None, causal=True,
                   softmax_scale=0.125, q_scale=None, k_scale=None, v_scale=None, k_mean=None,
                   out_dtype=BF16, return_lse=False)


@pytest.mark.parametrize("change", [dict(window_left=4), dict(causal=False, window_right=2),
                                    dict(causal=False, window_left=3, window_right=5), dict(softcap=30.0),
                                    dict(window_left=4, softcap=5.0),
                                    dict(causal=False, window_left=3, window_right=5, softcap=15.0)])
def test_hopper_dispatch_takes_windows_and_softcap(monkeypatch, change):
    """Sliding windows and (16-bit) softcap run on the Hopper kernel (its WINDOW and SOFTCAP paths), alone or
    together, with no warning."""
    dispatch = hopper_accepts_everything(monkeypatch)
    problem = dataclasses.replace(_plain_problem(), **change)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.hopper_applies(problem) == (True, "")
        assert dispatch.portable_only_reason(problem) == ""


def test_hopper_dispatch_keeps_fp8_d256_windows_portable(monkeypatch):
    """FP8 (P.V in e4m3) at head dim 256 with a window runs on the portable kernel, with the reason; without a
    window, or in BF16, at head dim 256 it stays on the Hopper kernel."""
    dispatch = hopper_accepts_everything(monkeypatch)
    q8 = torch.zeros(1, 8, 2, 256, dtype=torch.float8_e4m3fn)
    wide = dataclasses.replace(_plain_problem(), q=q8, k=q8, v=q8, head_dim_qk=256, head_dim_v=256)
    assert dispatch.hopper_applies(wide) == (True, "")
    with pytest.warns(UserWarning, match="head dim 256"):
        assert not dispatch.hopper_applies(dataclasses.replace(wide, window_left=4))[0]
    assert dispatch.portable_only_reason(dataclasses.replace(_plain_problem(), head_dim_qk=256, head_dim_v=256,
                                                             window_left=4)) == ""


@pytest.mark.parametrize("change,reason", [
    (dict(attention_chunk=64), "attention_chunk \\(chunked local attention\\) is not implemented"),
    (dict(attention_chunk=64, window_left=4, softcap=30.0),
     "attention_chunk \\(chunked local attention\\) is not implemented"),
    (dict(attention_chunk=64, softcap=30.0), "attention_chunk \\(chunked local attention\\) is not implemented"),
])
def test_hopper_dispatch_refuses_with_one_warning(monkeypatch, change, reason):
    """Where the Hopper kernel would run a call, a call with a portable-only feature (here attention_chunk, with or
    without a window and softcap) runs on the portable kernel with one warning per process; backend="hopper"
    raises with the reason."""
    dispatch = hopper_accepts_everything(monkeypatch)
    plain = _plain_problem()
    assert dispatch.hopper_applies(plain) == (True, "")
    problem = dataclasses.replace(plain, **change)
    with pytest.warns(UserWarning, match=reason):
        ok, why = dispatch.hopper_applies(problem)
    assert not ok and "portable kernel" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second refusal is silent
        assert dispatch.choose(problem, "auto").kernel == "portable"
        with pytest.raises(ValueError, match=f"backend='hopper' cannot run this call: {reason}"):
            dispatch.choose(problem, "hopper")


def test_fp8_softcap_is_not_portable_only():
    """softcap with FP8 Q.K runs on the Hopper kernel (validated on the H200, run 98): no portable-only reason."""
    from leanfa.kernels import dispatch

    fp8 = torch.zeros(1, 8, 2, 64, dtype=torch.float8_e4m3fn)
    assert dispatch.portable_only_reason(dataclasses.replace(_plain_problem(), q=fp8, k=fp8, v=fp8, softcap=30.0)) == ""


def test_window_size_as_a_cpu_tensor(device):
    """FA3's own tests pass ``window_size`` as a CPU integer tensor of two elements: it is the same window."""
    q = _rand((1, 40, 2, 64), device)
    a = leanfa.flash_attn_func(q, q, q, causal=True, window_size=(5, 0))
    b = leanfa.flash_attn_func(q, q, q, causal=True, window_size=torch.tensor([5, 0]))
    assert torch.equal(a, b)
