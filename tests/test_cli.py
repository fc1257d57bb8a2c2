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


# ------------------------------------------------------------------ the CLI for users


def test_version_prints_the_package_version(capsys):
    import leanfa
    from leanfa import cli

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"leanfa {leanfa.__version__}"
    r = _run("--version", timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"leanfa {leanfa.__version__}"


@pytest.mark.parametrize("command", ["demo", "bench", "accuracy", "profile", "report"])
def test_every_help_is_written_for_users(command, capsys):
    """What it does, the options, examples; no developer docstring (module names, reST)."""
    from leanfa import cli

    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: leanfa {command}")
    description = out.split("\n\n")[1]
    assert len(description.split()) >= 15, description  # a paragraph saying what the command does
    assert "examples:\n  leanfa " + command in out
    for dev in ("``", ":mod:", ":func:", "dispatches here", "argument parsing", "leanfa.cli"):
        assert dev not in out, (dev, out)
    if command == "bench":
        assert "--quick" in out and "--list" in out and "best peer" in out


def test_top_level_help_lists_commands_and_version(capsys):
    from leanfa import cli

    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("demo", "bench", "accuracy", "profile", "report", "--version"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU listing")
def test_bench_list_is_honest_without_a_gpu():
    r = _run("bench", "--list", timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("No CUDA GPU here")
    rows = {ln.split()[0]: ln for ln in lines[1:]}
    for name, line in rows.items():
        if name.startswith(("leanfa-hopper", "cudnn-", "fa3-")):
            assert "unavailable: needs a CUDA GPU" in line, line
        if name.startswith("leanfa-portable"):
            assert "CPU tensors only" in line and "unavailable" not in line, line
    assert {"leanfa-hopper-fp8-kernel", "cudnn-fp8", "fa3-fp8", "fa3-bf16"} <= set(rows)
    assert not any(" available" in ln and "unavailable" not in ln for ln in lines[1:])


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_report_rejects_what_it_cannot_render(tmp_path):
    """One line on stderr, exit status 2, no traceback: a list (rates.json), not JSON, no kind,
    malformed rows, rows missing fields, a missing file."""
    import json

    files = {
        "rates.json": json.dumps([{"mix": "ffma", "ms": 1.0, "per_clk_per_sm": 64.0}]),
        "notjson.json": "this is not json {",
        "other.json": json.dumps({"rows": []}),
        "badrows.json": json.dumps({"kind": "bench", "rows": ["a", 1]}),
        "missing-fields.json": json.dumps({"kind": "bench", "rows": [{"status": "ok"}]}),
    }
    paths = [_write(tmp_path, n, t) for n, t in files.items()] + [str(tmp_path / "absent.json")]
    for path in paths:
        r = _run("report", "--no-plots", path, timeout=120)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode == 2, (path, r.stdout, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("leanfa report: ") and path in lines[0], (path, r.stderr)
        assert "Traceback" not in r.stderr + r.stdout
    r = _run("report", paths[0], timeout=120)
    assert "not a leanfa result file" in r.stderr and "list" in r.stderr


def test_report_renders_a_bench_result(tmp_path):
    import json

    row = {"sweep": "standard", "label": "d128", "batch": 1, "seqlen": 4096, "heads": 16, "kv_heads": 16,
           "head_dim": 128, "head_dim_v": 128, "causal": True, "seqlens": None, "case": "c", "impl": "x",
           "family": "leanfa", "precision": "fp8", "status": "ok", "tflops": 500.0, "time_ms": 1.0}
    path = _write(tmp_path, "b.json", json.dumps({"kind": "bench", "env": {}, "rows": [row]}))
    r = _run("report", "--no-plots", path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no peer ran" in (tmp_path / "b.md").read_text()


def test_report_renders_a_profile_written_before_profiles_named_their_kind(tmp_path):
    import json

    payload = {"env": {}, "impl": "cudnn-fp8", "case": "c", "kernels": [
        {"short_name": "sdpa_kernel", "metrics": {"duration_us": 12.5}}]}
    path = _write(tmp_path, "profile-old.json", json.dumps(payload))
    r = _run("report", path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "sdpa_kernel" in (tmp_path / "profile-old.md").read_text()
