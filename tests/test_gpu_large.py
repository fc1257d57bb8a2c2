"""GPU-only: realistic shapes up to 32K tokens against the float64 reference (on the GPU)."""

import pytest
import torch

import leanfa
from leanfa.reference import attention_ref

from helpers import TOL, cu_seqlens, rel_l2

pytestmark = pytest.mark.gpu


def _inputs(b, s, hq, hkv, dqk, dv, seed=0):
    from leanfa.activations import make_qkv

    if (dqk, dv) == (192, 128):
        return make_qkv("deepseek-v3-mla", b, s, heads=hq, kv_heads=hkv, seed=seed, device="cuda")
    return make_qkv("llama3-8b", b, s, heads=hq, kv_heads=hkv, seed=seed, device="cuda")


def _ref_subset(q, k, v, causal):
    """float64 reference for the query heads of the first KV head only (keeps 32K checks fast)."""
    group = q.shape[2] // k.shape[2]
    return attention_ref(q[:, :, :group], k[:, :, :1], v[:, :, :1], causal=causal)


@pytest.mark.parametrize("s,hq,hkv,dims", [
    (4096, 32, 8, (128, 128)),
    (16384, 8, 2, (128, 128)),
    (32768, 4, 1, (128, 128)),
    (8192, 16, 16, (192, 128)),
])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_long_causal(s, hq, hkv, dims, precision):
    q, k, v = _inputs(1, s, hq, hkv, *dims)
    out = leanfa.attention(q, k, v, causal=True, precision=precision)
    group = hq // hkv
    ref = _ref_subset(q, k, v, True)
    err = rel_l2(out[:, :, :group], ref)
    tol = TOL[torch.bfloat16] if precision == "bf16" else 0.25
    assert err < tol, err


def test_gaussian_fp8_16k_noncausal():
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 16384, 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    out = leanfa.attention(q, k, v, causal=False, precision="fp8")
    assert rel_l2(out, attention_ref(q, k, v)) < TOL[torch.float8_e4m3fn]


def test_varlen_long_uneven():
    lens = [1, 777, 4096, 130, 9000]
    cu = cu_seqlens(lens, "cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(sum(lens), 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(sum(lens), 2, 128, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens), 2, 128, device="cuda", generator=g).to(torch.bfloat16)
    for precision, tol in (("bf16", TOL[torch.bfloat16]), ("fp8", TOL[torch.float8_e4m3fn])):
        out = leanfa.attention(q, k, v, causal=True, precision=precision, cu_seqlens_q=cu, cu_seqlens_k=cu,
                               max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        ref = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        assert rel_l2(out, ref) < tol


def test_deterministic():
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 3000, 8, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    for precision in ("bf16", "fp8"):
        a = leanfa.attention(q, k, v, causal=True, precision=precision)
        b = leanfa.attention(q, k, v, causal=True, precision=precision)
        assert torch.equal(a, b)
