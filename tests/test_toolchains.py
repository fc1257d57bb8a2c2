"""Supported toolchains (leanfa/_versions.py), the Gluon names the Hopper kernels import
(leanfa/kernels/hopper/gluon_compat.py) and the dispatcher's self-check of the Hopper kernel on a Triton
that never ran the GPU suite (leanfa/kernels/dispatch.py). CPU only: versions and kernels are faked."""

from __future__ import annotations

import logging
import re
import types
import warnings
from pathlib import Path

import pytest
import torch
import triton

import leanfa
from leanfa import _versions
from leanfa.kernels import dispatch, portable

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- version table

def test_supported_versions_listed():
    assert _versions.unsupported({"torch": "2.13.0", "triton": "3.6.0"}) == []
    for t, tr in (("2.11.1", "3.7.1"), ("2.14.1", "3.8.0"), ("2.15.0", "3.9.0"), ("2.12.0", "3.9")):
        assert _versions.unsupported({"torch": t, "triton": tr}) == []
    assert _versions.unsupported({"torch": "2.11.1", "triton": "3.60.0"}) == ["triton 3.60.0"]
    assert _versions.unsupported({"torch": "2.5.0", "triton": "3.10.0"}) == ["torch 2.5.0", "triton 3.10.0"]
    assert _versions.unsupported({"torch": "2.16.0", "triton": "3.5.1"}) == ["torch 2.16.0", "triton 3.5.1"]
    assert _versions.gpu_validated("3.6.0") and _versions.gpu_validated("3.6")
    assert not any(_versions.gpu_validated(v) for v in ("3.7.1", "3.8.0", "3.9.0", "3.60.0"))


def _fresh_versions(monkeypatch, torch_version, triton_version):
    monkeypatch.setattr(_versions, "_checked", None)
    monkeypatch.setattr(_versions, "_validated", None)
    monkeypatch.setattr(torch, "__version__", torch_version)
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(dispatch, "VERDICTS", {})


class FakeHopper:
    """Stands in for :mod:`leanfa.kernels.hopper`: accepts every problem; ``run`` is the portable
    kernel's answer, plus ``error`` (a relative perturbation of the output), or raises ``raises``."""

    VALIDATED = True
    from leanfa.kernels.hopper import HEAD_DIMS

    def __init__(self, error=0.0, raises=None):
        self.error, self.raises, self.calls = error, raises, []

    def supports(self, problem):
        return True, ""

    def portable_faster(self, problem):
        return False

    def sink_in_kernel(self, dims=None, sink_keys=None):
        return True

    def run(self, problem):
        self.calls.append(problem)
        if self.raises is not None:
            raise self.raises
        out, lse = portable.run(problem)
        return out + self.error * out.abs().mean() * torch.randn_like(out.float()).to(out.dtype), lse


def _qkv(device, d=64, heads=(2, 2), seq=40, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq, h, d, generator=g).to(dtype).to(device) for h in (heads[0], heads[1], heads[1])]


def test_unsupported_combination_warns_once_and_runs_portable(monkeypatch, device):
    _fresh_versions(monkeypatch, "2.13.0", "3.10.0")
    fake = FakeHopper()
    monkeypatch.setattr(dispatch, "_hopper", lambda: fake)
    q, k, v = _qkv(device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        outs = [leanfa.flash_attn_func(q, k, v, causal=True) for _ in range(2)]
    msgs = [str(w.message) for w in rec if "does not support" in str(w.message)]
    assert len(msgs) == 1 and "triton 3.10.0" in msgs[0] and "3.9" in msgs[0], msgs
    assert fake.calls == [] and torch.equal(outs[0], outs[1])  # the portable kernel ran


@pytest.mark.parametrize("torch_version,triton_version", [("2.14.1", "3.8.0"), ("2.11.0", "3.7.1"),
                                                          ("2.15.0", "3.9.0"), ("2.13.0", "3.6.0")])
def test_supported_versions_do_not_warn(monkeypatch, torch_version, triton_version):
    _fresh_versions(monkeypatch, torch_version, triton_version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _versions.check()


# ----------------------------------------------------------------------------- the self-check

def _calls(monkeypatch, fake, device, configs, triton_version="3.8.0", caplog=None):
    """Run ``leanfa.flash_attn_func`` once per ``(causal, dtype)`` in ``configs`` on a faked Triton with the
    fake Hopper kernel; return (outputs, warnings' messages)."""
    _fresh_versions(monkeypatch, "2.13.0", triton_version)
    monkeypatch.setattr(dispatch, "_hopper", lambda: fake)
    outs = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for causal, dtype in configs:
            q, k, v = _qkv(device, dtype=dtype)
            outs.append(leanfa.flash_attn_func(q, k, v, causal=causal))
    return outs, [str(w.message) for w in rec if "self-check" in str(w.message)]


def test_disagreeing_self_check_falls_back_with_one_warning(monkeypatch, device):
    """A Hopper kernel whose answer is off on the self-check's problem is not used: the call (and every later
    call of that configuration) runs on the portable kernel, with one warning per configuration."""
    fake = FakeHopper(error=0.5)
    bf16 = torch.bfloat16
    outs, msgs = _calls(monkeypatch, fake, device, [(True, bf16), (True, bf16), (False, bf16)])
    assert len(msgs) == 2, msgs  # causal, then non-causal: one each
    assert "triton 3.8.0" in msgs[0] and "head dims 64/64, causal" in msgs[0] and "portable kernel" in msgs[0]
    assert "non-causal" in msgs[1]
    # the fake ran only on the two self-check problems (208 tokens, two heads), never on a real call
    assert [(p.max_seqlen_q, p.heads, p.causal) for p in fake.calls] == [(208, 2, True), (208, 2, False)]
    q, k, v = _qkv(device)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], leanfa.flash_attn_func(q, k, v, causal=True, backend="portable"))
    assert sorted(dispatch.VERDICTS.values()) == [False, False]


def test_agreeing_self_check_keeps_the_hopper_kernel_silently(monkeypatch, device, caplog):
    fake = FakeHopper(error=0.0)
    bf16 = torch.bfloat16
    with caplog.at_level(logging.INFO, logger="leanfa.kernels.dispatch"):
        outs, msgs = _calls(monkeypatch, fake, device, [(True, bf16), (True, bf16)])
    assert msgs == []
    assert [p.max_seqlen_q for p in fake.calls] == [208, 40, 40]  # checked once, then both calls ran on it
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "agrees" in caplog.records[0].getMessage()


def test_self_check_catches_a_kernel_that_raises(monkeypatch, device):
    fake = FakeHopper(raises=RuntimeError("illegal instruction"))
    outs, msgs = _calls(monkeypatch, fake, device, [(True, torch.bfloat16)])
    assert len(msgs) == 1 and "RuntimeError: illegal instruction" in msgs[0]
    assert len(fake.calls) == 1 and not torch.isnan(outs[0]).any()


def test_gpu_validated_triton_runs_without_self_check(monkeypatch, device):
    fake = FakeHopper(error=0.5)  # (would fail a self-check)
    outs, msgs = _calls(monkeypatch, fake, device, [(True, torch.bfloat16)], triton_version="3.6.0")
    assert msgs == [] and [p.max_seqlen_q for p in fake.calls] == [40] and dispatch.VERDICTS == {}


def test_explicit_hopper_backend_is_not_self_checked(monkeypatch, device):
    fake = FakeHopper(error=0.5)
    _fresh_versions(monkeypatch, "2.13.0", "3.9.0")
    monkeypatch.setattr(dispatch, "_hopper", lambda: fake)
    q, k, v = _qkv(device)
    leanfa.flash_attn_func(q, k, v, causal=True, backend="hopper")
    assert [p.max_seqlen_q for p in fake.calls] == [40] and dispatch.VERDICTS == {}


def test_outputs_agree():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(1, 16, 2, 8, generator=g)
    lse = torch.randn(1, 2, 16, generator=g)
    assert dispatch.outputs_agree((out, lse), (out.clone(), lse.clone()), fp8=False) == (True, "")
    assert dispatch.outputs_agree((out * 1.01, None), (out, None), fp8=False)[0]  # 1e-2 < 2e-2
    ok, why = dispatch.outputs_agree((out * 1.05, None), (out, None), fp8=False)
    assert not ok and "output relative L2 error 0.05" in why
    assert dispatch.outputs_agree((out * 1.05, None), (out, None), fp8=True)[0]  # FP8's bound is 8e-2
    nan = out.clone()
    nan[0, 3] = float("nan")
    assert not dispatch.outputs_agree((nan, None), (out, None), fp8=True)[0]
    assert dispatch.outputs_agree((nan, None), (nan.clone(), None), fp8=True)[0]  # NaN where the portable has it
    assert not dispatch.outputs_agree((out, lse + 1), (out, lse), fp8=True)[0]


def _captured_problem(monkeypatch, fn):
    """The :class:`leanfa.problem.Problem` that a call ``fn()`` hands the dispatcher."""
    seen = []
    monkeypatch.setattr(dispatch, "run", lambda problem, backend: seen.append(problem) or portable.run(problem))
    fn()
    return seen[0]


@pytest.mark.parametrize("case", ["bf16", "fp8-lse-kmean", "fp8-varlen", "fp16-gqa-varlen", "fp8-sink"])
def test_probe_problem_has_the_configuration(monkeypatch, case, device):
    """The self-check's problem is small and of the same configuration: what :func:`dispatch.config_key`
    keys the verdict on, FP8 V stored transposed (tokens innermost, TMA-aligned), unit descales."""
    g = torch.Generator().manual_seed(0)
    gqa = "gqa" in case
    q, k, v = (torch.randn(300, h, 64, generator=g) for h in (4, 2 if gqa else 4, 2 if gqa else 4))
    dtype = torch.float16 if "fp16" in case else torch.bfloat16
    q, k, v = (t.to(dtype).to(device) for t in (q, k, v))
    cu = torch.tensor([0, 120, 300], dtype=torch.int32, device=device)
    if case == "bf16":
        call = lambda: leanfa.flash_attn_func(q[None], k[None], v[None], causal=False)  # noqa: E731
    elif "varlen" in case:
        kw = dict(precision="fp8" if "fp8" in case else "bf16")
        call = lambda: leanfa.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,  # noqa: E731
                                        max_seqlen_q=180, max_seqlen_k=180, **kw)
    elif case == "fp8-sink":
        call = lambda: leanfa.attention(q[None], k[None], v[None], causal=True, precision="fp8",  # noqa: E731
                                        bf16_sink_keys=128)
    else:
        call = lambda: leanfa.attention(q[None], k[None], v[None], causal=True, precision="fp8",  # noqa: E731
                                        smooth_k=True, return_lse=True)
    problem = _captured_problem(monkeypatch, call)
    probe = dispatch.probe_problem(problem)
    assert dispatch.config_key(probe) == dispatch.config_key(problem)
    assert probe.heads == 2 and probe.kv_heads == (1 if gqa else 2)
    assert probe.max_seqlen_q == (202 if problem.varlen else 208)
    if problem.is_fp8:
        assert probe.v.stride(-3) == 1 and probe.v.shape[-3] % 16 == 0  # tokens innermost
        assert problem.sink_keys == 0 or (probe.sink_q.dtype == torch.bfloat16 and probe.sink_k.shape == probe.k.shape)
    for t, rows in ((probe.q_scale, probe.heads), (probe.k_scale, probe.kv_heads)):
        assert t.shape[:2] == (probe.batch, rows) and bool((t == 1).all())
    out, lse = portable.run(probe)  # a valid problem: the portable kernel runs it
    assert torch.isfinite(out).all() and (lse is None) == (not problem.return_lse)


# ----------------------------------------------------------------------------- Gluon names

def test_kernels_take_gluon_names_from_the_compat_module_only():
    """Every Gluon / Triton-compiler name the Hopper package uses comes through gluon_compat.py: no other
    module of it imports ``triton.experimental`` or the compiler internals the API moves touch."""
    pkg = ROOT / "leanfa" / "kernels" / "hopper"
    bad = {f.name: m for f in pkg.glob("*.py") if f.name != "gluon_compat.py"
           for m in re.findall(r"^\s*(?:from|import) (triton\.(?:experimental|backends|runtime\.jit)\S*)",
                               f.read_text(), re.M)
           if not (f.name == "emulate.py" and m == "triton.runtime.jit")}  # the emulator reads JIT functions
    assert bad == {}


def test_gluon_compat_is_triton_itself_where_nothing_moved():
    compat = pytest.importorskip("leanfa.kernels.hopper.gluon_compat")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma

    for name, mod, real in (("gl", compat.gl, gl), ("tma", compat.tma, tma)):
        moved = [r for r in compat.RENAMED if r.startswith(name + ".")]
        assert (mod is real) == (not moved), (name, moved)
        assert type(mod) is types.ModuleType  # Gluon's code generator takes exactly this type as a namespace
    assert callable(compat.gl.thread_barrier)
    assert compat.tma.async_copy_global_to_shared is getattr(tma, "async_load", tma.async_copy_global_to_shared)


def test_gluon_compat_binds_old_names_to_new_spellings():
    compat = pytest.importorskip("leanfa.kernels.hopper.gluon_compat")
    monkey_renamed = []
    old = types.ModuleType("fake_gl")
    old.thread_barrier, old.load = object(), object()
    new = types.ModuleType("fake_gl")
    new.barrier, new.load = object(), object()
    stub = types.ModuleType("fake_gl")  # 3.9: the old name kept as a stub that raises
    stub.barrier, stub.thread_barrier = object(), object()
    names = {"thread_barrier": ("barrier",)}
    saved = list(compat.RENAMED)
    try:
        assert compat._with_names(old, "gl", names) is old
        ns = compat._with_names(new, "gl", names)
        assert type(ns) is types.ModuleType and ns is not new and not hasattr(new, "thread_barrier")
        assert ns.thread_barrier is new.barrier and ns.load is new.load
        assert compat._with_names(stub, "gl", names).thread_barrier is stub.barrier
        monkey_renamed = compat.RENAMED[len(saved):]
        with pytest.raises(ImportError, match="neither thread_barrier nor any of barrier"):
            compat._with_names(types.ModuleType("empty"), "gl", names)
    finally:
        compat.RENAMED[:] = saved
    assert monkey_renamed == ["gl.thread_barrier -> barrier"] * 2


# ----------------------------------------------------------------------------- CI

def test_ci_runs_the_readme_commands_and_builds_with_every_supported_triton():
    """.ci/run installs the tested set (constraints.txt: a supported torch and the GPU-validated Triton) with
    the README's install command, runs the README's test command, then builds with every other supported
    Triton."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert '\npython -m pip install -c constraints.txt -e ".[test]"\n' in ci
    assert "\npython -m pytest -q tests\n" in ci
    pins = dict(re.findall(r"^([a-z]+)(\S+)$", (ROOT / "constraints.txt").read_text(), re.M))
    assert pins["torch"].startswith("==") and _versions.unsupported({"torch": pins["torch"][2:]}) == []
    assert pins["triton"].startswith("==") and _versions.gpu_validated(pins["triton"][2:])
    tested = re.search(r"^for TRITON in ([0-9. ]+); do$", ci, re.M).group(1).split()
    minor = sorted({v.rsplit(".", 1)[0] for v in [*tested, pins["triton"][2:]]})
    assert minor == sorted(_versions.SUPPORTED["triton"]), minor
