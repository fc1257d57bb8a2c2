"""The Hopper kernel's host path. The plan cache (:mod:`leanfa.kernels.hopper.plan_cache`): a plan bound from a template equals the
plan ``make_plan`` builds for the same inputs, argument by argument; what must not be cached is not; the
template keeps no tensor alive. On an sm90 GPU: the cached launch (Triton's compiled kernel called directly)
gives the uncached launch's output bit for bit. Dispatch: which calls ``backend="auto"`` sends elsewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import leanfa
from helpers import FakeCompiled
from leanfa.api import _build_problem

hopper = pytest.importorskip("leanfa.kernels.hopper")
from leanfa.kernels.hopper import launch as L  # noqa: E402
from leanfa.kernels.hopper import plan_cache  # noqa: E402
from leanfa.kernels.hopper.plan_cache import TensorDescriptor  # noqa: E402

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
DEV = "cuda" if ON_SM90 else "cpu"


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the API's device check accepts CPU tensors
    for k in plan_cache.KNOBS:
        monkeypatch.delenv(k, raising=False)
    hopper.PLANS.clear()
    yield
    hopper.PLANS.clear()


def _inputs(B, S, H, Hkv, dqk, dv, fp8, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, dqk, generator=g)
    k = torch.randn(B, S, Hkv, dqk, generator=g)
    v = torch.randn(B, S, Hkv, dv, generator=g)
    q, k, v = (t.to(DEV, torch.bfloat16) for t in (q, k, v))
    if not fp8:
        return (q, k, v), {}
    qq = leanfa.quantize_fp8(q, k, v)
    return (qq.q, qq.k, qq.v), qq.descales()


def _problem(tensors, kw, causal=True, lse=False):
    q, k, v = tensors
    kw = {"q_descale": None, "k_descale": None, "v_descale": None, "k_mean": None, **kw}
    return _build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                          max_seqlen_k=None, softmax_scale=None, causal=causal, return_lse=lse, out_dtype=None, **kw)


def _fresh_plan(p, out, lse):
    return L.make_plan(p.q, p.k, p.v, out, lse, p.q_scale, p.k_scale, p.v_scale, p.k_mean, causal=p.causal,
                       softmax_scale=p.softmax_scale, return_lse=p.return_lse)


def _same_tensor(a, b, copies: bool) -> bool:
    """``a`` is ``b``, or (``copies``: a tensor the plan prepares per call, a view or a copy) the same layout over
    the same memory or equal bytes."""
    if a is b:
        return True
    if not copies or not isinstance(a, torch.Tensor) or (a.shape, a.stride(), a.dtype) != (b.shape, b.stride(), b.dtype):
        return False
    return a.data_ptr() == b.data_ptr() or torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_same_plan(bound, fresh, copies=False):
    assert bound.constexprs == fresh.constexprs and bound.grid == fresh.grid and bound.kernel is fresh.kernel
    assert len(bound.args) == len(fresh.args)
    for i, (a, b) in enumerate(zip(bound.args, fresh.args)):
        if isinstance(b, TensorDescriptor):
            assert isinstance(a, TensorDescriptor) and _same_tensor(a.base, b.base, copies), i
            assert (list(a.shape), list(a.strides), list(a.block_shape), a.layout, a.padding) == \
                   (list(b.shape), list(b.strides), list(b.block_shape), b.layout, b.padding), i
        elif isinstance(b, torch.Tensor):
            assert _same_tensor(a, b, copies), f"argument {i}: another tensor"
        else:
            assert type(a) is type(b) and a == b, f"argument {i}: {a!r} != {b!r}"


CASES = [  # B, S, H, Hkv, dqk, dv, fp8, causal, lse
    (2, 300, 4, 2, 128, 128, True, True, False),
    (1, 260, 8, 8, 128, 128, True, False, True),  # LSE with the K-mean term: one-tile grid, register stores
    (2, 257, 4, 1, 192, 128, True, True, False),
    (1, 200, 2, 2, 64, 64, False, True, True),
    (1, 130, 4, 2, 128, 128, False, False, False),
]


@pytest.mark.parametrize("case", CASES)
def test_bound_plan_equals_make_plan(case):
    B, S, H, Hkv, dqk, dv, fp8, causal, lse = case
    plans = []
    for seed in (0, 1, 2):  # the first call builds the template; the others bind fresh tensors into it
        p = _problem(*_inputs(B, S, H, Hkv, dqk, dv, fp8, seed), causal=causal, lse=lse)
        plan, out, lse_t = hopper.plan(p)
        plans.append(plan)
        assert plan.template is not None
        _assert_same_plan(plan, _fresh_plan(p, out, lse_t))
    assert plans[1].template is plans[2].template is plans[0].template
    assert len(hopper.PLANS._templates) == 1


def _varlen_inputs(lens, H, Hkv, d, fp8, seed):
    """Packed ``(q, k, v, cu_seqlens, max_seqlen, descale keywords)`` (one cu_seqlens for queries and keys)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, generator=g).to(DEV, torch.bfloat16) for h in (H, Hkv, Hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    if not fp8:
        return q, k, v, cu, max(lens), {}
    qq = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    return qq.q, qq.k, qq.v, cu, max(lens), qq.descales()


def _varlen_problem(lens, H, Hkv, d, fp8, seed, causal=True, lse=False):
    q, k, v, cu, mx, kw = _varlen_inputs(lens, H, Hkv, d, fp8, seed)
    kw = {"q_descale": None, "k_descale": None, "v_descale": None, "k_mean": None, **kw}
    return _build_problem(q, k, v, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                          softmax_scale=None, causal=causal, return_lse=lse, out_dtype=None, **kw)


def _fresh_varlen_plan(p, out, lse):
    return L.make_plan(p.q, p.k, p.v, out, lse, p.q_scale, p.k_scale, p.v_scale, p.k_mean, causal=p.causal,
                       softmax_scale=p.softmax_scale, return_lse=p.return_lse, cu_seqlens_q=p.cu_seqlens_q,
                       cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q, max_seqlen_k=p.max_seqlen_k,
                       cu_seqlens_v=p.cu_seqlens_v)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("lse", [False, True])
def test_prepared_inputs_cached_only_when_enabled(fp8, lse, monkeypatch):
    """Varlen calls (packed tensors viewed as a batch of one; FP8: quantize_fp8's aligned V) keep a template by
    default (PREPARED_VALIDATED, H200 run 53) or with LEANFA_HOPPER_PLAN_CACHE=2, not with =1: a bound plan
    equals make_plan's for fresh inputs of the same signature, its re-packed V made from this call's V."""
    assert hopper.plan_cache.PREPARED_VALIDATED
    monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "1")
    p = _varlen_problem([300, 90, 1, 200], 4, 2, 128, fp8, 0, lse=lse)
    assert hopper.plan(p)[0].template is None
    monkeypatch.delenv("LEANFA_HOPPER_PLAN_CACHE")
    for seed in (0, 1, 2):
        p = _varlen_problem([300, 90, 1, 200], 4, 2, 128, fp8, seed, lse=lse)
        plan, out, lse_t = hopper.plan(p)
        assert plan.template is not None
        _assert_same_plan(plan, _fresh_varlen_plan(p, out, lse_t), copies=True)
    assert len(hopper.PLANS._templates) == 1
    # other lengths with the same total and batch are another max_seqlen: another plan
    p = _varlen_problem([100, 290, 1, 200], 4, 2, 128, fp8, 0, lse=lse)
    plan, out, lse_t = hopper.plan(p)
    _assert_same_plan(plan, _fresh_varlen_plan(p, out, lse_t), copies=True)
    assert len(hopper.PLANS._templates) == 2


@pytest.mark.parametrize("fp8", [True, False])
def test_varlen_grid_default(fp8, monkeypatch):
    """Varlen runs one program per SM by default, FP8 and BF16 (H200 run 76: 1.00-1.34x the tile table's
    one-program-per-slot grid); LEANFA_HOPPER_PERSISTENT=0 gives that grid: one program per slot of the table,
    its capacity (591 tokens in 4 sequences: 591 // 128 + 4 = 8 pairs) times the 4 query heads."""
    monkeypatch.delenv("LEANFA_HOPPER_PERSISTENT", raising=False)
    p = _varlen_problem([300, 90, 1, 200], 4, 2, 128, fp8, 0)
    plan = hopper.plan(p)[0]
    sms = L._num_sms(p.q.device)  # the CPU stands for 3 SMs
    assert plan.constexprs["PERSISTENT"] and plan.grid == (min(8 * 4, sms), )
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    plan = hopper.plan(p)[0]
    assert not plan.constexprs["PERSISTENT"] and plan.grid == (8 * 4, )


def test_token_major_fp8_v_cached_when_enabled(monkeypatch):
    monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "2")
    for seed in (0, 1):
        (q, k, v), kw = _inputs(1, 300, 4, 4, 128, 128, True, seed)
        p = _problem((q, k, v.contiguous()), kw)  # token-major: the plan transposes a copy every call
        plan, out, lse = hopper.plan(p)
        assert plan.template is not None
        _assert_same_plan(plan, _fresh_plan(p, out, lse), copies=True)


def test_template_keeps_no_tensor():
    p = _problem(*_inputs(1, 300, 4, 4, 128, 128, True, 0))
    plan, _, _ = hopper.plan(p)
    bare = plan.template.plan
    assert not any(isinstance(a, torch.Tensor) for a in bare.args)
    assert all(a.base is None for a in bare.args if isinstance(a, TensorDescriptor))


def test_signature_changes_rebuild():
    """Another shape, stride, alignment, scalar or knob is another plan."""
    tensors, kw = _inputs(1, 300, 4, 4, 128, 128, True, 0)
    base, _, _ = hopper.plan(_problem(tensors, kw))
    assert hopper.plan(_problem(tensors, kw, causal=False))[0].template is not base.template
    assert hopper.plan(_problem(*_inputs(1, 301, 4, 4, 128, 128, True, 0)))[0].template is not base.template
    q, k, v = tensors
    q2 = torch.empty(q.shape[0], q.shape[1], q.shape[2], 2 * q.shape[3], dtype=q.dtype, device=q.device)[..., :128]
    q2.copy_(q)  # same shape, other strides
    assert hopper.plan(_problem((q2, k, v), kw))[0].template is not base.template
    assert len(hopper.PLANS._templates) == 4


def test_knob_change_rebuilds(monkeypatch):
    tensors, kw = _inputs(1, 300, 4, 4, 128, 128, True, 0)
    plan, _, _ = hopper.plan(_problem(tensors, kw))
    assert plan.constexprs["PERSISTENT"]
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    plan0, _, _ = hopper.plan(_problem(tensors, kw))
    assert not plan0.constexprs["PERSISTENT"] and plan0.template is not plan.template
    monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "0")
    assert hopper.plan(_problem(tensors, kw))[0].template is None


def test_copies_are_not_cached_and_aliases_get_their_own_plan(monkeypatch):
    # FP8 V token-major: the plan transposes a copy of V every call (kept only with plans over prepared inputs,
    # the default; not with LEANFA_HOPPER_PLAN_CACHE=1)
    monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "1")
    (q, k, v), kw = _inputs(1, 300, 4, 4, 128, 128, True, 0)
    v_tok = v.contiguous()
    assert not L.v_is_kmajor(v_tok)
    assert hopper.plan(_problem((q, k, v_tok), kw))[0].template is None
    assert len(hopper.PLANS._templates) == 0
    monkeypatch.delenv("LEANFA_HOPPER_PLAN_CACHE")
    # one tensor as several inputs: a template of its own (an argument binds from the first input it was)
    (q, k, v), _ = _inputs(1, 300, 4, 4, 128, 128, False, 0)
    (q2, k2, v2), _ = _inputs(1, 300, 4, 4, 128, 128, False, 1)
    aliased = hopper.plan(_problem((q, q, q), {}))[0].template
    distinct = hopper.plan(_problem((q, k, v), {}))[0].template
    assert aliased is not None and distinct is not None and aliased is not distinct
    for tensors in ((q2, q2, q2), (q2, k2, v2), (k2, k2, v2)):
        p = _problem(tensors, {})
        plan, out, lse = hopper.plan(p)
        _assert_same_plan(plan, _fresh_plan(p, out, lse))
    assert len(hopper.PLANS._templates) == 3


@pytest.mark.parametrize("fp8", [True, False])
def test_cached_launch_passes_every_parameter(fp8, monkeypatch):
    """After the first launch (Triton's JIT, faked: it returns the compiled kernel), a bound plan calls the
    compiled kernel with the plan's arguments followed by each remaining parameter as Triton's binder binds it
    (the constexpr keywords, ``num_warps`` included, else the default), on a three-dimensional grid."""
    fake = FakeCompiled()
    jit_calls = []

    class _Jit:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getattr__(self, name):  # params, arg_names: the real kernel's
            return getattr(self.kernel, name)

        def __getitem__(self, grid):
            def run(*args, **kw):
                jit_calls.append((grid, args, kw))
                return fake
            return run

    plans = [hopper.plan(_problem(*_inputs(1, 300, 4, 4, 128, 128, fp8, s)))[0] for s in (0, 1)]
    kernel = plans[0].kernel
    monkeypatch.setattr(L.Plan, "kernel", property(lambda self: _Jit(kernel)))
    L.launch(plans[0])
    assert len(jit_calls) == 1 and not fake.calls
    L.launch(plans[1])
    (grid, args), = fake.calls
    assert grid == (*plans[1].grid, 1, 1)[:3]
    names = [p.name for p in kernel.params]
    assert len(args) == len(names)
    assert all(a is b for a, b in zip(args, plans[1].args))
    bound = dict(zip(names, args))
    _, _, jit_kw = jit_calls[0]
    for n in names[len(plans[1].args):]:
        assert bound[n] == jit_kw[n] if n in jit_kw else bound[n] == kernel.params[names.index(n)].default, n


def test_knob_list_covers_the_plan():
    pkg = Path(L.__file__).parent
    src = "".join(f.read_text() for f in [*pkg.glob("*.py"), pkg.parent / "dispatch.py"])
    used = set(re.findall(r"LEANFA_HOPPER_[A-Z0-9_]*[A-Z0-9]", src))
    assert used <= set(plan_cache.KNOBS), sorted(used - set(plan_cache.KNOBS))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_cached_launch_equals_uncached(fp8, causal, monkeypatch):
    """The second and later calls of a signature launch Triton's compiled kernel directly: their outputs
    (poisoned first) equal the uncached launch's bit for bit, for fresh inputs each call."""
    monkeypatch.setenv("LEANFA_POISON_OUTPUTS", "1")
    for seed in range(3):
        tensors, kw = _inputs(2, 700, 8, 2, 128, 128, fp8, seed)
        monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "1")
        got = leanfa.flash_attn_func(*tensors, causal=causal, return_lse=True, backend="hopper", **kw)
        monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "0")
        want = leanfa.flash_attn_func(*tensors, causal=causal, return_lse=True, backend="hopper", **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
        assert not torch.isnan(got[0]).any()
    (template,) = hopper.PLANS._templates.values()
    assert template.compiled is not None  # the later calls took the direct launch


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("form", ["varlen", "token-major-v"])
def test_cached_launch_of_prepared_inputs_equals_uncached(fp8, form, monkeypatch):
    """LEANFA_HOPPER_PLAN_CACHE=2 (plans over prepared inputs: varlen views, an FP8 V re-packed or transposed per
    call): outputs and LSE equal the uncached launch's bit for bit, for fresh inputs each call (H200 run 53:
    passed; PREPARED_VALIDATED since)."""
    if form == "token-major-v" and not fp8:
        pytest.skip("a BF16 V is read as it is")
    monkeypatch.setenv("LEANFA_POISON_OUTPUTS", "1")
    lens = [700, 130, 1, 1000, 77]
    for seed in range(3):
        if form == "varlen":
            q, k, v, cu, mx, kw = _varlen_inputs(lens, 8, 2, 128, fp8, seed)
            call = lambda: leanfa.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True,  # noqa: E731
                                                         return_lse=True, backend="hopper", **kw)
        else:
            (q, k, v), kw = _inputs(2, 700, 8, 2, 128, 128, True, seed)
            call = lambda: leanfa.flash_attn_func(q, k, v.contiguous(), causal=True, return_lse=True,  # noqa: E731
                                                  backend="hopper", **kw)
        monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "2")
        got = call()
        monkeypatch.setenv("LEANFA_HOPPER_PLAN_CACHE", "0")
        want = call()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
        assert not torch.isnan(got[0]).any()
    (template,) = hopper.PLANS._templates.values()
    assert template.compiled is not None


@pytest.mark.skipif(not leanfa._versions.triton_gpu_validated(), reason="fakes both kernels' results, which the self-check of a "
                    "Triton that is not GPU-validated compares (tests/test_toolchains.py covers that dispatch)")
@pytest.mark.parametrize("fp8,d,backend,want", [(True, 64, "auto", "portable"), (True, 64, "hopper", "hopper"),
                                                (False, 64, "auto", "hopper"), (True, 128, "auto", "hopper")])
def test_auto_sends_fp8_d64_to_the_portable_kernel(fp8, d, backend, want, monkeypatch):
    """``backend="auto"``: FP8 at head dim 64 runs on the portable kernel, measured 1.06-1.10x faster there
    (runs 49, 51); ``backend="hopper"`` still runs it on the Hopper kernel, BF16 d64 and FP8 d128 stay there."""
    from leanfa.kernels import dispatch

    monkeypatch.setattr(dispatch._versions, "check", lambda: True)
    monkeypatch.setattr(hopper, "supports", lambda p: (True, ""))
    monkeypatch.setattr(hopper, "run", lambda p: "hopper")
    monkeypatch.setattr(dispatch.portable, "run", lambda p: "portable")
    assert dispatch.run(_problem(*_inputs(1, 64, 2, 2, d, d, fp8, 0)), backend) == want
