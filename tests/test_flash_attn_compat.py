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
    ("fa2 window", lambda: fa2.flash_attn_func(Q, K, V, window_size=(128, 0)), "window_size"),
    ("fa2 softcap", lambda: fa2.flash_attn_func(Q, K, V, softcap=30.0), "softcap"),
    ("fa2 alibi", lambda: fa2.flash_attn_func(Q, K, V, alibi_slopes=torch.ones(4)), "alibi_slopes"),
    ("fa2 attn probs with dropout", lambda: fa2.flash_attn_func(Q, K, V, dropout_p=0.1, return_attn_probs=True),
     "dropout_p"),
    ("fa2 qkvpacked dropout", lambda: fa2.flash_attn_qkvpacked_func(torch.stack([Q, Q, Q], 2), dropout_p=0.1),
     "dropout_p"),
    ("fa2 kvpacked softcap", lambda: fa2.flash_attn_kvpacked_func(Q, torch.stack([K, V], 2), softcap=5.0), "softcap"),
    ("fa2 varlen qkvpacked window", lambda: fa2.flash_attn_varlen_qkvpacked_func(torch.stack([Q[0]] * 3, 1), CU, 8,
                                                                                window_size=(4, 0)), "window_size"),
    ("fa2 varlen kvpacked alibi", lambda: fa2.flash_attn_varlen_kvpacked_func(Q[0], torch.stack([K[0], V[0]], 1), CU, CU,
                                                                             8, 8, alibi_slopes=torch.ones(4)),
     "alibi_slopes"),
    ("fa2 varlen dropout", lambda: fa2.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, 8, dropout_p=0.5), "dropout_p"),
    ("fa2 varlen block_table", lambda: fa2.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, 8,
                                                                  block_table=CU), "block_table"),
    ("fa2 varlen window", lambda: fa2.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, 8, window_size=(-1, 4)), "window_size"),
    ("fa2 kvcache", lambda: fa2.flash_attn_with_kvcache(Q, K, V), "flash_attn_with_kvcache"),
    ("fa3 qv", lambda: fa3.flash_attn_func(Q, K, V, qv=Q), "qv"),
    ("fa3 window", lambda: fa3.flash_attn_func(Q, K, V, window_size=(64, 64)), "window_size"),
    ("fa3 chunk", lambda: fa3.flash_attn_func(Q, K, V, attention_chunk=256), "attention_chunk"),
    ("fa3 softcap", lambda: fa3.flash_attn_func(Q, K, V, softcap=15.0), "softcap"),
    ("fa3 varlen q, dense k", lambda: fa3.flash_attn_varlen_func(Q[0], K, V, CU, None, 8, 8,
                                                                 seqused_k=CU[1:]), "cu_seqlens_q/cu_seqlens_k"),
    ("fa3 kvcache", lambda: fa3.flash_attn_with_kvcache(Q, K, V), "flash_attn_with_kvcache"),
]


@pytest.mark.parametrize("call,option", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_option_raises(call, option):
    with pytest.raises(NotImplementedError, match=option):
        call()


def test_bad_input_still_validated(device):
    """The drop-ins keep leanfa's argument checks (here: unsupported head dim)."""
    q = torch.zeros(1, 8, 4, 96, dtype=BF16, device=device)
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
