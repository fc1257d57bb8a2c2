"""Packaging: a pure-Python wheel that installs into a fresh venv and imports without torch or
triton; one version (pyproject.toml). The supported torch/triton versions: tests/test_toolchains.py."""

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

import leanfa

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
