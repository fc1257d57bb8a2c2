"""Every bad-input class raises the documented exception, naming the argument, before launch.

Tensors live on the device the kernels would use (CUDA when present, else the CPU under the
interpreter), so each case reaches the check it names instead of the device check."""

import pytest
import torch

import leanfa

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def t(*shape, dtype=BF16):
    return torch.zeros(shape, dtype=torch.float32, device=DEV).to(dtype)


with DEV:  # torch.ones / torch.tensor below (and inside the cases, see test_bad_input) land on DEV
    Q, K, V = t(1, 8, 4, 128), t(1, 8, 2, 128), t(1, 8, 2, 128)
    Q8, K8, V8 = (x.to(FP8) for x in (Q, K, V))
    CU = torch.tensor([0, 8], dtype=torch.int32)
    ONE = torch.ones(())
    QT = leanfa.FP8QKV(Q8, K8, V8, ONE, ONE, ONE, None, "tensor")  # a dense quantized triple
    QTV = leanfa.FP8QKV(Q8[0], K8[0], V8[0], ONE, ONE, ONE, None, "tensor")  # a packed one

CASES = [  # (id, call, exception, message fragment)
    ("q not a tensor", lambda: leanfa.flash_attn_func([1], K, V), TypeError, "q must be a torch.Tensor"),
    ("q rank", lambda: leanfa.flash_attn_func(t(8, 4, 128), K, V), ValueError, "q must have rank 4"),
    ("k rank", lambda: leanfa.flash_attn_func(Q, t(8, 2, 128), V), ValueError, "k must have rank 4"),
    ("q float32", lambda: leanfa.flash_attn_func(Q.float(), K, V), TypeError, "q has dtype torch.float32"),
    ("mixed dtypes", lambda: leanfa.flash_attn_func(Q, K.half(), V), TypeError, "share one dtype"),
    ("heads not multiple", lambda: leanfa.flash_attn_func(t(1, 8, 3, 128), K, V), ValueError, "multiple of the k/v heads"),
    ("k/v heads differ", lambda: leanfa.flash_attn_func(Q, K, t(1, 8, 1, 128)), ValueError, "same number of heads"),
    ("head dim 100", lambda: leanfa.flash_attn_func(t(1, 8, 4, 100), t(1, 8, 2, 100), t(1, 8, 2, 100)), ValueError,
     "multiple of 8"),
    ("head dim 264", lambda: leanfa.flash_attn_func(t(1, 8, 4, 264), t(1, 8, 2, 264), t(1, 8, 2, 264)), ValueError,
     "head dims"),
    ("v head dim 4", lambda: leanfa.flash_attn_func(t(1, 8, 4, 64), t(1, 8, 2, 64), t(1, 8, 2, 4)), ValueError,
     "v 4"),
    ("v head dim 512 with q/k 128", lambda: leanfa.flash_attn_func(t(1, 8, 4, 128), t(1, 8, 2, 128),
                                                                   t(1, 8, 2, 512)), ValueError, "v 512"),
    ("v head dim 520", lambda: leanfa.flash_attn_func(t(1, 8, 4, 64), t(1, 8, 2, 64), t(1, 8, 2, 520)), ValueError,
     "v 520"),
    ("qk dims differ", lambda: leanfa.flash_attn_func(Q, t(1, 8, 2, 64), V), ValueError, "same head_dim"),
    ("batch differs", lambda: leanfa.flash_attn_func(t(2, 8, 4, 128), K, V), ValueError, "batch size"),
    ("k/v seqlen differ", lambda: leanfa.flash_attn_func(Q, K, t(1, 9, 2, 128)), ValueError, "same seqlen"),
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
    ("max_seqlen type", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8.0, 8), ValueError, "max_seqlen_q must be a non-negative int"),
    ("cu lengths differ", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, torch.tensor([0, 4, 8], dtype=torch.int32), 8, 4), ValueError, "same length"),
    ("window left < -1", lambda: leanfa.flash_attn_func(Q, K, V, window_size=(-2, 0)), ValueError, "window_size must be"),
    ("window right < -1", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, 8, window_size=(3, -4)), ValueError, "window_size must be"),
    ("softcap negative", lambda: leanfa.flash_attn_func(Q, K, V, softcap=-3.0), ValueError, "softcap must be"),
    ("precision", lambda: leanfa.attention(Q, K, V, precision="fp4"), ValueError, "precision"),
    ("attention fp8 input", lambda: leanfa.attention(Q8, K8, V8), TypeError, "attention\\(\\) takes bf16/fp16"),
    ("quantized plus k", lambda: leanfa.flash_attn_func(leanfa.FP8QKV(Q8, K8, V8, torch.ones(()), torch.ones(()), torch.ones(()), None, "tensor"), K8, None), ValueError, "FP8QKV"),
    # --- added: more argument classes
    ("quantized plus descale", lambda: leanfa.flash_attn_func(QT, q_descale=torch.ones(())), ValueError, "FP8QKV"),
    ("varlen given a dense FP8QKV", lambda: leanfa.flash_attn_varlen_func(QT, None, None, CU, CU, 8, 8), ValueError, "q must have rank 3"),
    ("varlen FP8QKV plus k", lambda: leanfa.flash_attn_varlen_func(QTV, K8[0], None, CU, CU, 8, 8), ValueError, "FP8QKV"),
    ("varlen k/v tokens differ", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], t(9, 2, 128), CU, CU, 8, 8), ValueError, "same number of tokens"),
    ("cu 2-D", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU[None], CU, 8, 8), ValueError, "cu_seqlens_q must be 1-D"),
    ("cu not a tensor", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], [0, 8], CU, 8, 8), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ("max_seqlen bool", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, True, 8), ValueError, "max_seqlen_q must be a non-negative int"),
    ("max_seqlen negative", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, -1), ValueError, "max_seqlen_k must be a non-negative int"),
    ("max_seqlen zero", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, 0), ValueError, "max_seqlen_k = 0 is smaller"),
    ("seqused dtype", lambda: leanfa.flash_attn_func(Q, K, V, seqused_k=torch.ones(1, dtype=torch.int64)), TypeError, "seqused_k must be int32"),
    ("seqused shape", lambda: leanfa.flash_attn_func(Q, K, V, seqused_q=torch.ones(2, dtype=torch.int32)), ValueError, "seqused_q must be 1-D with one entry"),
    ("seqused not a tensor", lambda: leanfa.flash_attn_func(Q, K, V, seqused_q=[1]), TypeError, "seqused_q must be a torch.Tensor"),
    ("seqused device", lambda: leanfa.flash_attn_func(Q, K, V, seqused_k=torch.ones(1, dtype=torch.int32, device="meta")), ValueError, "seqused_k is on meta"),
    ("seqused too long", lambda: leanfa.flash_attn_func(Q, K, V, seqused_k=torch.tensor([9], dtype=torch.int32)), ValueError, "seqused_k must lie in"),
    ("seqused negative", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 8, 8, seqused_q=torch.tensor([-1], dtype=torch.int32)), ValueError, "seqused_q must lie in"),
    ("seqused past a varlen sequence", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32), 5, 5, seqused_k=torch.tensor([4, 5], dtype=torch.int32)), ValueError, "seqused_k must lie in"),
    ("return_lse not bool", lambda: leanfa.flash_attn_func(Q, K, V, return_lse=1), TypeError, "return_lse"),
    ("softmax_scale nan", lambda: leanfa.flash_attn_func(Q, K, V, softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("softmax_scale inf", lambda: leanfa.flash_attn_func(Q, K, V, softmax_scale=float("inf")), ValueError, "softmax_scale"),
    ("softmax_scale zero", lambda: leanfa.flash_attn_func(Q, K, V, softmax_scale=0.0), ValueError, "softmax_scale"),
    ("softmax_scale bool", lambda: leanfa.flash_attn_func(Q, K, V, softmax_scale=True), TypeError, "softmax_scale"),
    ("out_dtype fp8", lambda: leanfa.flash_attn_func(Q, K, V, out_dtype=FP8), TypeError, "out_dtype"),
    ("empty head_dim", lambda: leanfa.flash_attn_func(t(1, 8, 4, 0), t(1, 8, 2, 0), t(1, 8, 2, 0)), ValueError, "empty head"),
    ("k_mean float16", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_mean=torch.ones(1, 2, 128, dtype=torch.float16)), TypeError, "k_mean must be a float32"),
    ("k_mean not a tensor", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_mean=[0.0]), TypeError, "k_mean must be a float32"),
    ("descale not a tensor", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_descale=0.5), TypeError, "k_descale must be a torch.Tensor"),
    ("v descale (B, Hq)", lambda: leanfa.flash_attn_func(Q8, K8, V8, v_descale=torch.ones(1, 4)), ValueError, "v_descale has shape"),
    ("k descale per q head", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_descale=torch.ones(1, 4)), ValueError, "k_descale has shape"),
    ("q descale blocks of k heads", lambda: leanfa.flash_attn_func(Q8, K8, V8, q_descale=torch.ones(1, 2, 1)), ValueError, "q_descale has shape"),
    # devices: the meta device stands in for a second device on a CPU-only machine
    ("k on another device", lambda: leanfa.flash_attn_func(Q, K.to("meta"), V), ValueError, "one device"),
    ("descale on another device", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_descale=torch.ones((), device="meta")), ValueError, "k_descale is on meta"),
    ("k_mean on another device", lambda: leanfa.flash_attn_func(Q8, K8, V8, k_mean=torch.ones(1, 2, 128, device="meta")), ValueError, "k_mean is on meta"),
    ("cu on another device", lambda: leanfa.flash_attn_varlen_func(Q[0], K[0], V[0], CU.to("meta"), CU, 8, 8), ValueError, "cu_seqlens_q is on meta"),
    ("tensor on meta", lambda: leanfa.flash_attn_func(Q.to("meta"), K.to("meta"), V.to("meta")), ValueError, "needs CUDA tensors"),
    ("attention float32", lambda: leanfa.attention(Q.float(), K.float(), V.float()), TypeError, "attention\\(\\) takes bf16/fp16"),
    ("attention not a tensor", lambda: leanfa.attention(None, K, V), TypeError, "q must be a torch.Tensor"),
    # --- quantize_fp8
    ("quantize granularity", lambda: leanfa.quantize_fp8(Q, K, V, granularity="channel"), ValueError, "granularity"),
    ("quantize fp8 input", lambda: leanfa.quantize_fp8(Q8, K8, V8), TypeError, "quantize_fp8 takes bf16/fp16/fp32 q"),
    ("quantize int input", lambda: leanfa.quantize_fp8(Q, K.to(torch.int32), V), TypeError, "quantize_fp8 takes bf16/fp16/fp32 k"),
    ("quantize not a tensor", lambda: leanfa.quantize_fp8(Q, K, None), TypeError, "v must be a torch.Tensor"),
    ("quantize rank", lambda: leanfa.quantize_fp8(Q[0], K[0], V[0]), ValueError, "q must have rank 4"),
    ("quantize k/v tokens", lambda: leanfa.quantize_fp8(Q, K, t(1, 9, 2, 128)), ValueError, "k and v must agree"),
    ("quantize k/v heads", lambda: leanfa.quantize_fp8(Q, K, t(1, 8, 1, 128)), ValueError, "k and v must agree"),
    ("quantize qk dims", lambda: leanfa.quantize_fp8(Q, t(1, 8, 2, 64), t(1, 8, 2, 64)), ValueError, "same head_dim"),
    ("quantize devices", lambda: leanfa.quantize_fp8(Q, K.to("meta"), V), ValueError, "k is on meta"),
    ("quantize varlen partial", lambda: leanfa.quantize_fp8(Q[0], K[0], V[0], cu_seqlens_q=CU), ValueError, "varlen quantization needs"),
    ("quantize varlen cu dtype", lambda: leanfa.quantize_fp8(Q[0], K[0], V[0], cu_seqlens_q=CU.long(), cu_seqlens_k=CU, max_seqlen_q=8, max_seqlen_k=8), TypeError, "cu_seqlens_q must be a 1-D int32"),
    ("quantize varlen cu lengths", lambda: leanfa.quantize_fp8(Q[0], K[0], V[0], cu_seqlens_q=CU, cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32), max_seqlen_q=8, max_seqlen_k=4), ValueError, "same length"),
    # these three used to pass quantize_fp8 silently (unquantized blocks / out-of-bounds reads)
    ("quantize varlen max_seqlen small", lambda: leanfa.quantize_fp8(Q[0], K[0], V[0], cu_seqlens_q=CU, cu_seqlens_k=CU, max_seqlen_q=4, max_seqlen_k=8), ValueError, "max_seqlen_q = 4 is smaller"),
    ("quantize varlen cu total", lambda: leanfa.quantize_fp8(Q[0], K[0], V[0], cu_seqlens_q=CU, cu_seqlens_k=torch.tensor([0, 20], dtype=torch.int32), max_seqlen_q=8, max_seqlen_k=20), ValueError, "must equal the number of tokens"),
    ("quantize varlen cu device", lambda: leanfa.quantize_fp8(Q[0], K[0], V[0], cu_seqlens_q=CU.to("meta"), cu_seqlens_k=CU, max_seqlen_q=8, max_seqlen_k=8), ValueError, "cu_seqlens_q is on meta"),
]


# cu_seqlens *values* are checked on CPU tensors only: reading them from a GPU tensor would
# sync the host on every call (flash-attn does not check them either; documented in the API)
CPU_VALUE_CHECKS = {"cu not monotonic", "cu total", "cu first", "max_seqlen small", "max_seqlen zero",
                    "seqused too long", "seqused negative", "seqused past a varlen sequence",
                    "quantize varlen max_seqlen small", "quantize varlen cu total"}
_CASES = [pytest.param(*c[1:], id=c[0], marks=pytest.mark.skipif(
    DEV.type == "cuda" and c[0] in CPU_VALUE_CHECKS, reason="cu_seqlens values on a GPU are not read (no host sync)"))
    for c in CASES]


@pytest.mark.parametrize("call,exc,msg", _CASES)
def test_bad_input(call, exc, msg):
    with DEV, pytest.raises(exc, match=msg):
        call()


def test_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CPU tensor"):
        leanfa.flash_attn_func(Q.cpu(), K.cpu(), V.cpu())
    with pytest.raises(ValueError, match="CPU tensor"):
        leanfa.quantize_fp8(Q.cpu(), K.cpu(), V.cpu())


def test_fp8_on_pre_ada_gpu_is_refused(monkeypatch):
    """Triton rejects float8_e4m3fn below sm89: the API says so instead of failing in the compiler."""
    import leanfa.checks
    from leanfa.api import check_fp8_device

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(leanfa.checks, "capability", lambda device: (8, 0))  # (cached per device)
    with pytest.raises(ValueError, match="compute capability 8.9"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(leanfa.checks, "capability", lambda device: (9, 0))
    check_fp8_device(torch.device("cuda", 0))  # Hopper: fine


@pytest.mark.parametrize("dims", [(96, 96), (32, 32), (192, 192), (80, 80), (256, 128)])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_portable_head_dims_match_the_reference(dims, precision, device):
    """Head dims outside the Hopper kernel's set (FA3's multiples of 8) run on the portable kernel, with the
    error of the kernel's own head dims (BF16 ~4e-3, FP8 ~4e-2 on Gaussian data)."""
    from leanfa.reference import attention_ref

    dqk, dv = dims
    g = torch.Generator().manual_seed(dqk + dv)
    q, k = (torch.randn(2, 70, h, dqk, generator=g).to(BF16).to(device) for h in (4, 2))
    v = torch.randn(2, 70, 2, dv, generator=g).to(BF16).to(device)
    ref = attention_ref(q, k, v, causal=True)
    ref = (ref[0] if isinstance(ref, tuple) else ref).double()
    out = leanfa.attention(q, k, v, causal=True, precision=precision)
    assert out.shape == (2, 70, 4, dv)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-2 if precision == "bf16" else 8e-2), err
