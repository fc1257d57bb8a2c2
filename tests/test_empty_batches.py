"""Empty batches, as FlashAttention-3 accepts them: packed batches whose sequences are all empty
(``max_seqlen_q = max_seqlen_k = 0``), query sequences with no key at all (``max_seqlen_k = 0``),
and dense tensors with ``B``, ``Sq`` or ``Sk`` 0. Outputs have the call's shapes; rows without a
key are exactly 0 with LSE ``-inf`` (outputs are poisoned with NaN before each launch: conftest,
so a row left unwritten fails). Inputs are fresh random draws.
"""

import pytest
import torch

import leanfa
from leanfa import flash_attn_interface as fa3
from leanfa.compat import flash_attn as fa2
from leanfa.reference import attention_ref

from helpers import cu_seqlens

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _rand(shape, device, dtype=BF16):
    return torch.randn(shape).to(dtype).to(device)


def _no_key_rows(out, lse):
    assert not torch.isnan(out).any() and (out == 0).all()
    assert lse.numel() == 0 or torch.isneginf(lse).all()


@pytest.mark.parametrize("batch", [1, 3])
def test_varlen_all_sequences_empty(device, batch):
    """FA3's test_flash_attn_varlen_output case that leanfa refused: every sequence empty, max_seqlen 0."""
    q, k, v = (_rand((0, h, 128), device) for h in (4, 2, 2))
    cu = cu_seqlens([0] * batch, device)
    out, lse = leanfa.flash_attn_varlen_func(q, k, v, cu, cu, 0, 0, causal=True, return_lse=True)
    assert out.shape == (0, 4, 128) and out.dtype == BF16 and lse.shape == (4, 0) and lse.dtype == torch.float32
    out3, lse3 = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 0, 0, causal=True, return_attn_probs=True)
    assert out3.shape == (0, 4, 128) and lse3.shape == (4, 0)
    out2, lse2, probs = fa2.flash_attn_varlen_func(q, k, v, cu, cu, 0, 0, return_attn_probs=True)
    assert out2.shape == (0, 4, 128) and lse2.shape == (4, 0) and probs.numel() == 0


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_queries_without_any_key(device, precision, causal):
    """max_seqlen_k = 0: every query row sees no key -> 0 and -inf (also through the quantizer)."""
    lens_q = [3, 0, 40]
    q = _rand((sum(lens_q), 4, 64), device)
    k = v = _rand((0, 2, 64), device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens([0, 0, 0], device)
    out, lse = leanfa.attention(q, k, v, causal=causal, precision=precision, return_lse=True, cu_seqlens_q=cu_q,
                                cu_seqlens_k=cu_k, max_seqlen_q=40, max_seqlen_k=0)
    assert out.shape == (43, 4, 64) and lse.shape == (4, 43)
    _no_key_rows(out, lse)


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_dense_without_keys(device, dtype):
    """Dense Sk = 0: output 0, LSE -inf, in the call's shapes (FP8: with per-head descales)."""
    q = _rand((2, 37, 4, 64), device, dtype)
    k = v = _rand((2, 0, 2, 64), device, dtype)
    kw = {} if dtype == BF16 else {n: torch.ones(2, 2, device=device) for n in ("q_descale", "k_descale", "v_descale")}
    out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True, **kw)
    assert out.shape == (2, 37, 4, 64) and out.dtype == BF16 and lse.shape == (2, 4, 37)
    _no_key_rows(out, lse)
    ref, ref_lse = attention_ref(q, k, v, causal=True, return_lse=True, **kw)
    assert torch.equal(out.double(), ref) and torch.equal(lse.double(), ref_lse)


@pytest.mark.parametrize("shape_q,shape_k", [((2, 0, 4, 64), (2, 30, 2, 64)), ((0, 30, 4, 64), (0, 30, 2, 64)),
                                             ((0, 0, 4, 64), (0, 0, 2, 64))], ids=["Sq=0", "B=0", "B=Sq=Sk=0"])
def test_dense_empty_shapes(device, shape_q, shape_k):
    q, k = _rand(shape_q, device), _rand(shape_k, device)
    v = _rand(shape_k[:-1] + (64,), device)
    out, lse = leanfa.flash_attn_func(q, k, v, return_lse=True)
    b, sq, hq, _ = shape_q
    assert out.shape == (b, sq, hq, 64) and lse.shape == (b, hq, sq)
    out2, lse2, _ = fa2.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out2.shape == out.shape and lse2.shape == lse.shape


def test_empty_sequences_among_full_ones_match_reference(device):
    """An all-empty sequence next to real ones: the real ones are unaffected (float64 reference)."""
    lens_q, lens_k = [0, 21, 0], [0, 35, 0]
    q, k, v = (_rand((sum(n), h, 64), device) for n, h in ((lens_q, 2), (lens_k, 1), (lens_k, 1)))
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    out = leanfa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 21, 35, causal=True)
    ref = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1.5e-2
