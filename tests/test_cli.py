"""`leanfa demo` (the README's first command) runs and reports sane errors; GPU-only commands
exit non-zero with a one-line reason on a machine without a GPU."""

import os
import re
import subprocess
import sys

import pytest
import torch


def _run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the CLI decides
    return subprocess.run([sys.executable, "-m", "leanfa.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_demo_reports_errors_vs_float64():
    r = _run("demo", "--seqlen", "192", "--heads", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    errs = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(bf16|fp8\+sink|fp8)\s+([0-9.e+-]+)", r.stdout, re.M)}
    assert set(errs) == {"bf16", "fp8", "fp8+sink"}, r.stdout
    assert errs["bf16"] < 1e-2
    assert errs["fp8"] < 0.3
    assert errs["fp8+sink"] < errs["fp8"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("command", ["bench", "accuracy", "profile"])
def test_gpu_commands_refuse_without_gpu(command):
    r = _run(command, timeout=120)
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "GPU" in lines[0], lines
