"""Packaging: a pure-Python wheel that installs into a fresh venv and imports without torch or
triton; tested versions declared once (leanfa/_versions.py), untested ones warn once."""

import os
import shutil
import subprocess
import sys
import venv
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import leanfa
from leanfa import _versions

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_builds_and_installs_in_fresh_venv(tmp_path):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    src = tmp_path / "src"  # build from a copy: no build/ or egg-info left in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "leanfa", src / "leanfa", ignore=shutil.ignore_patterns("__pycache__"))
    # --no-isolation: the build backend (setuptools) is the one installed here, no network
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)],
                   check=True, capture_output=True, cwd=tmp_path)
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl"), wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    for f in ("leanfa/__init__.py", "leanfa/ops.py", "leanfa/_versions.py", "leanfa/flash_attn_interface.py",
              "leanfa/compat/flash_attn.py", "leanfa/integrations/transformers.py", "leanfa/kernels/portable.py"):
        assert f in names, f
    assert not any(n.startswith("tests/") for n in names)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheels[0])],
                   check=True, capture_output=True)
    code = ("import sys, leanfa; print(leanfa.__version__); "
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    r = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.split("\n")[:2] == [leanfa.__version__, "[]"], r.stdout


def test_version_single_source():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{leanfa.__version__}"' in text


def test_untested_versions_listed():
    assert _versions.untested({"torch": "2.13.0", "triton": "3.6.0"}) == []
    assert _versions.untested({"torch": "2.11.1", "triton": "3.60.0"}) == ["triton 3.60.0"]
    assert _versions.untested({"torch": "2.5.0", "triton": "3.7.0"}) == ["torch 2.5.0", "triton 3.7.0"]


def test_untested_combination_warns_once_and_runs_portable(monkeypatch, device):
    import triton

    from leanfa.kernels import dispatch

    monkeypatch.setattr(_versions, "_checked", None)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    hopper_called = []
    monkeypatch.setattr(dispatch, "_hopper", lambda: type("H", (), {
        "VALIDATED": True, "supports": staticmethod(lambda p: (True, "")),
        "run": staticmethod(lambda p: hopper_called.append(p))}))
    q = torch.randn(1, 8, 2, 64).to(torch.bfloat16).to(device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        outs = [leanfa.flash_attn_func(q, q, q, causal=True) for _ in range(2)]
    msgs = [str(w.message) for w in rec if "untested" in str(w.message)]
    assert len(msgs) == 1 and "triton 3.9.0" in msgs[0], msgs
    assert hopper_called == [] and torch.equal(outs[0], outs[1])  # the portable kernel ran
