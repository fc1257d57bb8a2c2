"""flash-attn 2 (leanfa.compat.flash_attn) and FA3 (leanfa.flash_attn_interface) drop-ins:
supported calls match leanfa's own API bit for bit; unsupported options raise
NotImplementedError naming the option, before any launch."""

import pytest
import torch

import leanfa
from leanfa import flash_attn_interface as fa3
from leanfa.compat import flash_attn as fa2

BF16 = torch.bfloat16


def _qkv(device, s=16):
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn((1, s, h, 64), generator=g).to(BF16).to(device)  # noqa: E731
    return mk(4), mk(2), mk(2)


# CPU tensors without TRITON_INTERPRET would be rejected later; these must fail first.
Q, K, V = (torch.zeros(1, 8, h, 64, dtype=BF16) for h in (4, 2, 2))
CU = torch.tensor([0, 8], dtype=torch.int32)

UNSUPPORTED = [  # (id, call, option named in the message)
    ("fa2 dropout", lambda: fa2.flash_attn_func(Q, K, V, dropout_p=0.1), "dropout_p"),
    ("fa2 alibi", lambda: fa2.flash_attn_func(Q, K, V, alibi_slopes=torch.ones(4)), "alibi_slopes"),
    ("fa2 attn probs with dropout", lambda: fa2.flash_attn_func(Q, K, V, dropout_p=0.1, return_attn_probs=True),
     "dropout_p"),
    ("fa2 qkvpacked dropout", lambda: fa2.flash_attn_qkvpacked_func(torch.stack([Q, Q, Q], 2), dropout_p=0.1),
     "dropout_p"),
    ("fa2 kvpacked dropout", lambda: fa2.flash_attn_kvpacked_func(Q, torch.stack([K, V], 2), dropout_p=0.1),
     "dropout_p"),
    ("fa2 varlen qkvpacked alibi", lambda: fa2.flash_attn_varlen_qkvpacked_func(torch.stack([Q[0]] * 3, 1), CU, 8,
                                                                               alibi_slopes=torch.ones(4)),
     "alibi_slopes"),
    ("fa2 varlen kvpacked alibi", lambda: fa2.flash_attn_varlen_kvpacked_func(Q[0], torch.stack([K[0], V[0]], 1), CU, CU,
                                                                             8, 8, alibi_slopes=torch.ones(4)),
     "alibi_slopes"),
    ("fa2 varlen dropout", lambda: fa2.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, 8, dropout_p=0.5), "dropout_p"),
    ("fa2 kvcache append", lambda: fa2.flash_attn_with_kvcache(Q, K, V, k=K, v=V), "appending"),
    ("fa2 kvcache rotary", lambda: fa2.flash_attn_with_kvcache(Q, K, V, rotary_cos=CU, rotary_sin=CU), "rotary"),
    ("fa3 varlen q, dense k", lambda: fa3.flash_attn_varlen_func(Q[0], K, V, CU, None, 8, 8,
                                                                 seqused_k=CU[1:]), "cu_seqlens_q/cu_seqlens_k"),
    ("fa3 kvcache append", lambda: fa3.flash_attn_with_kvcache(Q, K, V, k=K, v=V), "appending"),
    ("fa3 kvcache rotary", lambda: fa3.flash_attn_with_kvcache(Q, K, V, rotary_cos=CU, rotary_sin=CU), "rotary"),
    ("fa3 kvcache batch idx", lambda: fa3.flash_attn_with_kvcache(Q, K, V, cache_batch_idx=CU), "cache_batch_idx"),
]


@pytest.mark.parametrize("call,option", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_option_raises(call, option):
    with pytest.raises(NotImplementedError, match=option):
        call()


def test_bad_input_still_validated(device):
    """The drop-ins keep leanfa's argument checks (here: unsupported head dims; FA3 pads nothing, flash-attn 2
    pads to a multiple of 8 and refuses past 256)."""
    q = torch.zeros(1, 8, 4, 100, dtype=BF16, device=device)
    with pytest.raises(ValueError, match="head dims"):
        fa3.flash_attn_func(q, q[:, :, :2], q[:, :, :2])
    q = torch.zeros(1, 8, 4, 260, dtype=BF16, device=device)
    with pytest.raises(ValueError, match="head dims"):
        fa2.flash_attn_func(q, q[:, :, :2], q[:, :, :2])


def test_fa2_and_fa3_match_leanfa(device):
    q, k, v = _qkv(device)
    ref, ref_lse = leanfa.flash_attn_func(q, k, v, causal=True, softmax_scale=0.1, return_lse=True)
    out2 = fa2.flash_attn_func(q, k, v, causal=True, softmax_scale=0.1, deterministic=True)
    out3, lse3 = fa3.flash_attn_func(q, k, v, causal=True, softmax_scale=0.1, num_splits=1, pack_gqa=True,
                                     return_attn_probs=True)
    assert torch.equal(out2, ref) and torch.equal(out3, ref) and torch.equal(lse3, ref_lse)
    assert isinstance(fa3.flash_attn_func(q, k, v, causal=True), torch.Tensor)  # plain out by default


def test_varlen_and_fp8_descales_match_leanfa(device):
    q, k, v = _qkv(device, s=20)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    ref = leanfa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 13, 13, causal=True)
    assert torch.equal(fa2.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 13, 13, causal=True), ref)
    out3, lse3 = fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 13, 13, causal=True, return_attn_probs=True)
    assert torch.equal(out3, ref) and lse3.shape == (4, 20)
    # FA3's FP8 convention: float8_e4m3fn inputs with (B, Hkv) float32 descales
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    d = torch.full((1, 2), 0.5, device=device)
    got = fa3.flash_attn_func(q8, k8, v8, causal=True, q_descale=d, k_descale=d, v_descale=d)
    want = leanfa.flash_attn_func(q8, k8, v8, causal=True, q_descale=d, k_descale=d, v_descale=d)
    assert got.dtype == BF16 and torch.equal(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_fa2_packed_forms_equal_unpacked(device, causal):
    """flash-attn 2's packed functions: views of the packed tensor, the same bits as the unpacked call
    (against a contiguous copy of each part), and within bf16 tolerance of float64."""
    from leanfa.reference import attention_ref

    from helpers import TOL, cu_seqlens, rel_l2

    g = torch.Generator().manual_seed(1)
    qkv = torch.randn((2, 45, 3, 4, 64), generator=g).to(BF16).to(device)
    q, k, v = (qkv[:, :, i].contiguous() for i in range(3))
    want = fa2.flash_attn_func(q, k, v, causal=causal, softmax_scale=0.2)
    assert torch.equal(fa2.flash_attn_qkvpacked_func(qkv, causal=causal, softmax_scale=0.2), want)
    assert rel_l2(want, attention_ref(q, k, v, causal=causal, softmax_scale=0.2)) < TOL[BF16]
    kv = torch.randn((2, 70, 2, 2, 64), generator=g).to(BF16).to(device)  # GQA: 2 KV heads
    k2, v2 = kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()
    assert torch.equal(fa2.flash_attn_kvpacked_func(q, kv, causal=causal),
                       fa2.flash_attn_func(q, k2, v2, causal=causal))
    # varlen: (total, 3, H, D) with one cu_seqlens; (total_k, 2, Hkv, D)
    lens, lens_k = [17, 0, 28], [30, 5, 35]
    cu, cu_k = cu_seqlens(lens, device), cu_seqlens(lens_k, device)
    qkv_p = torch.randn((sum(lens), 3, 4, 64), generator=g).to(BF16).to(device)
    qp, kp, vp = (qkv_p[:, i].contiguous() for i in range(3))
    want = fa2.flash_attn_varlen_func(qp, kp, vp, cu, cu, 28, 28, causal=causal)
    assert torch.equal(fa2.flash_attn_varlen_qkvpacked_func(qkv_p, cu, 28, causal=causal), want)
    kv_p = torch.randn((sum(lens_k), 2, 2, 64), generator=g).to(BF16).to(device)
    want = fa2.flash_attn_varlen_func(qp, kv_p[:, 0].contiguous(), kv_p[:, 1].contiguous(), cu, cu_k, 28, 35,
                                      causal=causal)
    assert torch.equal(fa2.flash_attn_varlen_kvpacked_func(qp, kv_p, cu, cu_k, 28, 35, causal=causal), want)
    ref = attention_ref(qp, kv_p[:, 0], kv_p[:, 1], causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu_k)
    assert rel_l2(want, ref) < TOL[BF16]


@pytest.mark.parametrize("name,args", [
    ("qkvpacked", lambda q, k, v: (torch.stack([q, q, q], 3),)),  # (B, S, H, 3, D): the packed axis misplaced
    ("kvpacked", lambda q, k, v: (q, torch.stack([k, v, v], 2))),  # three parts, not two
])
def test_fa2_packed_shape_checked(name, args):
    with pytest.raises(ValueError, match="must have shape"):
        getattr(fa2, f"flash_attn_{name}_func")(*args(Q, K, V))


def test_fa2_return_attn_probs_shapes(device):
    """flash-attn 2 with return_attn_probs and no dropout returns (out, softmax_lse, S_dmask): the LSE
    (B, Hq, Sq) float32 (varlen (Hq, total_q)) and S_dmask an empty (0,) tensor of q's dtype (flash-attn
    2 materializes the probabilities only with dropout); out and LSE equal leanfa's."""
    q, k, v = _qkv(device, s=24)
    ref, ref_lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    res = fa2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out, lse, probs = res
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and lse.shape == (1, 4, 24)
    assert lse.dtype == torch.float32 and probs.shape == (0,) and probs.dtype == BF16 and probs.device == q.device
    qkv = torch.stack([q[:, :, :2], k, v], 2)
    assert [t.shape for t in fa2.flash_attn_qkvpacked_func(qkv, return_attn_probs=True)] == [
        (1, 24, 2, 64), (1, 2, 24), (0,)]
    cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=device)
    out, lse, probs = fa2.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 15, 15, return_attn_probs=True)
    want, want_lse = leanfa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 15, 15, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and lse.shape == (4, 24) and probs.shape == (0,)
    out, lse, _ = fa2.flash_attn_varlen_kvpacked_func(q[0], torch.stack([k[0], v[0]], 1), cu, cu, 15, 15,
                                                      return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert isinstance(fa2.flash_attn_func(q, k, v), torch.Tensor)  # plain out by default


def test_flash_attn_combine_matches_attention_over_the_union(device):
    """FA3's combine of two key halves' results equals attention over all keys (and an all -inf row is 0)."""
    from leanfa import flash_attn_interface as fai

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 7, 4, 64, generator=g).to(torch.bfloat16).to(device) for _ in range(3))
    whole, lse_whole = leanfa.flash_attn_func(q, k, v, return_lse=True, out_dtype=torch.float32)
    parts = [leanfa.flash_attn_func(q, k[:, a:b], v[:, a:b], return_lse=True, out_dtype=torch.float32)
             for a, b in ((0, 3), (3, 7))]
    out_partial = torch.stack([o for o, _ in parts])
    lse_partial = torch.stack([lse.transpose(1, 2) for _, lse in parts])  # (B, H, S) -> (B, S, H)
    lse_partial[1, 0, 0, 0] = float("-inf")  # this split contributes nothing to one row
    out_partial[1, 0, 0, 0] = float("nan")  # (and its output is never read)
    out, lse = fai.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 7, 4)
    torch.testing.assert_close(out[1:].float(), whole[1:], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[1:], lse_whole[1:].transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 0, 0].float(), parts[0][0][0, 0, 0], atol=2e-2, rtol=2e-2)
    lse_partial[:, 1, 2, 3] = float("-inf")
    out, lse = fai.flash_attn_combine(out_partial, lse_partial)
    assert lse[1, 2, 3] == float("-inf") and torch.all(out[1, 2, 3] == 0)
    with pytest.raises(ValueError, match="lse_partial"):
        fai.flash_attn_combine(out_partial, lse_partial[..., :2])
    lengths = torch.tensor([7, 7], dtype=torch.int32, device=device)
    assert fai.get_scheduler_metadata(2, 7, 7, 4, 4, 64, lengths).numel() == 0


@pytest.mark.parametrize("d", [59, 111])
def test_fa2_head_dim_not_a_multiple_of_8(device, d):
    """flash-attn 2's head dims 59 and 111 (its tests use them): zero-padded to a multiple of 8, the default scale
    from the unpadded dim; dense, varlen and paged-cache forms against the float64 reference, LSE included."""
    from leanfa.reference import attention_ref

    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn((2, 40, h, d), generator=g).to(BF16).to(device) for h in (4, 2, 2))
    want, want_lse = attention_ref(q, k, v, causal=True, return_lse=True)
    out, lse, _ = fa2.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape
    assert float((out.double() - want).abs().max()) < 2e-2
    assert float((lse.double() - want_lse).abs().max()) < 1e-3
    cu = torch.tensor([0, 40, 80], dtype=torch.int32, device=device)
    packed = fa2.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 40, 40,
                                        causal=True)
    assert torch.equal(packed, out.flatten(0, 1))
    cached = fa2.flash_attn_with_kvcache(q, k, v, cache_seqlens=40, causal=True)
    assert torch.equal(cached, out)
