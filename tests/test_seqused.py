"""FlashAttention-3's ``seqused_q``/``seqused_k`` on dense and varlen calls (portable kernel).

Sequence ``b`` has only its first ``seqused_q[b]`` queries and ``seqused_k[b]`` keys: the call must
equal the truncated problem (against the float64 reference, and bit for bit against leanfa on the
truncated inputs), rows past ``seqused_q[b]`` are 0 with LSE ``-inf`` (outputs are poisoned with NaN
before each launch: conftest), and ``seqused`` equal to the full lengths changes no bit. Inputs are
fresh random draws; lengths are chosen so that whole query tiles (32 rows under the interpreter,
64 or more on a GPU) lie past ``seqused_q`` and used lengths end inside key tiles.
"""

import dataclasses
import warnings

import pytest
import torch

import leanfa
from leanfa import flash_attn_interface as fa3
from leanfa.problem import Problem
from leanfa.reference import attention_ref

from helpers import TOL, cu_seqlens, hopper_accepts_everything, rel_l2

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
I32 = torch.int32


def _rand(shape, device, dtype=BF16):
    return torch.randn(shape).to(dtype).to(device)


def _check_rows(out, lse, ref, ref_lse, tol):
    """Used rows against float64: output within ``tol``, LSE -inf exactly where the reference's is."""
    assert rel_l2(out, ref) < tol
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse.double() - ref_lse)[finite].abs().max().item() < (0.3 if tol > 5e-2 else 1e-3)


def _fp8(q, k, v, device):
    """FP8 inputs with FA3-style per-head (B, Hkv) descales."""
    b, hkv = q.shape[0], k.shape[2]
    d = [torch.rand(b, hkv, device=device) + 0.5 for _ in range(3)]
    return (q.to(FP8), k.to(FP8), v.to(FP8)), dict(q_descale=d[0], k_descale=d[1], v_descale=d[2])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_dense_seqused_equals_truncated_problem(device, causal, precision):
    B, Sq, Sk, Hq, Hkv, D = 3, 70, 90, 4, 2, 64
    q, k, v = _rand((B, Sq, Hq, D), device), _rand((B, Sk, Hkv, D), device), _rand((B, Sk, Hkv, D), device)
    used_q = torch.tensor([33, 0, 70], dtype=I32, device=device)  # batch 1: no query at all
    used_k = torch.tensor([20, 90, 0], dtype=I32, device=device)  # batch 2: no key (rows 0, LSE -inf)
    kw = {}
    if precision == "fp8":
        (q, k, v), kw = _fp8(q, k, v, device)
    out, lse = leanfa.flash_attn_func(q, k, v, causal=causal, return_lse=True, seqused_q=used_q, seqused_k=used_k,
                                      **kw)
    assert out.shape == (B, Sq, Hq, D) and lse.shape == (B, Hq, Sq)
    tol = TOL[FP8 if precision == "fp8" else BF16]
    for b in range(B):
        uq, uk = int(used_q[b]), int(used_k[b])
        assert (out[b, uq:] == 0).all() and torch.isneginf(lse[b, :, uq:]).all(), "rows past seqused_q"
        if uq == 0:
            continue
        args = (q[b:b + 1, :uq], k[b:b + 1, :uk], v[b:b + 1, :uk])
        one = {n: t[b:b + 1] for n, t in kw.items()}
        ref, ref_lse = attention_ref(*args, causal=causal, return_lse=True, **one)
        _check_rows(out[b:b + 1, :uq], lse[b:b + 1, :, :uq], ref, ref_lse, tol)
        # the same kernel arithmetic as the truncated call on the same (portable) kernel: identical bits
        want, want_lse = leanfa.flash_attn_func(*args, causal=causal, return_lse=True, backend="portable", **one)
        assert torch.equal(out[b:b + 1, :uq], want) and torch.equal(lse[b:b + 1, :, :uq], want_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_equals_truncated_problem(device, causal):
    lens_q, lens_k = [40, 70, 5, 0, 33], [50, 70, 9, 4, 20]
    used_q, used_k = [17, 70, 5, 0, 1], [50, 33, 0, 4, 20]
    Hq, Hkv, D = 4, 1, 128
    q, k, v = _rand((sum(lens_q), Hq, D), device), _rand((sum(lens_k), Hkv, D), device), _rand((sum(lens_k), Hkv, D), device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    uq, uk = torch.tensor(used_q, dtype=I32, device=device), torch.tensor(used_k, dtype=I32, device=device)
    out, lse = leanfa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                             return_lse=True, seqused_q=uq, seqused_k=uk)
    # the truncated problem: the used tokens of each sequence, packed
    keep_q = torch.cat([torch.arange(a, a + n) for a, n in zip(cu_q.tolist(), used_q)]).to(device)
    keep_k = torch.cat([torch.arange(a, a + n) for a, n in zip(cu_k.tolist(), used_k)]).to(device)
    tq, tk, tv = q[keep_q], k[keep_k], v[keep_k]
    tcu_q, tcu_k = cu_seqlens(used_q, device), cu_seqlens(used_k, device)
    ref, ref_lse = attention_ref(tq, tk, tv, causal=causal, cu_seqlens_q=tcu_q, cu_seqlens_k=tcu_k, return_lse=True)
    _check_rows(out[keep_q], lse[:, keep_q], ref, ref_lse, TOL[BF16])
    want, want_lse = leanfa.flash_attn_varlen_func(tq, tk, tv, tcu_q, tcu_k, max(used_q), max(used_k), causal=causal,
                                                   return_lse=True, backend="portable")
    assert torch.equal(out[keep_q], want) and torch.equal(lse[:, keep_q], want_lse)
    unused = torch.ones(sum(lens_q), dtype=torch.bool, device=device)
    unused[keep_q] = False
    assert unused.sum() == sum(lens_q) - sum(used_q)
    assert (out[unused] == 0).all() and torch.isneginf(lse[:, unused]).all(), "rows past seqused_q"


@pytest.mark.parametrize("varlen", [False, True])
def test_seqused_at_full_length_changes_nothing(device, varlen):
    """FA3's varlen tests pass ``seqused`` equal to the lengths: the same bits as without it, on the same kernel
    (``seqused`` calls run on the portable one; without it a GPU may take the Hopper kernel)."""
    if varlen:
        lens_q, lens_k = [37, 0, 64], [45, 3, 64]
        q, k, v = (_rand((sum(n), h, 64), device) for n, h in ((lens_q, 4), (lens_k, 2), (lens_k, 2)))
        cu = (cu_seqlens(lens_q, device), cu_seqlens(lens_k, device), max(lens_q), max(lens_k))
        used = dict(seqused_q=torch.tensor(lens_q, dtype=I32, device=device),
                    seqused_k=torch.tensor(lens_k, dtype=I32, device=device))
        call = lambda **kw: leanfa.flash_attn_varlen_func(q, k, v, *cu, causal=True, return_lse=True, **kw)  # noqa: E731
    else:
        q, k, v = _rand((2, 45, 4, 64), device), _rand((2, 61, 2, 64), device), _rand((2, 61, 2, 64), device)
        used = dict(seqused_q=torch.full((2,), 45, dtype=I32, device=device),
                    seqused_k=torch.full((2,), 61, dtype=I32, device=device))
        call = lambda **kw: leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True, **kw)  # noqa: E731
    out, lse = call(**used)
    want, want_lse = call(backend="portable")
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_fa3_drop_in_seqused(device):
    """FA3's names pass seqused through, varlen and (both cu_seqlens None) dense."""
    lens = [30, 41]
    q, k, v = (_rand((sum(lens), h, 64), device) for h in (4, 2, 2))
    cu = cu_seqlens(lens, device)
    uq, uk = torch.tensor([30, 7], dtype=I32, device=device), torch.tensor([12, 41], dtype=I32, device=device)
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 41, 41, seqused_q=uq, seqused_k=uk, causal=True,
                                          return_attn_probs=True)
    want, want_lse = leanfa.flash_attn_varlen_func(q, k, v, cu, cu, 41, 41, causal=True, return_lse=True,
                                                   seqused_q=uq, seqused_k=uk)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    qd, kd, vd = (_rand((2, 41, h, 64), device) for h in (4, 2, 2))
    out = fa3.flash_attn_varlen_func(qd, kd, vd, None, None, None, None, seqused_k=uk, causal=True)
    ref = torch.stack([attention_ref(qd[b:b + 1], kd[b:b + 1, :n], vd[b:b + 1, :n], causal=True)[0]
                       for b, n in enumerate(uk.tolist())])
    assert out.shape == (2, 41, 4, 64) and rel_l2(out, ref) < TOL[BF16]


def test_hopper_dispatch_refuses_seqused_with_one_warning(monkeypatch):
    """Where the Hopper kernel would run a call, a call with seqused runs on the portable kernel instead,
    with one warning per process; without seqused the Hopper verdict stands."""
    dispatch = hopper_accepts_everything(monkeypatch)
    q = torch.zeros(1, 8, 2, 64, dtype=BF16)
    used = torch.tensor([5], dtype=I32)
    plain = Problem(q=q, k=q, v=q, batch=1, heads=2, kv_heads=2, head_dim_qk=64, head_dim_v=64,
                    max_seqlen_q=8, max_seqlen_k=8, cu_seqlens_q=None, cu_seqlens_k=None, causal=True,
                    softmax_scale=0.125, q_scale=None, k_scale=None, v_scale=None, k_mean=None,
                    out_dtype=BF16, return_lse=False)
    assert dispatch.hopper_applies(plain) == (True, "")
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_VALIDATED", False)  # (seqused_k: until its GPU validation)
    with pytest.warns(UserWarning, match="seqused_k on the Hopper kernel is not yet validated"):
        ok, why = dispatch.hopper_applies(dataclasses.replace(plain, seqused_k=used))
    assert not ok and "portable kernel" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second refusal is silent
        assert not dispatch.hopper_applies(dataclasses.replace(plain, seqused_k=used))[0]
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_Q_VALIDATED", False)  # (seqused_q: until its GPU validation)
    with pytest.warns(UserWarning, match="seqused_q on the Hopper kernel is not yet validated"):
        assert not dispatch.hopper_applies(dataclasses.replace(plain, seqused_q=used))[0]
