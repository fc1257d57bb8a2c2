"""FA3's ``seqused_k`` on the Hopper kernel (issue 25 item 2), and vLLM's FA3 prefill call: packed queries over paged
caches with ``cu_seqlens_k=None``, the key lengths from ``seqused_k`` (the kernel reads them as ``cu_seqlens_k``:
:func:`leanfa.kernels.hopper.launch.paged_keys`); packed K with ``cu_seqlens_k`` and ``seqused_k`` (FA3's varlen
tests) and dense K through the kernel's ``seqused_k`` argument.

On the CPU the kernel's own source runs in the emulator through the real host plan, against the float64 reference and
(paged) the bits of the same batch over contiguous K/V. Cache pages no sequence may read, and table entries past each
sequence's used pages, hold NaN; keys of a packed or dense K past ``seqused_k`` hold a large finite value (read in the
last key block, masked: ignoring ``seqused_k`` attends them). Outputs are poisoned with NaN. The ``gpu`` tests run the
real kernel on sm90; they are the check that turns :data:`leanfa.kernels.dispatch.HOPPER_SEQUSED_VALIDATED` on.
"""

from __future__ import annotations

import math

import pytest
import torch

import leanfa
from leanfa.reference import attention_ref
from helpers import TOL, cu_seqlens, mutated, poison_empty, rel_l2
from test_hopper_paged import TAIL, _caches, _problem

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
I32 = torch.int32

emulation = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation test (runs where there is no GPU)")

#: (query lengths, used key lengths): chunks (Sq < Sk) ending mid-page, a whole prompt, an empty chunk, a sequence with
#: no key (seqused_k = 0, no query either: vLLM pads its batch so), a one-token chunk
LENS = ([40, 130, 0, 0, 1, 77], [300, 130, 50, 0, 129, 333])


def _e4m3(t):
    return t.float().clamp(-448, 448).to(FP8)


def _vllm_batch(lens_q, lens_k, hq, hkv, d, page_size, seed=0, device="cpu", fp8=False, extra_pages=1):
    """vLLM's call: packed q, paged caches whose table rows hold ``extra_pages`` more entries than the longest
    sequence needs (pointing at a NaN page), ``seqused_k`` the lengths; and the same batch as packed contiguous K/V
    with ``cu_seqlens_k`` (the Hopper kernel's existing paged form reads the same key blocks)."""
    gen = torch.Generator().manual_seed(seed)
    ks = [(torch.randn((n, hkv, d), generator=gen) + 0.5).to(BF16) for n in lens_k]  # (the caches are BF16 first)
    vs = [torch.randn((n, hkv, d), generator=gen).to(BF16) for n in lens_k]
    kc, vc, table = _caches(ks, vs, page_size, gen)
    if extra_pages > 1:
        table = torch.cat([table, table[:, -1:].expand(-1, extra_pages - 1)], 1).contiguous()
    q = torch.randn((sum(lens_q), hq, d), generator=gen)
    k, v = torch.cat(ks), torch.cat(vs)
    cast = _e4m3 if fp8 else (lambda t: t.to(BF16))
    q, kc, vc, k, v = (cast(t).to(device) for t in (q, kc, vc, k, v))
    table = table.to(device)
    cu_q = cu_seqlens(lens_q, device)
    used = torch.tensor(lens_k, dtype=I32, device=device)
    return q, kc, vc, table, cu_q, used, k, v


def _vllm_problems(lens_q, lens_k, hq, hkv, d, page_size, causal=True, window=(-1, -1), softcap=0.0, **kw):
    q, kc, vc, table, cu_q, used, k, v = _vllm_batch(lens_q, lens_k, hq, hkv, d, page_size, **kw)
    common = dict(window_size=window, softcap=softcap, varlen=True, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q))
    paged = _problem(q, kc, vc, causal, cu_seqlens_k=None, page_table=table, seqused_k=used, **common)
    contiguous = _problem(q, k, v, causal, cu_seqlens_k=cu_seqlens(lens_k, q.device),
                          max_seqlen_k=max(max(lens_k), 1), **common)
    return paged, contiguous


def _ref(p):
    return attention_ref(p.q, p.k, p.v, causal=p.causal, return_lse=True, cu_seqlens_q=p.cu_seqlens_q,
                         cu_seqlens_k=p.cu_seqlens_k, page_table=p.page_table, seqlens_k=p.seqused_k,
                         window_size=(p.window_left, p.window_right), softcap=p.softcap)


def _check_ref(out, lse, p, tol):
    ref, ref_lse = _ref(p)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN (unwritten, or a page not to read)"
    assert rel_l2(out, ref) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < (1e-2 if p.is_fp8 else 1e-3)


def _emulate_and_check(p, contiguous=None, tol=1e-2):
    from leanfa.kernels.hopper.emulate import emulate

    out, lse, _ = emulate(p)
    _check_ref(out, lse, p, tol)
    if contiguous is not None:
        want, want_lse, _ = emulate(contiguous)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), "not the contiguous call's bits"
    return out


# ----------------------------------------------------------------------------- emulated (CPU)

@emulation
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_emulated_vllm_call(page_size):
    """vLLM's FA3 prefill call (no cu_seqlens_k, seqused_k, block_table; GQA 2:1, causal chunks, a sequence with no
    key, table rows longer than the used pages): the reference, and the bits of the call with cu_seqlens_k."""
    _emulate_and_check(*_vllm_problems(*LENS, 4, 2, 64, page_size, seed=page_size, extra_pages=2))


@emulation
def test_emulated_vllm_call_window_softcap_persistent(monkeypatch):
    """A sliding window and softcap (Gemma-style), non-causal full-attention rows too, on the one-tile grid."""
    _emulate_and_check(*_vllm_problems(*LENS, 4, 2, 64, 64, window=(100, -1), softcap=30.0, seed=3))
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    _emulate_and_check(*_vllm_problems([65, 200], [300, 200], 2, 1, 128, 64, causal=False, seed=4))


@emulation
@pytest.mark.parametrize("page_size", [16, 128])
def test_emulated_vllm_call_fp8(page_size):
    """FP8 caches: K page by page, V from the transposed copy of each sequence's ``seqused_k`` keys
    (:func:`leanfa.kernels.paged_v.gather_paged_v` over :func:`leanfa.kernels.hopper.launch.paged_key_offsets`)."""
    _emulate_and_check(*_vllm_problems(*LENS, 4, 2, 64, page_size, seed=page_size + 1, fp8=True, extra_pages=2),
                       tol=4e-2)


@emulation
def test_emulated_paged_no_cu_seqlens_k_no_seqused():
    """Packed q over pages with neither cu_seqlens_k nor seqused_k: every sequence has the table's capacity."""
    lens_q, lens_k, page = [30, 100], [128, 192], 64  # every sequence fills its pages (capacity = 192 keys)
    q, kc, vc, table, cu_q, _, _, _ = _vllm_batch(lens_q, lens_k, 2, 1, 64, page, seed=5)
    table = table[:, :3].contiguous()  # (no spare entry: the capacity is 3 pages)
    table[0, 2] = table[1, 2]  # sequence 0 reads sequence 1's third page as its own (any page of finite keys)
    p = _problem(q, kc, vc, True, varlen=True, cu_seqlens_q=cu_q, max_seqlen_q=100, cu_seqlens_k=None,
                 page_table=table)
    _emulate_and_check(p)


def _packed_tensors(lens_q, lens_k, used_k, hq, hkv, d, seed=0, fp8=False):
    """FA3's varlen form on the CPU: packed ``(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k)`` with
    ``seqused_k`` <= the lengths (keys past it hold a large finite value)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((sum(lens_q), hq, d), generator=gen)
    k = torch.randn((sum(lens_k), hkv, d), generator=gen) + 0.5
    v = torch.randn((sum(lens_k), hkv, d), generator=gen)
    cu_k = cu_seqlens(lens_k)
    for b, n in enumerate(used_k):
        k[int(cu_k[b]) + n:int(cu_k[b + 1])] = TAIL
        v[int(cu_k[b]) + n:int(cu_k[b + 1])] = -TAIL
    cast = _e4m3 if fp8 else (lambda t: t.to(BF16))
    q, k, v = (cast(t) for t in (q, k, v))
    return q, k, v, cu_seqlens(lens_q), cu_k, torch.tensor(used_k, dtype=I32)


def _packed_batch(lens_q, lens_k, used_k, hq, hkv, d, seed=0, fp8=False):
    """:func:`_packed_tensors` as the emulator's problem."""
    q, k, v, cu_q, cu_k, used = _packed_tensors(lens_q, lens_k, used_k, hq, hkv, d, seed=seed, fp8=fp8)
    return _problem(q, k, v, True, varlen=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), seqused_k=used)


@emulation
@pytest.mark.parametrize("fp8", [False, True])
def test_emulated_varlen_seqused_k(fp8):
    """Packed K with cu_seqlens_k and seqused_k (equal to some lengths, smaller than others, 0 for one): the kernel's
    seqused_k argument and the tile table's."""
    p = _packed_batch([40, 200, 1, 77], [300, 200, 50, 333], [300, 150, 0, 140], 4, 2, 64, seed=6, fp8=fp8)
    _emulate_and_check(p, tol=4e-2 if fp8 else 1e-2)


def _nan_rows(x, rows):
    """NaN into the rows ``rows`` (a bool mask over dim 0) of ``x``, in place (e4m3's NaN byte for FP8)."""
    if x.dtype == FP8:
        x.view(torch.uint8)[rows] = 0x7F
    else:
        x[rows] = float("nan")


def _check_used_rows(out, lse, p, used_q, tol):
    """Rows past ``seqused_q`` written as 0 with LSE -inf (the emulator's outputs start as NaN, and the callers put NaN
    in those rows' queries: whatever they compute must stay out), the used rows equal to the float64 reference of the
    sequences cut to them (causal aligned on that count)."""
    if p.varlen:
        lens = (p.cu_seqlens_q[1:] - p.cu_seqlens_q[:-1]).tolist()
        keep = torch.cat([torch.arange(n) < u for n, u in zip(lens, used_q)])
        ref, ref_lse = attention_ref(p.q[keep], p.k, p.v, causal=p.causal, return_lse=True,
                                     cu_seqlens_q=cu_seqlens(used_q), cu_seqlens_k=p.cu_seqlens_k,
                                     seqlens_k=p.seqused_k, window_size=(p.window_left, p.window_right))
        got, got_lse, rest, rest_lse = out[keep], lse[:, keep], out[~keep], lse[:, ~keep]
    else:
        keep = torch.arange(p.max_seqlen_q)[None, :] < torch.tensor(used_q)[:, None]
        refs = [attention_ref(p.q[b:b + 1, :u], p.k[b:b + 1], p.v[b:b + 1], causal=p.causal, return_lse=True,
                              seqlens_k=None if p.seqused_k is None else p.seqused_k[b:b + 1])
                for b, u in enumerate(used_q)]
        ref, ref_lse = torch.cat([r[0][0] for r in refs]), torch.cat([r[1][0] for r in refs], 1)
        got, got_lse = out[keep], lse.transpose(1, 2)[keep].T
        rest, rest_lse = out[~keep], lse.transpose(1, 2)[~keep]
    assert (rest == 0).all() and torch.isneginf(rest_lse).all(), "rows past seqused_q must be 0 with LSE -inf"
    assert not torch.isnan(got).any() and not torch.isnan(got_lse).any(), "a used row left unwritten"
    assert rel_l2(got, ref) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(got_lse), ~fin)
    assert float((got_lse.double() - ref_lse)[fin].abs().max()) < (1e-2 if p.is_fp8 else 1e-3)


@emulation
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_emulated_varlen_seqused_q(fp8, causal):
    """Packed q with seqused_q (equal to a length, smaller, 0, on an empty sequence) and seqused_k (FA3's varlen
    tests pass both): only the used rows are computed and written, causal aligned on their count."""
    lens_q, lens_k, used_k, used_q = [40, 130, 0, 77, 1], [300, 130, 50, 333, 129], [300, 100, 50, 333, 0], \
        [40, 70, 0, 0, 1]
    q, k, v, cu_q, cu_k, used = _packed_tensors(lens_q, lens_k, used_k, 4, 2, 64, seed=20 + fp8, fp8=fp8)
    _nan_rows(q, torch.cat([torch.arange(n) >= u for n, u in zip(lens_q, used_q)]))  # (unused rows: garbage)
    p = _problem(q, k, v, causal, varlen=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                 max_seqlen_k=max(lens_k), seqused_k=used, seqused_q=torch.tensor(used_q, dtype=I32))
    from leanfa.kernels.hopper.emulate import emulate

    out, lse, _ = emulate(p)
    _check_used_rows(out, lse, p, used_q, 4e-2 if fp8 else 1e-2)


@emulation
@pytest.mark.parametrize("fp8", [False, True])
def test_emulated_dense_seqused_q(fp8):
    """Dense q with seqused_q (a whole sequence, a cut one whose last used row sits inside a 64-row box), causal:
    the output leaves as it does without seqused_q (whole TMA boxes where the call has them), the box's rows past
    the used count as 0."""
    gen = torch.Generator().manual_seed(21)
    cast = _e4m3 if fp8 else (lambda t: t.to(BF16))
    q = cast(torch.randn((2, 150, 2, 64), generator=gen))
    k = cast(torch.randn((2, 200, 1, 64), generator=gen))
    v = cast(torch.randn((2, 200, 1, 64), generator=gen))
    used_q = [150, 37]
    _nan_rows(q[1], torch.arange(150) >= 37)  # (unused rows: garbage)
    p = _problem(q, k, v, True, seqused_q=torch.tensor(used_q, dtype=I32))
    from leanfa.kernels.hopper import launch
    from leanfa.kernels.hopper.emulate import emulate

    plans = [launch.make_plan(q, k, v, torch.empty((2, 150, 2, 64), dtype=BF16), None, p.q_scale, p.k_scale,
                              p.v_scale, None, causal=True, softmax_scale=0.125, return_lse=False, seqused_q=used)
             for used in (p.seqused_q, None)]
    assert plans[0].constexprs["STORE_TMA"] == plans[1].constexprs["STORE_TMA"]
    out, lse, _ = emulate(p)
    _check_used_rows(out, lse, p, used_q, 4e-2 if fp8 else 1e-2)


@emulation
def test_emulated_dense_seqused_k():
    """Dense q/k with seqused_k (the dense grid's sequence bounds), non-causal and causal."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn((2, 70, 2, 64), generator=gen).to(BF16)
    k = (torch.randn((2, 200, 1, 64), generator=gen) + 0.5)
    k[0, 130:] = TAIL
    k = k.to(BF16)
    v = torch.randn((2, 200, 1, 64), generator=gen).to(BF16)
    for causal in (False, True):
        p = _problem(q, k, v, causal, seqused_k=torch.tensor([130, 200], dtype=I32))
        _emulate_and_check(p)


def _mutated_fails(fn, edits, p):
    """``fn`` with each ``(old, new)`` of ``edits`` made makes the emulated call ``p`` fail."""
    from leanfa.kernels.hopper.emulate import EmulationError, emulate

    with mutated(fn, edits):
        try:
            out, lse, _ = emulate(p)
        except EmulationError:
            return
        with pytest.raises(AssertionError):
            _check_ref(out, lse, p, 1e-2)


@emulation
def test_emulated_mutation_ignoring_seqused_k_caught():
    """The kernel's _tile ignoring seqused_k fails the packed and dense checks."""
    from leanfa.kernels.hopper import kernel_pingpong

    edit = [("seqlen_k = gl.minimum(gl.load(seqused_k + b), seqlen_k)", "seqlen_k = seqlen_k")]
    _mutated_fails(kernel_pingpong._tile, edit, _packed_batch([40, 200], [300, 200], [120, 150], 2, 1, 64, seed=8))
    gen = torch.Generator().manual_seed(9)
    k = torch.randn((1, 200, 1, 64), generator=gen)
    k[:, 100:] = TAIL
    p = _problem(torch.randn((1, 64, 2, 64), generator=gen).to(BF16), k.to(BF16),
                 torch.randn((1, 200, 1, 64), generator=gen).to(BF16), False, seqused_k=torch.tensor([100], dtype=I32))
    _mutated_fails(kernel_pingpong._tile, edit, p)


@emulation
def test_paged_key_offsets_and_mutation():
    """The paged lengths: capacity, cu_seqlens_k's, cut by seqused_k; vLLM's call built with the capacity instead of
    seqused_k reads the NaN table entries past the used pages."""
    from leanfa.kernels.hopper import launch

    table = torch.zeros((3, 4), dtype=I32)
    assert launch.paged_key_offsets(table, 16).tolist() == [0, 64, 128, 192]
    used = torch.tensor([5, 64, 0], dtype=I32)
    assert launch.paged_key_offsets(table, 16, seqused_k=used).tolist() == [0, 5, 69, 69]
    cu = torch.tensor([0, 3, 40, 50], dtype=I32)
    assert launch.paged_key_offsets(table, 16, cu, used).tolist() == [0, 3, 40, 40]
    assert launch.paged_keys(None, 16, True, cu, used) == (cu, used)
    assert launch.paged_keys(table, 16, True, cu, None) == (cu, None)
    cu_k, used_k = launch.paged_keys(table, 16, False, None, used)  # dense: the kernel keeps seqused_k
    assert used_k is used and cu_k.tolist() == [0, 5, 69, 69]
    from leanfa.kernels.hopper.emulate import emulate

    p, _ = _vllm_problems(*LENS, 4, 2, 64, 64, seed=10, extra_pages=2)
    real = launch.paged_key_offsets
    try:
        launch.paged_key_offsets = lambda t, s, cu=None, used=None: real(t, s, cu, None)
        out, lse, _ = emulate(p)
        with pytest.raises(AssertionError):
            _check_ref(out, lse, p, 1e-2)
    finally:
        launch.paged_key_offsets = real


# ----------------------------------------------------------------------------- dispatch

@emulation  # (the problems are built from CPU tensors, which a GPU machine's API refuses)
def test_dispatch_gate(monkeypatch):
    """While HOPPER_SEQUSED_VALIDATED is off, backend="auto" keeps seqused_k calls and vLLM's paged call on the portable
    kernel (with the reason); backend="hopper" takes them; seqused_q likewise with HOPPER_SEQUSED_Q_VALIDATED."""
    import dataclasses

    from helpers import hopper_accepts_everything
    from leanfa.kernels import dispatch

    hopper_accepts_everything(monkeypatch)
    p, contiguous = _vllm_problems(*LENS, 4, 2, 64, 64, seed=11)
    packed = _packed_batch([40], [300], [100], 2, 1, 64)
    assert dispatch.choose(contiguous, "auto").kernel == "hopper"
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_VALIDATED", False)
    for prob in (p, dataclasses.replace(p, seqused_k=None), packed):
        with pytest.warns(UserWarning, match="not yet validated"):
            dispatch._WARNED.clear()
            assert dispatch.choose(prob, "auto").kernel == "portable"
        assert dispatch.choose(prob, "hopper").kernel == "hopper"
    with_q = dataclasses.replace(packed, seqused_q=torch.tensor([20], dtype=I32))
    dispatch._WARNED.clear()
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_VALIDATED", True)
    for prob in (p, packed):
        assert dispatch.choose(prob, "auto").kernel == "hopper"
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_Q_VALIDATED", False)
    with pytest.warns(UserWarning, match="seqused_q"):
        assert dispatch.choose(with_q, "auto").kernel == "portable"
    assert dispatch.choose(with_q, "hopper").kernel == "hopper"
    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_Q_VALIDATED", True)
    assert dispatch.choose(with_q, "auto").kernel == "hopper"


@emulation  # (the problems are built from CPU tensors, which a GPU machine's API refuses)
def test_supports_seqused_q_refuses_dense_cache(monkeypatch):
    """The Hopper kernel's own verdict (its device check stubbed out): seqused_k, seqused_q and vLLM's paged call are its calls;
    packed q over a dense per-sequence cache is not."""
    import dataclasses

    from leanfa.kernels import hopper

    monkeypatch.setattr(hopper, "device_problem", lambda p: "")
    packed = _packed_batch([40], [300], [100], 2, 1, 64)
    assert hopper._supports(packed) == (True, "")
    assert hopper._supports(_vllm_problems(*LENS, 4, 2, 64, 64)[0]) == (True, "")
    assert hopper._supports(dataclasses.replace(packed, seqused_q=torch.tensor([20], dtype=I32))) == (True, "")
    dense_cache = _problem(packed.q, packed.k[None, :300], packed.v[None, :300], True, varlen=True,
                           cu_seqlens_q=packed.cu_seqlens_q, max_seqlen_q=40, cu_seqlens_k=None)
    ok, why = hopper._supports(dense_cache)
    assert not ok and "per-sequence" in why


# ----------------------------------------------------------------------------- GPU (sm90)

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _gpu_vllm(page_size, fp8, causal=True, window=(-1, -1), softcap=0.0, d=128, seed=0):
    """A serving-sized vLLM batch on the GPU: chunked prefill (Sq < Sk), a whole prompt, decode-like one-token rows,
    a sequence with seqused_k = 0, table rows two pages longer than needed; GQA 4:1."""
    lens_q, lens_k = [512, 1000, 77, 0, 1, 2048], [3000, 1000, 4100, 0, 700, 2048]
    return _vllm_batch(lens_q, lens_k, 16, 4, d, page_size, seed=seed, device="cuda", fp8=fp8, extra_pages=3), \
        lens_q, lens_k


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("variant", ["causal", "window", "softcap", "full"])
def test_gpu_vllm_call(page_size, fp8, variant, monkeypatch):
    """vLLM's FA3 call through the drop-in (``flash_attn_interface.flash_attn_varlen_func``, ``block_table``,
    ``seqused_k``, no ``cu_seqlens_k``) on the Hopper kernel: the float64 reference, the portable kernel's same call,
    and the bits of the Hopper kernel's call with cu_seqlens_k (BF16; FP8: V gathered from the used pages)."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    from leanfa import flash_attn_interface as fa3

    causal = variant != "full"
    window = (256, -1) if variant == "window" else (-1, -1)
    softcap = 30.0 if variant == "softcap" else 0.0
    (q, kc, vc, table, cu_q, used, k, v), lens_q, lens_k = _gpu_vllm(page_size, fp8, seed=page_size + fp8)
    desc = {}
    if fp8:
        gen = torch.Generator(device="cuda").manual_seed(1)
        desc = {n: torch.rand((len(lens_q), 4), generator=gen, device="cuda") + 0.5
                for n in ("q_descale", "k_descale", "v_descale")}
    kw = dict(causal=causal, window_size=window, softcap=softcap, return_lse=True, **desc)
    poison_empty(monkeypatch)
    got, lse = leanfa.flash_attn_varlen_func(q, kc, vc, cu_q, None, max(lens_q), None, seqused_k=used,
                                             page_table=table, backend="hopper", **kw)
    assert not torch.isnan(got).any() and not torch.isnan(lse).any(), "an element left unwritten"
    ref, ref_lse = attention_ref(q, kc, vc, cu_seqlens_q=cu_q, page_table=table, seqlens_k=used,
                                 **{n: w for n, w in kw.items()})
    tol = TOL[FP8] if fp8 else TOL[BF16]
    assert rel_l2(got, ref) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < (1e-2 if fp8 else 1e-3)
    port, port_lse = leanfa.flash_attn_varlen_func(q, kc, vc, cu_q, None, max(lens_q), None, seqused_k=used,
                                                   page_table=table, backend="portable", **kw)
    assert rel_l2(got, port.float()) < 2 * tol
    cu_k = cu_seqlens(lens_k, "cuda")
    want, want_lse = leanfa.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), page_table=table,
                                                   backend="hopper", **kw)
    assert torch.equal(got, want) and torch.equal(lse, want_lse), "not the cu_seqlens_k call's bits"
    # the drop-in's vLLM form (block_table=, seqused_k=, cu_seqlens_k=None) takes the same path once the gate is on
    from leanfa.kernels import dispatch

    monkeypatch.setattr(dispatch, "HOPPER_SEQUSED_VALIDATED", True)
    drop = fa3.flash_attn_varlen_func(q, kc, vc, max_seqlen_q=max(lens_q), cu_seqlens_q=cu_q, max_seqlen_k=None,
                                      seqused_k=used, block_table=table, causal=causal, window_size=window,
                                      softcap=softcap, **desc)
    drop = drop[0] if isinstance(drop, tuple) else drop
    assert torch.equal(drop, got)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("smaller", [False, True])
def test_gpu_varlen_seqused_k(fp8, causal, smaller, monkeypatch):
    """FA3's varlen tests' form: packed K with cu_seqlens_k and seqused_k equal to, or smaller than, the lengths (keys
    past it finite): the reference and the portable kernel."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    lens_q, lens_k = [512, 1000, 77, 1, 2048], [3000, 1000, 4100, 700, 2048]
    used_k = [2000, 1000, 0, 333, 2048] if smaller else lens_k
    q, k, v, cu_q, cu_k, used = (t.cuda() for t in _packed_tensors(lens_q, lens_k, used_k, 16, 4, 128,
                                                                   seed=12 + fp8, fp8=fp8))
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    poison_empty(monkeypatch)
    got, lse = leanfa.flash_attn_varlen_func(*args, causal=causal, seqused_k=used, return_lse=True, backend="hopper")
    assert not torch.isnan(got).any() and not torch.isnan(lse).any(), "an element left unwritten"
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 seqlens_k=used)
    tol = TOL[FP8] if fp8 else TOL[BF16]
    assert rel_l2(got, ref) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < (1e-2 if fp8 else 1e-3)
    port = leanfa.flash_attn_varlen_func(*args, causal=causal, seqused_k=used, backend="portable")
    assert rel_l2(got, port.float()) < 2 * tol


@pytest.mark.gpu
def test_gpu_dense_seqused_k(monkeypatch):
    """Dense q/k with seqused_k, BF16 and FP8, causal: the reference and the portable kernel."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    gen = torch.Generator(device="cuda").manual_seed(13)
    used = torch.tensor([1000, 4096, 0, 1], dtype=I32, device="cuda")
    poison_empty(monkeypatch)
    for dtype in (BF16, FP8):
        q = torch.randn((4, 1024, 8, 128), generator=gen, device="cuda").to(dtype)
        k = torch.randn((4, 4096, 2, 128), generator=gen, device="cuda").to(dtype)
        v = torch.randn((4, 4096, 2, 128), generator=gen, device="cuda").to(dtype)
        got = leanfa.flash_attn_func(q, k, v, causal=True, seqused_k=used, backend="hopper")
        assert not torch.isnan(got).any(), "an element left unwritten"
        ref = attention_ref(q, k, v, causal=True, seqlens_k=used)
        tol = TOL[FP8] if dtype == FP8 else TOL[BF16]
        assert rel_l2(got, ref) < tol
        port = leanfa.flash_attn_func(q, k, v, causal=True, seqused_k=used, backend="portable")
        assert rel_l2(got, port.float()) < 2 * tol


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("varlen", [True, False])
def test_gpu_seqused_q(fp8, causal, varlen, monkeypatch):
    """FA3's seqused_q on the Hopper kernel (backend="hopper"), with seqused_k: the used rows against the float64
    reference of the sequences cut to them and against the portable kernel; the rows past seqused_q 0 with LSE -inf
    (outputs poisoned through torch.empty)."""
    if not _sm90():
        pytest.skip("the Hopper kernel needs sm90")
    tol = TOL[FP8] if fp8 else TOL[BF16]
    poison_empty(monkeypatch)
    if varlen:
        lens_q, lens_k = [512, 1000, 77, 1, 2048], [3000, 1000, 4100, 700, 2048]
        used_q, used_k = [512, 600, 0, 1, 1500], [2000, 1000, 4100, 0, 2048]
        q, k, v, cu_q, cu_k, uk = (t.cuda() for t in _packed_tensors(lens_q, lens_k, used_k, 16, 4, 128,
                                                                      seed=30 + fp8, fp8=fp8))
        uq = torch.tensor(used_q, dtype=I32, device="cuda")
        call = lambda backend: leanfa.flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, seqused_q=uq, seqused_k=uk,
            return_lse=True, backend=backend)
        keep = torch.cat([torch.arange(n) < u for n, u in zip(lens_q, used_q)]).cuda()
        ref, ref_lse = attention_ref(q[keep], k, v, causal=causal, return_lse=True,
                                     cu_seqlens_q=cu_seqlens(used_q, "cuda"), cu_seqlens_k=cu_k, seqlens_k=uk)
        rows = lambda o, lse: (o[keep], lse[:, keep], o[~keep], lse[:, ~keep])  # noqa: E731
    else:
        gen = torch.Generator(device="cuda").manual_seed(31)
        dtype = FP8 if fp8 else BF16
        q = torch.randn((3, 1024, 8, 128), generator=gen, device="cuda").to(dtype)
        k = torch.randn((3, 2048, 2, 128), generator=gen, device="cuda").to(dtype)
        v = torch.randn((3, 2048, 2, 128), generator=gen, device="cuda").to(dtype)
        used_q, used_k = [1024, 333, 0], [2048, 1000, 77]
        uq, uk = (torch.tensor(x, dtype=I32, device="cuda") for x in (used_q, used_k))
        call = lambda backend: leanfa.flash_attn_func(q, k, v, causal=causal, seqused_q=uq, seqused_k=uk,  # noqa: E731
                                                      return_lse=True, backend=backend)
        keep = (torch.arange(1024)[None, :] < torch.tensor(used_q)[:, None]).cuda()
        refs = [attention_ref(q[b:b + 1, :u], k[b:b + 1], v[b:b + 1], causal=causal, return_lse=True,
                              seqlens_k=uk[b:b + 1]) for b, u in enumerate(used_q)]
        ref, ref_lse = torch.cat([r[0][0] for r in refs]), torch.cat([r[1][0] for r in refs], 1)
        rows = lambda o, lse: (o[keep], lse.transpose(1, 2)[keep].T, o[~keep],  # noqa: E731
                               lse.transpose(1, 2)[~keep])
    got, got_lse, rest, rest_lse = rows(*call("hopper"))
    assert (rest == 0).all() and torch.isneginf(rest_lse).all(), "rows past seqused_q must be 0 with LSE -inf"
    assert not torch.isnan(got).any() and not torch.isnan(got_lse).any(), "a used row left unwritten"
    assert rel_l2(got, ref) < tol
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(got_lse), ~fin)
    assert float((got_lse.double() - ref_lse)[fin].abs().max()) < (1e-2 if fp8 else 1e-3)
    port, port_lse, *_ = rows(*call("portable"))
    assert rel_l2(got, port.float()) < 2 * tol
