"""The single dispatch decision (leanfa/kernels/dispatch.py): which kernel runs a call and why, and where BF16
sink keys are attended. The Hopper package is faked (its verdicts, not its kernel), so these run with or without a GPU."""

from __future__ import annotations

import types

import pytest
import torch

from leanfa.api import _build_problem
from leanfa.kernels import dispatch


def _fake_hopper(ok=True, sink_dims=((64, 64), (128, 128)), on_gpu=False):
    """A Hopper package whose verdict is ``ok`` (or, for head dims outside its two, the head-dims refusal), on an
    sm90 GPU when ``on_gpu``."""
    dims = ((64, 64), (128, 128))
    reason = lambda d: f"head dims {d[0]}/{d[1]} not in the fake kernel"  # noqa: E731

    def supports(p):
        d = (p.head_dim_qk, p.head_dim_v)
        if d not in dims:
            return False, reason(d)
        return ok, "" if ok else "not on this GPU"
    return types.SimpleNamespace(
        supports=supports, HEAD_DIMS=dims, head_dims_reason=reason,
        device_problem=lambda p: "" if on_gpu else "no GPU here",
        sink_problem=lambda dims, keys: None if dims in sink_dims and keys == 128 else "unsupported sink",
    )


@pytest.mark.parametrize("on_gpu", [True, False])
def test_head_dims_only_the_portable_kernel_runs_warn_once_on_a_gpu(on_gpu, monkeypatch, gpu_validated):
    """A head dim the Hopper kernel lacks runs on the portable kernel; where the Hopper kernel runs other calls
    (an sm90 GPU) that is said once per process, elsewhere not at all."""
    monkeypatch.setattr(dispatch, "_hopper", lambda: _fake_hopper(True, on_gpu=on_gpu))
    monkeypatch.setattr(dispatch, "_WARNED", set())
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            choice = dispatch.choose(_problem(d=96), "auto")
            assert choice.kernel == "portable" and "96/96" in choice.why
        assert dispatch.choose(_problem(d=128), "auto").kernel == "hopper"
    said = [str(w.message) for w in caught if "96/96" in str(w.message)]
    assert len(said) == (1 if on_gpu else 0), said


def _problem(fp8=False, d=128):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (a CPU tensor is refused outside the interpreter)
    q = torch.randn(1, 32, 2, d, device=dev).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    return _build_problem(q, q, q, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                          max_seqlen_k=None, softmax_scale=None, causal=True, q_descale=None, k_descale=None,
                          v_descale=None, k_mean=None, return_lse=False, out_dtype=None)


@pytest.fixture
def gpu_validated(monkeypatch):
    monkeypatch.setattr(dispatch._versions, "check", lambda: True)
    monkeypatch.setattr(dispatch._versions, "triton_gpu_validated", lambda: True)


@pytest.mark.parametrize("backend,ok,fp8,d,want", [
    ("auto", True, False, 128, "hopper"), ("auto", True, True, 64, "portable"), ("auto", False, False, 128, "portable"),
    ("hopper", True, True, 64, "hopper"), ("portable", True, False, 128, "portable")])
def test_choose(backend, ok, fp8, d, want, monkeypatch, gpu_validated):
    monkeypatch.setattr(dispatch, "_hopper", lambda: _fake_hopper(ok))
    choice = dispatch.choose(_problem(fp8, d), backend)
    assert choice.kernel == want and choice.why
    if not ok:
        assert choice.why == "not on this GPU"


def test_choose_hopper_where_it_does_not_apply_raises(monkeypatch, gpu_validated):
    monkeypatch.setattr(dispatch, "_hopper", lambda: _fake_hopper(False))
    with pytest.raises(ValueError, match="backend='hopper' cannot run this call: not on this GPU"):
        dispatch.choose(_problem(), "hopper")


def test_choose_auto_stays_portable_on_an_unsupported_toolchain(monkeypatch):
    monkeypatch.setattr(dispatch._versions, "check", lambda: False)
    monkeypatch.setattr(dispatch, "_hopper", lambda: pytest.fail("the Hopper package was asked"))
    assert dispatch.choose(_problem(), "auto").kernel == "portable"


@pytest.mark.parametrize("backend,keys,dims,knob,want", [
    ("auto", 128, (128, 128), "1", "auto"), ("auto", 256, (128, 128), "1", "auto"),
    ("auto", 128, (128, 128), "0", "portable"), ("auto", 64, (128, 128), "1", None),
    ("portable", 128, (128, 128), "1", "portable"), ("portable", 100, (128, 128), "1", None),
    ("hopper", 128, (128, 128), "1", "hopper"), ("hopper", 128, (192, 128), "1", None),
    ("hopper", 256, (128, 128), "1", None), ("hopper", 128, (128, 128), "0", None)])
def test_sink_route(backend, keys, dims, knob, want, monkeypatch):
    """In one FP8 call (multiples of 128 keys; on the Hopper kernel where its sink is on and supports them) or
    the split path (None)."""
    monkeypatch.setattr(dispatch, "_hopper", lambda: _fake_hopper())
    monkeypatch.setenv("LEANFA_HOPPER_SINK", knob)
    assert dispatch.sink_route(backend, dims, keys) == want


def test_portable_only_feature_warns_on_a_gpu_even_where_the_kernel_refuses_for_another_reason(monkeypatch,
                                                                                               gpu_validated):
    """A call with a feature only the portable kernel has (here attention_chunk) warns once on an sm90 GPU even when the
    Hopper kernel would refuse it for another reason too (H200 run 96: FP8 paged caches ran on the portable kernel
    without the warning); off a GPU nothing is said."""
    import dataclasses
    import warnings

    problem = dataclasses.replace(_problem(), attention_chunk=64)
    for on_gpu, said in ((True, 1), (False, 0)):
        monkeypatch.setattr(dispatch, "_hopper", lambda on_gpu=on_gpu: _fake_hopper(False, on_gpu=on_gpu))
        monkeypatch.setattr(dispatch, "_WARNED", set())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert dispatch.choose(problem, "auto").kernel == "portable"
        assert len([w for w in caught if "attention_chunk" in str(w.message)]) == said
