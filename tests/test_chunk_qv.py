"""FlashAttention-3's ``attention_chunk`` (Llama-4's chunked local attention) and ``qv`` (MLA's absorbed form) on the
portable kernel, through leanfa's API and the FA3 drop-in.

Every call is checked against the float64 reference (:func:`leanfa.reference.attention_ref`), which is itself
checked against a brute-force loop here. Outputs are poisoned with NaN before each launch (conftest:
``LEANFA_POISON_OUTPUTS``). CPU shapes are small (32x32 tiles in the interpreter: chunks smaller and larger than a
key tile, not multiples of it, so tiles straddle chunk edges and some key tiles lie wholly outside every chunk of a
query tile); the ``gpu`` tests run larger shapes on the autotuned tiles.
"""

import math
import warnings

import pytest
import torch

import leanfa
from leanfa import flash_attn_interface as fa3
from leanfa.reference import attention_ref

from helpers import TOL, check_out_lse, cu_seqlens, hopper_accepts_everything, rel_l2

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
LSE_TOL = {BF16: 2e-3, FP8: 0.3}


def _rand(shape, device, dtype=BF16, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype).to(device)


def _descales(b, hkv, device):
    """FA3's per-head ``(B, Hkv)`` descales."""
    return [torch.rand(b, hkv, device=device) + 0.5 for _ in range(3)]


# ----------------------------------------------------------------------------- the reference itself


def _brute_force(q, k, v, *, causal, window, chunk, qv=None, scale):
    """One sequence, every score by a Python loop: (Sq, H, D) x (Sk, Hkv, D) -> out (Sq, H, Dv), lse (H, Sq)."""
    sq, h, _ = q.shape
    sk, hkv, dv = v.shape
    out = torch.zeros(sq, h, dv, dtype=torch.float64)
    lse = torch.full((h, sq), -math.inf, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for hh in range(h):
        kh = hh // (h // hkv)
        for i in range(sq):
            pos = i + sk - sq
            keys = []
            for j in range(sk):
                if right >= 0 and j > pos + right:
                    continue
                if left >= 0 and j < pos - left:
                    continue
                if chunk > 0 and not (pos // chunk) * chunk <= j < (pos // chunk) * chunk + chunk:  # floor division
                    continue
                s = float(q[i, hh].double() @ k[j, kh].double())
                if qv is not None:
                    s += float(qv[i, hh].double() @ v[j, kh].double())
                keys.append((j, s * scale))
            if not keys:
                continue
            m = max(s for _, s in keys)
            w = [(j, math.exp(s - m)) for j, s in keys]
            total = sum(x for _, x in w)
            lse[hh, i] = m + math.log(total)
            for j, x in w:
                out[i, hh] += x / total * v[j, kh].double()
    return out, lse


@pytest.mark.parametrize("sq,sk,chunk,causal,window", [
    (9, 13, 4, False, (-1, -1)), (13, 9, 5, False, (-1, -1)), (11, 11, 3, True, (2, -1)), (7, 12, 5, False, (3, 1)),
    (12, 7, 20, False, (-1, -1)),
])
def test_reference_chunk_brute_force(sq, sk, chunk, causal, window):
    torch.manual_seed(sq * 100 + sk)
    q, k, v = torch.randn(sq, 2, 8), torch.randn(sk, 1, 8), torch.randn(sk, 1, 4)
    qv = torch.randn(sq, 2, 4)
    for extra in (None, qv):
        scale = 1 / math.sqrt(8 + (4 if extra is not None else 0))
        out, lse = attention_ref(q[None], k[None], v[None], causal=causal, window_size=window, attention_chunk=chunk,
                                 qv=None if extra is None else extra[None], return_lse=True)
        want, want_lse = _brute_force(q, k, v, causal=causal, window=window, chunk=chunk, qv=extra, scale=scale)
        assert torch.allclose(out[0], want, atol=1e-12)
        assert torch.equal(torch.isneginf(lse[0]), torch.isneginf(want_lse))
        assert torch.allclose(lse[0][~torch.isneginf(want_lse)], want_lse[~torch.isneginf(want_lse)], atol=1e-12)


def test_reference_chunk_hides_keys():
    """The chunk mask changes the answer (a test of it can fail): chunk 4 over 16 keys is not full attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 16, 1, 8), torch.randn(1, 16, 1, 8), torch.randn(1, 16, 1, 8)
    assert not torch.allclose(attention_ref(q, k, v, attention_chunk=4), attention_ref(q, k, v))


# ----------------------------------------------------------------------------- attention_chunk

# (id, chunk, causal, window, Sq, Sk); GQA (2 query heads on 1 KV head); the interpreter's key tile is 32 keys
DENSE_CHUNK = [
    ("small-causal", 7, True, (-1, -1), 100, 100),     # smaller than a tile, not dividing it
    ("wide-noncausal", 45, False, (-1, -1), 100, 100),  # larger than a tile, not a multiple
    ("tile-multiple-sq<sk", 64, True, (-1, -1), 45, 130),
    ("causal+window", 20, True, (10, -1), 100, 100),
    ("window-both", 50, False, (15, 8), 90, 110),
    ("sq>sk", 13, False, (-1, -1), 100, 40),            # positions below 0: the first rows see no key
    ("sq>sk-wider-than-keys", 200, False, (-1, -1), 70, 50),  # rows at positions < 0 see no key
]


@pytest.mark.parametrize("chunk,causal,window,sq,sk", [c[1:] for c in DENSE_CHUNK], ids=[c[0] for c in DENSE_CHUNK])
def test_dense_chunk_bf16(device, chunk, causal, window, sq, sk):
    q, k, v = _rand((1, sq, 2, 64), device), _rand((1, sk, 1, 64), device), _rand((1, sk, 1, 64), device)
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, window_size=window, attention_chunk=chunk,
                                   return_attn_probs=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, attention_chunk=chunk, return_lse=True)
    check_out_lse(out, lse, ref, ref_lse, TOL[BF16], LSE_TOL[BF16])
    no_chunk = attention_ref(q, k, v, causal=causal, window_size=window)
    assert (ref - no_chunk).abs().max() > 1e-3  # the chunk hides keys here


@pytest.mark.parametrize("causal", [True, False])
def test_dense_chunk_fp8_gqa_softcap(device, causal):
    """FP8 with FA3's (B, Hkv) descales, 4 query heads on 2 KV heads, softcap on top."""
    b, sq, sk = 2, 70, 90
    q, k, v = _rand((b, sq, 4, 64), device), _rand((b, sk, 2, 64), device), _rand((b, sk, 2, 64), device)
    qd, kd, vd = _descales(b, 2, device)
    q8, k8, v8 = q.to(FP8), k.to(FP8), v.to(FP8)
    out, lse = fa3.flash_attn_func(q8, k8, v8, causal=causal, attention_chunk=24, softcap=5.0, q_descale=qd,
                                   k_descale=kd, v_descale=vd, return_attn_probs=True)
    ref, ref_lse = attention_ref(q8, k8, v8, causal=causal, attention_chunk=24, softcap=5.0, q_descale=qd,
                                 k_descale=kd, v_descale=vd, return_lse=True)
    check_out_lse(out, lse, ref, ref_lse, TOL[FP8], LSE_TOL[FP8])


def test_chunk_covering_every_key_is_no_chunk(device):
    """A chunk at least as long as the keys of a dense call with Sq <= Sk is no chunk (stored as 0): the same bits
    as without it."""
    q, k, v = _rand((1, 40, 2, 64), device), _rand((1, 50, 1, 64), device), _rand((1, 50, 1, 64), device)
    want = leanfa.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=50), want)
    assert not torch.equal(fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=49), want)


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_varlen_chunk(device, dtype):
    """Packed sequences of different lengths (Sq < Sk, Sq = Sk, Sq > Sk): each sequence's chunks are its own."""
    lq, lk = [37, 64, 50], [90, 64, 20]
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    q, k, v = _rand((sum(lq), 4, 64), device), _rand((sum(lk), 2, 64), device), _rand((sum(lk), 2, 64), device)
    kw = {}
    if dtype == FP8:
        kw = dict(zip(("q_descale", "k_descale", "v_descale"), _descales(3, 2, device)))
        q, k, v = q.to(FP8), k.to(FP8), v.to(FP8)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, attention_chunk=19,
                                          return_attn_probs=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, attention_chunk=19,
                                 return_lse=True, **kw)
    check_out_lse(out, lse, ref, ref_lse, TOL[dtype], LSE_TOL[dtype])


def test_varlen_chunk_seqused(device):
    """seqused_k cuts each sequence's keys; the chunks are aligned to the used lengths (non-causal, both sides)."""
    lq, lk = [40, 33], [80, 70]
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    used_k = torch.tensor([61, 70], dtype=torch.int32, device=device)
    q, k, v = _rand((sum(lq), 2, 64), device), _rand((sum(lk), 1, 64), device), _rand((sum(lk), 1, 64), device)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), seqused_k=used_k, attention_chunk=27,
                                          return_attn_probs=True)
    ref_outs, ref_lses = [], []
    for b in range(2):  # the reference on each sequence cut to its used keys
        ks = k[int(ck[b]):int(ck[b]) + int(used_k[b])]
        vs = v[int(ck[b]):int(ck[b]) + int(used_k[b])]
        o, l = attention_ref(q[int(cq[b]):int(cq[b + 1])][None], ks[None], vs[None], attention_chunk=27,
                             return_lse=True)
        ref_outs.append(o[0])
        ref_lses.append(l[0])
    check_out_lse(out, lse, torch.cat(ref_outs), torch.cat(ref_lses, 1), TOL[BF16], LSE_TOL[BF16])


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_paged_kvcache_chunk_qv(device, dtype):
    """FA3's flash_attn_with_kvcache over shuffled 16-key pages with cache_seqlens (chunked prefill, Sq < Sk),
    attention_chunk and qv together."""
    b, sq, hkv, page = 2, 30, 1, 16
    lens = torch.tensor([70, 45], dtype=torch.int32)
    pages_per = 5
    perm = torch.randperm(b * pages_per).to(torch.int32)
    table = perm.reshape(b, pages_per).to(device)
    k_cache = _rand((b * pages_per, page, hkv, 64), device)
    v_cache = _rand((b * pages_per, page, hkv, 128), device)
    q, qv = _rand((b, sq, 2, 64), device), _rand((b, sq, 2, 128), device, scale=0.5)
    kw = {}
    if dtype == FP8:
        kw = dict(zip(("q_descale", "k_descale", "v_descale"), _descales(b, hkv, device)))
        q, qv, k_cache, v_cache = q.to(FP8), qv.to(FP8), k_cache.to(FP8), v_cache.to(FP8)
    out, lse, *_ = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, qv=qv, cache_seqlens=lens.to(device),
                                               page_table=table, causal=True, attention_chunk=21,
                                               return_softmax_lse=True, **kw)
    ref, ref_lse = attention_ref(q, k_cache, v_cache, page_table=table, seqlens_k=lens, causal=True,
                                 attention_chunk=21, qv=qv, return_lse=True, **kw)
    check_out_lse(out, lse, ref, ref_lse, TOL[dtype], LSE_TOL[dtype])


def test_attention_api_chunk(device):
    """leanfa.attention takes attention_chunk as it takes window_size (both precisions)."""
    q, k, v = _rand((1, 80, 2, 64), device), _rand((1, 80, 1, 64), device), _rand((1, 80, 1, 64), device)
    ref = attention_ref(q, k, v, causal=True, attention_chunk=24)
    assert rel_l2(leanfa.attention(q, k, v, causal=True, precision="bf16", attention_chunk=24), ref) < TOL[BF16]
    assert rel_l2(leanfa.attention(q, k, v, causal=True, precision="fp8", attention_chunk=24), ref) < TOL[FP8]


# ----------------------------------------------------------------------------- qv


@pytest.mark.parametrize("dtype,causal,dv", [(BF16, True, 128), (BF16, False, 64), (FP8, True, 128), (FP8, False, 64)])
def test_dense_qv(device, dtype, causal, dv):
    """qv (B, Sq, H, Dv): scores (q.k + qv.v) / sqrt(d + dv); GQA 4 on 2; FP8 qv shares q's descale."""
    b, sq, sk = 2, 50, 70
    q, k, v = _rand((b, sq, 4, 64), device), _rand((b, sk, 2, 64), device), _rand((b, sk, 2, dv), device)
    qv = _rand((b, sq, 4, dv), device)
    kw = {}
    if dtype == FP8:
        kw = dict(zip(("q_descale", "k_descale", "v_descale"), _descales(b, 2, device)))
        q, k, v, qv = q.to(FP8), k.to(FP8), v.to(FP8), qv.to(FP8)
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, qv=qv, return_attn_probs=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, qv=qv, return_lse=True, **kw)
    check_out_lse(out, lse, ref, ref_lse, TOL[dtype], LSE_TOL[dtype])
    without = attention_ref(q, k, v, causal=causal, softmax_scale=(64 + dv) ** -0.5, **kw)
    assert (ref - without).abs().max() > 1e-2  # the qv term changes the answer


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_mla_head_dims_64_512(device, dtype):
    """FA3's MLA form: q/k 64, v (and qv) 512, on the portable kernel; causal with Sq < Sk, GQA 2 on 1."""
    b, sq, sk = 1, 40, 70
    q, k, v = _rand((b, sq, 2, 64), device), _rand((b, sk, 1, 64), device), _rand((b, sk, 1, 512), device)
    qv = _rand((b, sq, 2, 512), device, scale=0.3)
    kw = {}
    if dtype == FP8:
        kw = dict(zip(("q_descale", "k_descale", "v_descale"), _descales(b, 1, device)))
        q, k, v, qv = q.to(FP8), k.to(FP8), v.to(FP8), qv.to(FP8)
    for extra in ({}, {"qv": qv}):
        out, lse = fa3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **extra, **kw)
        ref, ref_lse = attention_ref(q, k, v, causal=True, return_lse=True, **extra, **kw)
        assert out.shape == (b, sq, 2, 512)
        check_out_lse(out, lse, ref, ref_lse, TOL[dtype], LSE_TOL[dtype])


def test_qv_default_scale_and_explicit_scale(device):
    """Without softmax_scale the scale is 1/sqrt(d + dv) (FA3's default with qv); an explicit one is used as is."""
    q, k, v = _rand((1, 40, 2, 64), device), _rand((1, 40, 2, 64), device), _rand((1, 40, 2, 128), device)
    qv = _rand((1, 40, 2, 128), device)
    from leanfa.api import _build_problem

    p = _build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                       v_descale=None, k_mean=None, return_lse=False, out_dtype=None, qv=qv)
    assert p.softmax_scale == pytest.approx(1 / math.sqrt(192))
    out = fa3.flash_attn_func(q, k, v, qv=qv, softmax_scale=0.05)
    assert rel_l2(out, attention_ref(q, k, v, qv=qv, softmax_scale=0.05)) < TOL[BF16]
    assert rel_l2(out, attention_ref(q, k, v, qv=qv)) > 5 * TOL[BF16]  # (the scale matters here)


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_varlen_qv_chunk_softcap(device, dtype):
    """Packed qv (total_q, H, Dv) with a chunk and softcap, sequences of different lengths."""
    lq, lk = [30, 55], [75, 55]
    cq, ck = cu_seqlens(lq, device), cu_seqlens(lk, device)
    q, k, v = _rand((sum(lq), 2, 64), device), _rand((sum(lk), 1, 64), device), _rand((sum(lk), 1, 128), device)
    qv = _rand((sum(lq), 2, 128), device)
    kw = {}
    if dtype == FP8:
        kw = dict(zip(("q_descale", "k_descale", "v_descale"), _descales(2, 1, device)))
        q, k, v, qv = q.to(FP8), k.to(FP8), v.to(FP8), qv.to(FP8)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, qv=qv, attention_chunk=33,
                                          softcap=3.0, return_attn_probs=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, qv=qv, attention_chunk=33,
                                 softcap=3.0, return_lse=True, **kw)
    check_out_lse(out, lse, ref, ref_lse, TOL[dtype], LSE_TOL[dtype])


def test_qv_mixed_mode(device):
    """FP8 q/k with a BF16 v (the mixed mode): an FP8 qv, dequantized by q's descale, against the 16-bit V."""
    q, k, v = _rand((1, 40, 2, 64), device), _rand((1, 60, 1, 64), device), _rand((1, 60, 1, 64), device)
    qv = _rand((1, 40, 2, 64), device)
    qd, kd, _ = _descales(1, 1, device)
    q8, k8, qv8 = q.to(FP8), k.to(FP8), qv.to(FP8)
    out, lse = leanfa.flash_attn_func(q8, k8, v, causal=True, qv=qv8, q_descale=qd, k_descale=kd, return_lse=True)
    ref, ref_lse = attention_ref(q8, k8, v, causal=True, qv=qv8, q_descale=qd, k_descale=kd, return_lse=True)
    check_out_lse(out, lse, ref, ref_lse, 3e-2, 1e-2)


# ----------------------------------------------------------------------------- bad input and dispatch


def test_bad_chunk_and_qv(device):
    q, k, v = _rand((1, 16, 2, 64), device), _rand((1, 16, 1, 64), device), _rand((1, 16, 1, 128), device)
    with pytest.raises(ValueError, match="attention_chunk"):
        fa3.flash_attn_func(q, k, v, attention_chunk=-1)
    with pytest.raises(TypeError, match="attention_chunk"):
        leanfa.flash_attn_func(q, k, v, attention_chunk=True)
    with pytest.raises(ValueError, match="qv"):
        fa3.flash_attn_func(q, k, v, qv=_rand((1, 16, 2, 64), device))  # q's head dim, not v's
    with pytest.raises(ValueError, match="qv"):
        fa3.flash_attn_func(q, k, v, qv=_rand((1, 15, 2, 128), device))
    with pytest.raises(ValueError, match="qv"):
        fa3.flash_attn_func(q, k, v, qv=_rand((1, 16, 2, 128), device, dtype=torch.float16))
    with pytest.raises(ValueError, match="qv"):
        fa3.flash_attn_func(q, k, v, qv=torch.zeros(3))
    with pytest.raises(ValueError, match="attention_chunk"):
        leanfa.attention(q, k, v, attention_chunk=-5)
    with pytest.raises(ValueError, match="attention_chunk"):
        leanfa.attention(q, k, v[..., :64], precision="fp8", bf16_sink_keys=128, attention_chunk=8)


def test_dispatch_portable_only(monkeypatch):
    """On a GPU whose Hopper kernel takes everything else, chunk and qv calls run on the portable kernel with one
    warning each."""
    dispatch = hopper_accepts_everything(monkeypatch)
    from leanfa.api import _build_problem

    q, k, v = torch.randn(1, 64, 2, 128).bfloat16(), torch.randn(1, 64, 2, 128).bfloat16(), \
        torch.randn(1, 64, 2, 128).bfloat16()
    base = dict(varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                softmax_scale=None, causal=True, q_descale=None, k_descale=None, v_descale=None, k_mean=None,
                return_lse=False, out_dtype=None)
    assert dispatch.portable_only_reason(_build_problem(q, k, v, **base)) == ""
    for extra, word in ((dict(attention_chunk=16), "attention_chunk"), (dict(qv=torch.randn_like(q)), "qv")):
        problem = _build_problem(q, k, v, **base, **extra)
        assert word in dispatch.portable_only_reason(problem)
        with pytest.warns(UserWarning, match=word):
            choice = dispatch.choose(problem, "auto")
        assert choice.kernel == "portable"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dispatch.choose(problem, "auto")  # once per process
        with pytest.raises(ValueError, match=word):
            dispatch.choose(problem, "hopper")


# ----------------------------------------------------------------------------- GPU (autotuned tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("chunk,causal,window", [(8192, True, (-1, -1)), (1000, True, (-1, -1)), (333, False, (-1, -1)),
                                                 (2048, True, (700, -1)), (100, False, (200, 50))])
def test_gpu_chunk_large(dtype, chunk, causal, window):
    b, sq, sk = 2, 3000, 4100
    q, k, v = _rand((b, sq, 8, 128), "cuda"), _rand((b, sk, 2, 128), "cuda"), _rand((b, sk, 2, 128), "cuda")
    kw = {}
    if dtype == FP8:
        kw = dict(zip(("q_descale", "k_descale", "v_descale"), _descales(b, 2, "cuda")))
        q, k, v = q.to(FP8), k.to(FP8), v.to(FP8)
    out, lse = fa3.flash_attn_func(q, k, v, causal=causal, window_size=window, attention_chunk=chunk,
                                   return_attn_probs=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, attention_chunk=chunk, return_lse=True,
                                 **kw)
    check_out_lse(out, lse, ref, ref_lse, TOL[dtype], LSE_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP8])
@pytest.mark.parametrize("dv", [64, 256, 512])
def test_gpu_qv_varlen_large(dtype, dv):
    lq, lk = [1500, 3000, 700], [2000, 3000, 4000]
    cq, ck = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    q, k = _rand((sum(lq), 8, 64), "cuda"), _rand((sum(lk), 1, 64), "cuda")
    v, qv = _rand((sum(lk), 1, dv), "cuda"), _rand((sum(lq), 8, dv), "cuda")
    kw = {}
    if dtype == FP8:
        kw = dict(zip(("q_descale", "k_descale", "v_descale"), _descales(3, 1, "cuda")))
        q, k, v, qv = q.to(FP8), k.to(FP8), v.to(FP8), qv.to(FP8)
    for chunk in (0, 1536):
        out, lse = fa3.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, qv=qv,
                                              attention_chunk=chunk, return_attn_probs=True, **kw)
        ref, ref_lse = attention_ref(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True, qv=qv,
                                     attention_chunk=chunk, return_lse=True, **kw)
        check_out_lse(out, lse, ref, ref_lse, TOL[dtype], LSE_TOL[dtype])
