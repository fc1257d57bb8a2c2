"""The mixed-precision mode, ``attention(precision="fp8qk")`` (issue 24 item 5): Q·K in FP8 with the FP8 path's
scales and K smoothing, P and V in 16 bits for P·V.

What it must show: Q and K are quantized bit for bit as ``precision="fp8"`` quantizes them, V is left alone, and
on diffuse attention (where the e4m3 rounding of V dominates the FP8 error) the mixed mode's error against the
float64 reference is far below the FP8 mode's -- a V still rounded to e4m3 fails these tests. CPU runs use the
portable kernel under Triton's interpreter; the Hopper kernel's mixed path is checked on the CPU by its emulator
(tests/test_hopper_emulate.py) and on the H200 by the ``gpu`` tests here.
"""

from __future__ import annotations

import pytest
import torch

import leanfa
from leanfa import api
from leanfa.activations import make_qkv
from leanfa.reference import attention_ref
from helpers import cu_seqlens, rel_l2


def _diffuse(b, s, hq, hkv, dqk, dv, seed, device, sk=None):
    """Near-uniform attention: small queries (scores within ~0.1 of each other), so every output row averages
    many values and the relative error of e4m3 V (~2^-4/sqrt(3) per element) does not shrink with length."""
    g = torch.Generator().manual_seed(seed)
    sk = s if sk is None else sk
    q = torch.randn(b, s, hq, dqk, generator=g) * 0.05
    k = torch.randn(b, sk, hkv, dqk, generator=g) + 0.5  # a per-channel offset: K smoothing has work to do
    v = torch.randn(b, sk, hkv, dv, generator=g)
    return (t.to(torch.bfloat16).to(device) for t in (q, k, v))


def _errors(q, k, v, causal, **kw):
    """Relative L2 errors of fp8, fp8qk and bf16 against the float64 reference of the 16-bit inputs."""
    ref = attention_ref(q, k, v, causal=causal, cu_seqlens_q=kw.get("cu_seqlens_q"),
                        cu_seqlens_k=kw.get("cu_seqlens_k"))
    return {prec: rel_l2(leanfa.attention(q, k, v, causal=causal, precision=prec, **kw), ref)
            for prec in ("fp8", "fp8qk", "bf16")}


@pytest.mark.parametrize("dims,hq,hkv,causal", [
    ((128, 128), 4, 2, True),   # GQA
    ((128, 128), 2, 2, False),
    ((192, 128), 2, 1, True),   # MLA
    ((64, 64), 2, 1, False),
])
def test_mixed_below_fp8_on_diffuse_attention(dims, hq, hkv, causal, device):
    q, k, v = _diffuse(1, 192, hq, hkv, *dims, seed=sum(dims) + hq, device=device)
    err = _errors(q, k, v, causal)
    # FP8 sits near its V-rounding floor (~2^-4/sqrt(3) = 3.6e-2); the mixed mode near BF16's error
    assert err["fp8"] > 2e-2, err
    assert err["fp8qk"] < 0.35 * err["fp8"], err
    assert err["fp8qk"] < 2.0 * err["bf16"] + 2e-3, err


@pytest.mark.parametrize("causal", [True, False])
def test_mixed_varlen(causal, device):
    lens_q, lens_k = [70, 0, 150, 33], [90, 5, 150, 200]
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(sum(lens_q), 4, 128, generator=g) * 0.05).to(torch.bfloat16).to(device)
    k = (torch.randn(sum(lens_k), 2, 128, generator=g) + 0.5).to(torch.bfloat16).to(device)
    v = torch.randn(sum(lens_k), 2, 128, generator=g).to(torch.bfloat16).to(device)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    err = _errors(q, k, v, causal, **kw)
    assert err["fp8qk"] < 0.35 * err["fp8"], err
    assert err["fp8qk"] < 2.0 * err["bf16"] + 2e-3, err


def test_mixed_lse_and_k_smoothing(device):
    """Against the float64 reference of the *quantized* Q and K (dequantized, K's mean added back) and the 16-bit
    V, the mixed mode's output has a 16-bit kernel's error and its LSE is exact: K smoothing's mean is added
    back, as in the FP8 mode (model-like inputs: a sink key, K with a bias, outlier channels)."""
    q, k, v = make_qkv("llama3-8b", 1, 256, heads=4, seed=3)
    q, k, v = q.to(device), k.to(device), v.to(device)
    out, lse = leanfa.attention(q, k, v, causal=True, precision="fp8qk", return_lse=True)
    quant = leanfa.quantize_fp8(q, k, v, quantize_v=False)
    assert quant.k_mean is not None
    ref, ref_lse = attention_ref(quant.q, quant.k, v, causal=True, return_lse=True, q_descale=quant.q_descale,
                                 k_descale=quant.k_descale, k_mean=quant.k_mean)
    assert out.dtype == q.dtype
    assert rel_l2(out, ref) < 1e-2
    # (the FP8 mode's LSE bound on the Hopper kernel, tests/test_hopper.py: its K-mean term is computed in the
    # kernel from the e4m3 Q; H200 run 88 measured 1.19e-2 here)
    assert float((lse.double() - ref_lse).abs().max()) < 2e-2
    out8, lse8 = leanfa.attention(q, k, v, causal=True, precision="fp8", return_lse=True)
    assert float((lse - lse8).abs().max()) < 2e-2  # the same scores; P's rounding moves the row sums a little
    assert rel_l2(out, ref) < 0.5 * rel_l2(out8, ref)


@pytest.mark.parametrize("granularity", ["block", "head"])
@pytest.mark.parametrize("varlen", [False, True])
def test_quantize_v_false_keeps_qk_and_v(granularity, varlen, device):
    """``quantize_fp8(quantize_v=False)``: Q, K, their descales and K's mean bit for bit those of the full
    quantizer; ``v`` the caller's tensor itself, no V descale."""
    q, k, v = make_qkv("qwen2.5-7b", 1, 300, heads=4, seed=1)
    kw = {}
    if varlen:
        q, k, v = q[0], k[0], v[0]
        cu = cu_seqlens([120, 180])
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=180, max_seqlen_k=180)
        kw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    q, k, v = q.to(device), k.to(device), v.to(device)
    full = leanfa.quantize_fp8(q, k, v, granularity, **kw)
    mixed = leanfa.quantize_fp8(q, k, v, granularity, quantize_v=False, **kw)
    assert mixed.v is v and mixed.v_descale is None
    for name in ("q", "k"):
        assert torch.equal(getattr(mixed, name).view(torch.uint8), getattr(full, name).view(torch.uint8)), name
    for name in ("q_descale", "k_descale", "k_mean"):
        assert torch.equal(getattr(mixed, name), getattr(full, name)), name


def test_flash_attn_func_takes_mixed_inputs(device):
    """The lower-level API: FP8 q/k with a 16-bit v (an FP8QKV from quantize_v=False, or the tensors) is the
    mixed mode, the same bits as ``attention(precision="fp8qk")``; the output dtype follows V."""
    q, k, v = (t.to(device) for t in _diffuse(1, 130, 2, 1, 128, 128, seed=5, device="cpu"))
    quant = leanfa.quantize_fp8(q, k, v, quantize_v=False)
    out = leanfa.flash_attn_func(quant, causal=True)
    assert torch.equal(out, leanfa.attention(q, k, v, causal=True, precision="fp8qk"))
    out2 = leanfa.flash_attn_func(quant.q, quant.k, v, causal=True, q_descale=quant.q_descale,
                                  k_descale=quant.k_descale, k_mean=quant.k_mean)
    assert torch.equal(out, out2)
    v16 = v.to(torch.float16)
    assert leanfa.flash_attn_func(quant.q, quant.k, v16, q_descale=quant.q_descale,
                                  k_descale=quant.k_descale).dtype == torch.float16


def test_mixed_window_and_softcap(device):
    """Sliding windows and softcap in the mixed mode too (on sm90 the Hopper kernel, else the portable one)."""
    q, k, v = _diffuse(1, 160, 2, 1, 128, 128, seed=11, device=device)
    out = leanfa.attention(q, k, v, causal=True, precision="fp8qk", window_size=(40, 0), softcap=2.0)
    ref = attention_ref(q, k, v, causal=True, window_size=(40, 0), softcap=2.0)
    ref8 = leanfa.attention(q, k, v, causal=True, precision="fp8", window_size=(40, 0), softcap=2.0)
    assert rel_l2(out, ref) < 0.5 * rel_l2(ref8, ref)


def test_mixed_bad_input(device):
    q, k, v = _diffuse(1, 64, 2, 1, 128, 128, seed=2, device=device)
    with pytest.raises(TypeError, match="bf16/fp16"):
        leanfa.attention(q.float(), k.float(), v.float(), precision="fp8qk")
    with pytest.raises(ValueError, match="precision must be one of"):
        leanfa.attention(q, k, v, precision="fp8-qk")
    with pytest.raises(ValueError, match="bf16_sink_keys"):
        leanfa.attention(q, k, v, precision="fp8qk", bf16_sink_keys=128)
    with pytest.raises(TypeError, match="quantize_v=False"):
        leanfa.quantize_fp8(q, k, v.float(), quantize_v=False)
    quant = leanfa.quantize_fp8(q, k, v, quantize_v=False)
    with pytest.raises(ValueError, match="v_descale"):
        leanfa.flash_attn_func(quant.q, quant.k, v, v_descale=torch.ones(1, device=device))
    with pytest.raises(TypeError, match="share one dtype"):
        leanfa.flash_attn_func(quant.q, k, v)  # FP8 q with a 16-bit k
    with pytest.raises(TypeError, match="share one dtype"):
        leanfa.flash_attn_func(q, quant.k, v)


def test_quantize_op_without_v(device):
    """The ``leanfa::quantize_fp8`` op with ``quantize_v=False``: schema and fake shapes (its V outputs are empty:
    an op's output may not alias its input, the wrapper puts the caller's V back)."""
    from leanfa import ops  # noqa: F401 (registers torch.ops.leanfa.*: a test process may not have imported it yet)

    q, k, v = _diffuse(1, 20, 2, 1, 64, 64, seed=0, device=device)
    torch.library.opcheck(torch.ops.leanfa.quantize_fp8.default,
                          (q, k, v, "block", True, None, None, None, None, False),
                          test_utils=("test_schema", "test_faketensor"))

    class _Mode(torch.overrides.TorchFunctionMode):  # not a plain eager call: ops.quantize_fp8 takes the op
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Mode():
        qq = ops.quantize_fp8(q, k, v, quantize_v=False)
    assert qq.v is v and qq.v_descale is None
    assert torch.equal(qq.q.view(torch.uint8), leanfa.quantize_fp8(q, k, v).q.view(torch.uint8))


def test_mixed_problem_properties(device):
    q, k, v = _diffuse(1, 32, 2, 1, 64, 64, seed=0, device=device)
    quant = leanfa.quantize_fp8(q, k, v, quantize_v=False)
    p = api._build_problem(quant.q, quant.k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=True,
                           q_descale=quant.q_descale, k_descale=quant.k_descale, v_descale=None,
                           k_mean=quant.k_mean, return_lse=False, out_dtype=None)
    assert p.is_fp8 and p.is_mixed and not p.pv_fp8 and p.out_dtype == torch.bfloat16


# ----------------------------------------------------------------------------- H200 (the lead runs these)

def _hopper_choice(q, k, v, causal, **kw):
    from leanfa.kernels import dispatch

    quant = leanfa.quantize_fp8(q, k, v, quantize_v=False, **kw)
    varlen = bool(kw)
    p = api._build_problem(quant.q, quant.k, quant.v, varlen=varlen, cu_seqlens_q=kw.get("cu_seqlens_q"),
                           cu_seqlens_k=kw.get("cu_seqlens_k"), max_seqlen_q=kw.get("max_seqlen_q"),
                           max_seqlen_k=kw.get("max_seqlen_k"), softmax_scale=None, causal=causal,
                           q_descale=quant.q_descale, k_descale=quant.k_descale, v_descale=None,
                           k_mean=quant.k_mean, return_lse=True, out_dtype=None)
    return dispatch.choose(p, "auto"), p


@pytest.mark.gpu
@pytest.mark.parametrize("dims,hq,hkv", [((128, 128), 8, 2), ((192, 128), 4, 4), ((64, 64), 4, 1),
                                         ((256, 256), 2, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("s", [1000, 4096])
def test_gpu_hopper_mixed_dense(dims, hq, hkv, causal, s):
    """On sm90 ``backend="auto"`` runs the mixed mode on the Hopper kernel; its error is below 0.35x the FP8
    mode's on diffuse attention and within 2x BF16's, and it agrees with the portable kernel's mixed mode."""
    q, k, v = _diffuse(2, s, hq, hkv, *dims, seed=s + dims[0], device="cuda")
    choice, p = _hopper_choice(q, k, v, causal)
    assert choice.kernel == "hopper", choice.why
    err = _errors(q, k, v, causal)
    assert err["fp8qk"] < 0.35 * err["fp8"], err
    assert err["fp8qk"] < 2.0 * err["bf16"] + 2e-3, err
    out_h, lse_h = leanfa.attention(q, k, v, causal=causal, precision="fp8qk", return_lse=True, backend="hopper")
    out_p, lse_p = leanfa.attention(q, k, v, causal=causal, precision="fp8qk", return_lse=True, backend="portable")
    assert rel_l2(out_h, out_p) < 1e-2
    assert float((lse_h - lse_p).abs().max()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["llama3-8b", "qwen2.5-7b", "deepseek-v3-mla", "llama3-8b-heads"])
def test_gpu_hopper_mixed_presets(preset):
    """Model-like activations at 4K: the mixed mode's error no larger than the FP8 mode's (the issue's target is
    <= 0.5x the FP8 default's logits error, measured by the lead end to end)."""
    q, k, v = make_qkv(preset, 1, 4096, heads=16, seed=0, device="cuda")
    err = _errors(q, k, v, True)
    assert err["fp8qk"] < err["fp8"], err


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_hopper_mixed_varlen(causal):
    lens = [1, 300, 4000, 77, 1024]
    cu = cu_seqlens(lens, "cuda")
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(sum(lens), 8, 128, generator=g) * 0.05).to(torch.bfloat16).cuda()
    k = (torch.randn(sum(lens), 2, 128, generator=g) + 0.5).to(torch.bfloat16).cuda()
    v = torch.randn(sum(lens), 2, 128, generator=g).to(torch.bfloat16).cuda()
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    choice, _ = _hopper_choice(q, k, v, causal, **kw)
    assert choice.kernel == "hopper", choice.why
    err = _errors(q, k, v, causal, **kw)
    assert err["fp8qk"] < 0.35 * err["fp8"], err
    out_h = leanfa.attention(q, k, v, causal=causal, precision="fp8qk", backend="hopper", **kw)
    out_p = leanfa.attention(q, k, v, causal=causal, precision="fp8qk", backend="portable", **kw)
    assert rel_l2(out_h, out_p) < 1e-2
