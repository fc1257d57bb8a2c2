"""Numerical edge cases: masked rows, extreme logits, FP8 saturation, NaN/inf inputs, outliers,
attention sinks, and (GPU) sequences long enough to overflow 32-bit indexing.

The behaviour asserted here is what README "Numerics" documents. Outputs are poisoned with NaN
before every launch (conftest), so "finite" also means "written".
"""

from __future__ import annotations

import math

import pytest
import torch

import leanfa
from leanfa.reference import attention_ref

from helpers import TOL, rel_l2

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
INTERPRETER = not HAS_CUDA


def _qkv(b, sq, sk, hq, hkv, d, dtype, device, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g)
    k = torch.randn(b, sk, hkv, d, generator=g)
    v = torch.randn(b, sk, hkv, dv or d, generator=g)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def reference_rows(q, k, v, rows, *, heads=None, causal=False, softmax_scale=None):
    """Float64 reference for selected query ``rows`` (and ``heads``) of a dense B=1 problem only:
    out (len(rows), len(heads), Dv) and lse (len(heads), len(rows)). Bottom-right causal
    alignment; keys are read in chunks so a 128K-token check stays small."""
    sq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    sk, hkv = k.shape[1], k.shape[2]
    heads = list(range(hq)) if heads is None else list(heads)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    rows_t = torch.as_tensor(rows, device=q.device)
    outs, lses = [], []
    for h in heads:
        hk = h // (hq // hkv)
        qr = q[0, rows_t, h].double()  # (R, D)
        kk = k[0, :, hk].double()  # (Sk, D)
        s = (qr @ kk.T) * scale  # (R, Sk)
        if causal:
            cols = torch.arange(sk, device=q.device)
            s = s.masked_fill(cols[None, :] > (rows_t[:, None] + sk - sq), -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.nan_to_num(neginf=0.0)[:, None])
        p = torch.where(torch.isneginf(lse)[:, None], torch.zeros_like(p), p)
        outs.append(p @ v[0, :, hk].double())
        lses.append(lse)
    return torch.stack(outs, 1), torch.stack(lses, 0)


# --------------------------------------------------------------------------------------------
# masked rows, extreme logits


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_fully_masked_rows_zero_and_minus_inf(device, precision):
    """causal with Sq > Sk: the first Sq - Sk query rows see no key -> output exactly 0, LSE -inf;
    varlen: an empty key sequence masks every row of its query sequence."""
    q, k, v = _qkv(1, 70, 20, 2, 1, 64, BF16, device)
    out, lse = leanfa.attention(q, k, v, causal=True, precision=precision, return_lse=True)
    assert torch.all(out[:, :50] == 0) and torch.isneginf(lse[:, :, :50]).all()
    assert torch.isfinite(out[:, 50:]).all() and torch.isfinite(lse[:, :, 50:]).all()
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 0, 9], dtype=torch.int32, device=device)  # sequence 0 has no key
    qv, kv, vv = q[0, :12], k[0, :9], v[0, :9]
    out, lse = leanfa.attention(qv, kv, vv, causal=False, precision=precision, return_lse=True,
                                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=9)
    assert torch.all(out[:5] == 0) and torch.isneginf(lse[:, :5]).all()
    assert torch.isfinite(out[5:]).all() and torch.isfinite(lse[:, 5:]).all()


@pytest.mark.parametrize("softmax_scale", [1e-6, 1e-3, 10.0, 1e3])
def test_extreme_softmax_scale(device, softmax_scale):
    """Tiny scale: uniform attention (out = mean of the visible V); huge scale: argmax
    attention (scores ~1e4: max subtraction must keep exp2 finite)."""
    q, k, v = _qkv(1, 45, 45, 2, 1, 64, BF16, device, seed=1)
    out, lse = leanfa.flash_attn_func(q, k, v, causal=True, softmax_scale=softmax_scale, return_lse=True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, softmax_scale=softmax_scale, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_l2(out, ref) < TOL[BF16]
    assert ((lse.double() - ref_lse).abs() <= 1e-3 + 1e-4 * ref_lse.abs()).all()


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_q_scaled_x100(device, precision):
    """Logits ~100x the usual (std ~100): one key per row dominates."""
    q, k, v = _qkv(1, 40, 40, 2, 2, 128, torch.float32, device, seed=2)
    dt = FP16 if precision == "fp16" else BF16
    q, k, v = (q * 100).to(dt), k.to(dt), v.to(dt)
    if precision == "fp8":
        # FP8 logit error scales with the logit (~5% of ~100 here): against the unquantized
        # inputs the answer is as good as e4m3 allows (~0.2 rel L2: near-ties flip the winner).
        # The kernel's own job is checked against the reference on the quantized values.
        quant = leanfa.quantize_fp8(q, k, v)
        out = leanfa.flash_attn_func(quant, causal=True)
        assert torch.isfinite(out).all()
        assert rel_l2(out, attention_ref(quant, causal=True)) < 5e-2
        assert rel_l2(out, attention_ref(q, k, v, causal=True)) < 0.4
        return
    out = leanfa.flash_attn_func(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    assert rel_l2(out, attention_ref(q, k, v, causal=True)) < TOL[dt]


# --------------------------------------------------------------------------------------------
# FP8 saturation


def test_fp8_values_at_saturation(device):
    """Raw FP8 inputs at the e4m3 maximum (+-448) with descales: logits up to ~1e3 and V at the
    edge of the range; compared against the reference on the same FP8 values."""
    g = torch.Generator().manual_seed(3)
    sign = lambda *s: torch.where(torch.rand(*s, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
    q = (sign(1, 64, 2, 128) * 448.0).to(FP8).to(device)
    k = (torch.randn(1, 64, 2, 128, generator=g) * 150).clamp(-448, 448).to(FP8).to(device)
    v = (sign(1, 64, 2, 128) * 448.0).to(FP8).to(device)
    qd = torch.tensor(1 / 448.0, device=device)
    kd = torch.tensor(1 / 150.0, device=device)
    vd = torch.full((1, 2, 128), 2.0, device=device)
    for causal in (False, True):
        out = leanfa.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                                     out_dtype=torch.float32)
        ref = attention_ref(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal)
        assert torch.isfinite(out).all()
        assert rel_l2(out, ref) < 5e-2  # only P is rounded (see test_fuzz: raw FP8)
        # a convex combination of V, up to the e4m3 rounding of P (the numerator uses rounded P,
        # the denominator l the unrounded sum): |out| <= max|V| * (1 + 2^-4)
        assert out.abs().max() <= 448.0 * 2.0 * (1 + 2**-4)


def test_quantize_saturates_beyond_448(device):
    """quantize_fp8 computes its own scales, so values land within +-448; with a given scale
    (the internal path) values beyond +-448 clamp to +-448, never inf/NaN."""
    from leanfa.quant import _quantize_launch, _Seqs

    x = torch.tensor([0.0, 1.0, -3.0, 447.0, 449.0, -500.0, 1e6, -1e30], dtype=torch.float32)
    x = x.repeat(8).reshape(1, 64, 1, 1).expand(1, 64, 1, 64).contiguous().to(device)
    y = torch.empty(x.shape, dtype=FP8, device=device)
    scale = torch.ones((1, 1, 1), dtype=torch.float32, device=device)
    _quantize_launch(x, y, _Seqs(x, None, None), scale=scale)
    yf = y.float().cpu()[0, :8, 0, 0]
    assert yf.tolist() == [0.0, 1.0, -3.0, 448.0, 448.0, -448.0, 448.0, -448.0]


def test_quantize_near_saturation_roundtrip(device):
    """Values whose block max is exactly the scale edge: every block max maps to +-448 exactly."""
    q, k, v = _qkv(1, 200, 200, 2, 2, 128, torch.float32, device, seed=4)
    q[0, 7, 1, 5] = 1e4  # one huge query value: its block's scale follows it
    quant = leanfa.quantize_fp8(q.to(BF16), k.to(BF16), v.to(BF16), granularity="block", smooth_k=False)
    assert quant.q.float().abs().max() == 448.0
    assert torch.isfinite(quant.q.float()).all() and torch.isfinite(quant.k.float()).all()
    out = leanfa.flash_attn_func(quant, causal=True)
    assert torch.isfinite(out).all()
    ref = attention_ref(quant, causal=True)
    assert rel_l2(out, ref) < 5e-2


# --------------------------------------------------------------------------------------------
# NaN / inf inputs (behaviour documented in README "Numerics")

S_NAN, J = 200, 150  # key/query J carries the non-finite value; rows < 64 never visit its tile


def _rows_finite_and_right(out, ref, rows):
    assert torch.isfinite(out[:, rows]).all()
    assert rel_l2(out[:, rows], ref[:, rows]) < TOL[BF16]


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_nan_in_q_row(device, dtype):
    """NaN anywhere in q[b, i, h] -> out[b, i, h] and lse[b, h, i] are NaN; nothing else changes."""
    q, k, v = _qkv(1, S_NAN, S_NAN, 2, 1, 64, dtype, device, seed=5)
    q[0, J, 1, 7] = float("nan")
    out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.isnan(out[0, J, 1]).all() and torch.isnan(lse[0, 1, J])
    clean = q.clone()
    clean[0, J, 1, 7] = 0
    ref = attention_ref(clean, k, v, causal=True)
    mask = torch.ones(S_NAN, 2, dtype=torch.bool, device=q.device)
    mask[J, 1] = False
    assert torch.isfinite(out[0][mask]).all()
    assert rel_l2(out[0][mask], ref[0][mask]) < TOL[dtype]
    assert torch.isnan(lse).sum() == 1


def test_nan_in_k(device):
    """NaN in k[b, j, hk] -> every row that sees key j (non-causal: all rows; causal: rows
    i >= j - (Sk - Sq)) has NaN output and LSE, in every query head of that KV group. Rows
    whose tiles never visit key j are exact."""
    q, k, v = _qkv(1, S_NAN, S_NAN, 2, 1, 64, BF16, device, seed=6)
    k[0, J, 0, 3] = float("nan")
    out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.isnan(out[0, J:]).all() and torch.isnan(lse[0, :, J:]).all()
    ref = attention_ref(q, k, v, causal=True)
    _rows_finite_and_right(out, ref, slice(0, 64))
    assert torch.isfinite(lse[0, :, :64]).all()


def test_nan_in_v(device):
    """NaN in v[b, j, hk, c] -> channel c of every row that sees key j is NaN (other channels
    stay right). Rows in the same query tile that do *not* see key j may get NaN in channel c
    too: masked probabilities are zeros that still multiply V (0 * NaN = NaN) -- the float64
    reference does the same on every row. Rows whose tiles never visit key j are exact."""
    q, k, v = _qkv(1, S_NAN, S_NAN, 2, 1, 64, BF16, device, seed=7)
    v[0, J, 0, 9] = float("nan")
    out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.isnan(out[0, J:, :, 9]).all()
    assert torch.isfinite(lse).all()
    other = torch.ones(64, dtype=torch.bool, device=q.device)
    other[9] = False
    clean = v.clone()
    clean[0, J, 0, 9] = 0
    ref = attention_ref(q, k, clean, causal=True)
    assert torch.isfinite(out[..., other]).all()
    assert rel_l2(out[..., other], ref[..., other]) < TOL[BF16]
    _rows_finite_and_right(out, ref, slice(0, 64))


def test_inf_in_k(device):
    """+inf in k[b, j, hk, c]: the logit of key j is q[c] * inf. Rows with q[c] > 0 get a +inf
    logit -> inf - inf in the online softmax -> NaN output and LSE (the reference would give
    a one-hot row: this is the documented divergence); rows with q[c] < 0 get -inf -> key j
    is ignored, output exact. Rows that do not see key j are exact."""
    q, k, v = _qkv(1, S_NAN, S_NAN, 1, 1, 64, BF16, device, seed=8)
    k[0, J, 0, 3] = float("inf")
    out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    sees = torch.arange(S_NAN, device=q.device) >= J
    pos = (q[0, :, 0, 3].float() > 0) & sees
    neg = (q[0, :, 0, 3].float() < 0) & sees
    assert pos.any() and neg.any()
    assert torch.isnan(out[0, pos]).all() and torch.isnan(lse[0, 0, pos]).all()
    masked_k = k.clone()
    masked_k[0, J, 0] = 0
    ref = attention_ref(q, masked_k, v, causal=True)  # valid for rows that never see key J
    _rows_finite_and_right(out, ref, slice(0, 64))
    # rows with a -inf logit for key J: the reference with key J's weight removed
    ref_neg, _ = _ref_drop_key(q, k, v, J)
    assert torch.isfinite(out[0, neg]).all()
    assert rel_l2(out[0, neg], ref_neg[0, neg]) < TOL[BF16]


def _ref_drop_key(q, k, v, j):
    """Reference with key j invisible to every row (causal)."""
    sk = k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().nan_to_num(posinf=0.0)) / math.sqrt(q.shape[-1])
    mask = torch.arange(sk)[None, :].to(q.device) > torch.arange(q.shape[1])[:, None].to(q.device)
    s = s.masked_fill(mask, -math.inf)
    s[..., j] = -math.inf
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.double())
    return out, None


def test_inf_in_v(device):
    """+inf in v[b, j, hk, c]: channel c is +inf for rows that see key j (weight > 0) and may be
    NaN for rows of the same tile that do not (0 * inf); other channels stay right."""
    q, k, v = _qkv(1, S_NAN, S_NAN, 1, 1, 64, BF16, device, seed=9)
    v[0, J, 0, 11] = float("inf")
    out = leanfa.flash_attn_func(q, k, v, causal=True)
    assert torch.isposinf(out[0, J:, 0, 11]).all()
    clean = v.clone()
    clean[0, J, 0, 11] = 0
    ref = attention_ref(q, k, clean, causal=True)
    other = torch.ones(64, dtype=torch.bool, device=q.device)
    other[11] = False
    assert rel_l2(out[..., other], ref[..., other]) < TOL[BF16]
    _rows_finite_and_right(out, ref, slice(0, 64))


@pytest.mark.skipif(INTERPRETER, reason="Triton's CPU interpreter converts NaN to e4m3 as 384 (a GPU keeps NaN)")
@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["block", "tensor"])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_quantize_fp8_keeps_nan(granularity, tensor):
    """A NaN input element stays NaN through quantize_fp8 (it used to clamp to +-448: a silent
    wrong answer), and the attention rows that use it are NaN, not finite garbage."""
    q, k, v = _qkv(1, S_NAN, S_NAN, 2, 2, 128, BF16, "cuda", seed=10)
    {"q": q, "k": k, "v": v}[tensor][0, J, 0, 5] = float("nan")
    quant = leanfa.quantize_fp8(q, k, v, granularity=granularity, smooth_k=False)
    x8 = getattr(quant, tensor)
    assert torch.isnan(x8[0, J, 0, 5].float())
    out = leanfa.flash_attn_func(quant, causal=True)
    row = J if tensor == "q" else S_NAN - 1
    assert torch.isnan(out[0, row, 0]).any()


def test_quantize_fp8_inf_poisons_not_silently(device):
    """+inf in K with per-block scales: the block's descale is inf, so every row that sees a key
    of that 128-token block (per head) gets NaN -- loud, not a silent wrong answer."""
    q, k, v = _qkv(1, S_NAN, S_NAN, 1, 1, 128, BF16, device, seed=11)
    k[0, J, 0, 5] = float("inf")
    quant = leanfa.quantize_fp8(q, k, v, granularity="block", smooth_k=False)
    assert torch.isinf(quant.k_descale[0, 0, J // 128])
    out = leanfa.flash_attn_func(quant, causal=True)
    if not INTERPRETER:  # the interpreter turns the NaN (inf / inf) of k8 into 384 when converting
        assert torch.isnan(out[0, 128:]).all()  # rows >= 128 see keys of block 1 (128..199)
    assert torch.isfinite(out[0, :64]).all()


# --------------------------------------------------------------------------------------------
# outliers and attention sinks


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_k_massive_outlier_channel(device, precision):
    """One K channel ~300x the others (and a per-channel bias): K smoothing removes the common
    part; what remains must still fit the e4m3 range without flushing the other channels."""
    q, k, v = _qkv(1, 130, 130, 2, 1, 128, torch.float32, device, seed=12)
    k[..., 17] += 300.0 + 3.0 * torch.randn(k.shape[:-1], generator=torch.Generator().manual_seed(1)).to(device)
    q = q * 0.05  # keep the logits sane: q[17] * k[17] ~ 15 * N(0,1) after scaling
    q, k, v = q.to(BF16), k.to(BF16), v.to(BF16)
    ref = attention_ref(q, k, v, causal=True)
    out = leanfa.attention(q, k, v, causal=True, precision=precision)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < (TOL[BF16] if precision == "bf16" else TOL[FP8])


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_attention_sink(device, precision):
    """Token 0 is an attention sink: its key aligns with every query (logit ~ +8 above the rest),
    so most rows put > 90% of their weight on it, and its V is large."""
    q, k, v = _qkv(1, 160, 160, 2, 1, 128, torch.float32, device, seed=13)
    direction = torch.ones(128, device=device) / math.sqrt(128)
    q = q + 3.0 * direction
    k[0, 0, 0] = direction * 40.0
    v[0, 0, 0] = v[0, 0, 0] * 20.0
    q, k, v = q.to(BF16), k.to(BF16), v.to(BF16)
    ref = attention_ref(q, k, v, causal=True)
    out = leanfa.attention(q, k, v, causal=True, precision=precision)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < (TOL[BF16] if precision == "bf16" else TOL[FP8])


# --------------------------------------------------------------------------------------------
# GPU: long sequences (32-bit index overflow)


def _backends(q, k, v, causal=True):
    from leanfa.api import _build_problem
    from leanfa.kernels import dispatch

    names = ["portable"]
    kw = dict(varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
              softmax_scale=None, causal=causal, q_descale=None, k_descale=None, v_descale=None,
              k_mean=None, return_lse=True, out_dtype=None)
    if dispatch.hopper_applies(_build_problem(q, k, v, **kw))[0]:
        names.append("hopper")
    return names


def _check_rows(out, lse, q, k, v, rows, heads, tol, lse_tol, causal=True, ref_inputs=None):
    rq, rk, rv = ref_inputs or (q, k, v)
    ref, ref_lse = reference_rows(rq, rk, rv, rows, heads=heads, causal=causal)
    got = out[0][torch.as_tensor(rows, device=out.device)][:, heads]
    assert torch.isfinite(got).all(), "NaN/inf in checked rows (unwritten or overflowed index)"
    assert rel_l2(got, ref) < tol
    got_lse = lse[0][heads][:, torch.as_tensor(rows, device=out.device)]
    assert (got_lse.double() - ref_lse).abs().max() < lse_tol


LONG_ROWS = [0, 1, 127, 128, 4095, 65535, 65536, 99_999, 131_070, 131_071]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_long_sequence_131k(precision):
    """B=1, 131072 tokens, 1 head, d128, causal: rows near 2^16 and the end of the sequence
    against a float64 reference of those rows only."""
    torch.manual_seed(0)
    s = 131072
    q, k, v = (torch.randn(1, s, 1, 128, device="cuda").to(BF16) for _ in range(3))
    for backend in _backends(q, k, v):
        if precision == "fp8":
            quant = leanfa.quantize_fp8(q, k, v)
            out, lse = leanfa.flash_attn_func(quant, causal=True, return_lse=True, backend=backend)
            tol, lse_tol = TOL[FP8], 0.3
        else:
            out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True, backend=backend)
            tol, lse_tol = TOL[BF16], 1e-2
        assert torch.isfinite(out).all(), backend
        _check_rows(out, lse, q, k, v, LONG_ROWS, [0], tol, lse_tol)


@pytest.mark.gpu
def test_more_than_2_31_elements():
    """q and out hold B*S*H*D = 133_001 * 128 * 128 > 2^31 elements (4.4 GB each in bf16):
    element offsets only fit 64-bit. Check the last heads and rows (largest offsets)."""
    s, hq, hkv, d = 133_001, 128, 8, 128
    assert s * hq * d > 2**31
    free = torch.cuda.mem_get_info()[0]
    if free < 20 * 2**30:
        pytest.skip("needs ~20 GB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, s, hq, d, device="cuda", generator=g, dtype=BF16)
    k = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=BF16)
    v = torch.randn(1, s, hkv, d, device="cuda", generator=g, dtype=BF16)
    rows = [0, 1, 65_536, 131_072, s - 2, s - 1]
    heads = [0, 63, 64, 120, 127]
    for backend in _backends(q, k, v):
        out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True, backend=backend)
        _check_rows(out, lse, q, k, v, rows, heads, TOL[BF16], 1e-2)
        assert not torch.isnan(out[0, -1]).any()
        del out, lse
    quant = leanfa.quantize_fp8(q, k, v)
    assert torch.isfinite(quant.q[0, -1].float()).all()
    out, lse = leanfa.flash_attn_func(quant, causal=True, return_lse=True, backend="portable")
    _check_rows(out, lse, q, k, v, rows, heads, TOL[FP8], 0.3)
