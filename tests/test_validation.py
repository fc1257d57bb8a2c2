"""Every bad-input class raises the documented exception, naming the argument, before launch."""

import pytest
import torch

import leanfa

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def t(*shape, dtype=BF16):
    return torch.zeros(shape, dtype=torch.float32).to(dtype)


Q, K, V = t(1, 8, 4, 128), t(1, 8, 2, 128), t(1, 8, 2, 128)
Q8, K8, V8 = (x.to(FP8) for x in (Q, K, V))
CU = torch.tensor([0, 8], dtype=torch.int32)

CASES = [  # (id, call, exception, message fragment)
    ("q not a tensor", lambda: leanfa.flash_attn_func([1], K, V), TypeError, "q must be a torch.Tensor"),
    ("q rank", lambda: leanfa.flash_attn_func(t(8, 4, 128), K, V), ValueError, "q must have rank 4"),
    ("k rank", lambda: leanfa.flash_attn_func(Q, t(8, 2, 128), V), ValueError, "k must have rank 4"),
    ("q float32", lambda: leanfa.flash_attn_func(Q.float(), K, V), TypeError, "q has dtype torch.float32"),
    ("mixed dtypes", lambda: leanfa.flash_attn_func(Q, K.half(), V), TypeError, "share one dtype"),
    ("heads not multiple", lambda: leanfa.flash_attn_func(t(1, 8, 3, 128), K, V), ValueError, "multiple of the k/v heads"),
    ("k/v heads differ", lambda: leanfa.flash_attn_func(Q, K, t(1, 8, 1, 128)), ValueError, "same number of heads"),
    ("head dim 96", lambda: leanfa.flash_attn_func(t(1, 8, 4, 96), t(1, 8, 2, 96), t(1, 8, 2, 96)), ValueError, "head dims"),
    ("qk dims differ", lambda: leanfa.flash_attn_func(Q, t(1, 8, 2, 64), V), ValueError, "same head_dim"),
    ("batch differs", lambda: leanfa.flash_attn_func(t(2, 8, 4, 128), K, V), ValueError, "batch size"),
    ("k/v seqlen differ", lambda: leanfa.flash_attn_func(Q, K, t(1, 9, 2, 128)), ValueError, "same seqlen"),
    ("empty seqlen", lambda: leanfa.flash_attn_func(t(1, 0, 4, 128), K, V), ValueError, "seqlens must be >= 1"),
    ("softmax_scale negative", lambda: leanfa.flash_attn_func(Q, K, V, softmax_scale=-1.0), ValueError, "softmax_scale"),
    ("softmax_scale tensor", lambda: leanfa.flash_attn_func(Q, K, V, softmax_scale=torch.tensor(1.0)), TypeError, "softmax_scale"),
    ("causal not bool", lambda: leanfa.flash_attn_func(Q, K, V, causal=1), TypeError, "causal"),
    ("out_dtype int", lambda: leanfa.flash_attn_func(Q, K, V, out_dtype=torch.int8), TypeError, "out_dtype"),
    ("descale on bf16", lambda: leanfa.flash_attn_func(Q, K, V, q_descale=torch.ones(1)), ValueError, "q_descale is only meaningful"),
    ("descale float16", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_descale=torch.ones(1, dtype=torch.float16)), TypeError, "k_descale must be float32"),
    ("descale bad 2d", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_descale=torch.ones(3, 3)), ValueError, "k_descale has shape"),
    ("descale bad blocks", lambda: leanfa.flash_attn_func(Q8, K8, V8, q_descale=torch.ones(1, 4, 5)), ValueError, "q_descale has shape"),
    ("v descale bad", lambda: leanfa.flash_attn_func(Q8, K8, V8, v_descale=torch.ones(1, 2, 7)), ValueError, "v_descale has shape"),
    ("descale 4d", lambda: leanfa.flash_attn_func(Q8, K8, V8, q_descale=torch.ones(1, 1, 1, 1)), ValueError, "q_descale must be"),
    ("k_mean shape", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_mean=torch.ones(1, 2, 64)), ValueError, "k_mean"),
    ("bad backend", lambda: leanfa.flash_attn_func(Q, K, V, backend="cuda"), ValueError, "backend"),
    ("varlen rank", lambda: leanfa.flash_attn_varlen_func(Q, K, V, CU, CU, 8, 8), ValueError, "q must have rank 3"),
    ("cu dtype", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU.long(), CU, 8, 8), TypeError, "cu_seqlens_q must be int32"),
    ("cu not monotonic", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], torch.tensor([0, 9, 8], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32), 9, 4), ValueError, "non-decreasing"),
    ("cu total", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], torch.tensor([0, 7], dtype=torch.int32), CU, 8, 8), ValueError, "must equal the number of tokens"),
    ("cu first", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], torch.tensor([1, 8], dtype=torch.int32), CU, 8, 8), ValueError, r"cu_seqlens_q\[0\] must be 0"),
    ("max_seqlen small", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 4, 8), ValueError, "max_seqlen_q = 4 is smaller"),
    ("max_seqlen type", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8.0, 8), ValueError, "max_seqlen_q must be a positive int"),
    ("cu lengths differ", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, torch.tensor([0, 4, 8], dtype=torch.int32), 8, 4), ValueError, "same length"),
    ("precision", lambda: leanfa.attention(Q, K, V, precision="fp4"), ValueError, "precision"),
    ("attention fp8 input", lambda: leanfa.attention(Q8, K8, V8), TypeError, "attention\\(\\) takes bf16/fp16"),
    ("quantized plus k", lambda: leanfa.flash_attn_func(leanfa.FP8QKV(Q8, K8, V8, torch.ones(()), torch.ones(()), torch.ones(()), None, "tensor"), K8, None), ValueError, "FP8QKV"),
]


@pytest.mark.parametrize("call,exc,msg", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CPU tensor"):
        leanfa.flash_attn_func(Q, K, V)
