"""README.md: its commands are the ones CI runs, its Python examples run, and it stays a user's page.

* The tested-set install command and the test command in the README's ``bash`` blocks are the
  ones ``.ci/run`` runs (compared after dropping pip's ``--quiet``/``-q``, which change only
  what pip prints).
* The quickstart (the first ``python`` block) runs as a user would run it: in a fresh Python
  with ``TRITON_INTERPRET`` unset, on the CPU when there is no GPU.
* The other ``python`` blocks run in this process (on the CPU: under the interpreter that
  ``tests/conftest.py`` turns on, with small shapes: the size line ``B, S, Hq, Hkv, D = ...`` ->
  small sizes, fixed ``(1, 256, h, 128)``/``(2, 4096, h, 128)`` shapes -> 32 tokens, and
  ``torch.compile(..., fullgraph=True)`` gets ``backend="aot_eager"``). A block whose first line
  is ``# GPU only`` runs only with CUDA. An exception or failed assert fails its test.
* No example names a CUDA device other than through
  ``device = "cuda" if torch.cuda.is_available() else "cpu"``.
* No measurement-history references ("run 42", "the tenth session"): they live in docs/history.md.
* The API reference builds with pdoc without warnings.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
README = (ROOT / "README.md").read_text()
DEVICE_LINE = 'device = "cuda" if torch.cuda.is_available() else "cpu"'
SIZE_LINE = re.compile(r"^B, S, Hq, Hkv, D = .*$", re.M)
QUICKSTART_OUTPUT = re.compile(r"^(bf16|fp8) relative L2 error (\S+)$", re.M)
#: history references the README must not carry ("run 42", "runs 58-62", "the tenth session")
HISTORY = re.compile(r"\bruns? \d+|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|"
                     r"eleventh|twelfth|thirteenth|\d+(?:st|nd|rd|th)) session\b", re.I)
PIP_QUIET = {"--quiet", "-q"}


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def shell_commands(text: str) -> list[str]:
    """The command lines of a shell script or of bash blocks (backslash continuations joined),
    comments stripped, normalized by shlex (so quoting style does not matter); a line shlex
    cannot split is kept as it is."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = [line.strip()]
        if words:
            out.append(" ".join(shlex.quote(w) for w in words))
    return out


def normalized_pip(command: str) -> str:
    words = shlex.split(command)
    return " ".join(shlex.quote(w) for w in words if w not in PIP_QUIET)


def pip_installs_of_leanfa(commands: list[str]) -> list[str]:
    """``python -m pip install ... -e ...`` lines (leanfa's own install), without pip's quiet flags."""
    return [normalized_pip(c) for c in commands
            if c.startswith("python -m pip install") and "-e" in shlex.split(c)]


def pytest_runs(commands: list[str]) -> list[str]:
    return [c for c in commands if c.startswith("python -m pytest")]


def ci_divergences(readme: str, ci_script: str) -> list[str]:
    """Where the README's tested-set install and test commands differ from what CI runs."""
    readme_cmds = shell_commands("".join(code_blocks(readme, "bash")))
    ci_cmds = shell_commands(ci_script)
    problems = []
    tested_set = [c for c in pip_installs_of_leanfa(readme_cmds) if "-c" in shlex.split(c)]
    ci_installs = pip_installs_of_leanfa(ci_cmds)
    if len(tested_set) != 1:
        problems.append(f"README: expected one install command with -c constraints.txt, got {tested_set}")
    if tested_set != ci_installs:
        problems.append(f"install: README {tested_set} vs .ci/run {ci_installs}")
    readme_tests, ci_tests = sorted(set(pytest_runs(readme_cmds))), pytest_runs(ci_cmds)
    if len(readme_tests) != 1 or ci_tests != readme_tests:
        problems.append(f"tests: README {readme_tests} vs .ci/run {ci_tests}")
    return problems


BLOCKS = code_blocks(README, "python")
QUICKSTART = BLOCKS[0]


def cpu_version(src: str) -> str:
    src = SIZE_LINE.sub("B, S, Hq, Hkv, D = 2, 32, 4, 2, 64", src)
    src = re.sub(r"torch\.randn\((?:1, 256|2, 4096), h, 128,", "torch.randn(1, 32, h, 64,", src)
    src = src.replace("fullgraph=True)", 'fullgraph=True, backend="aot_eager")')
    return src


def run_snippet(src: str) -> None:
    code = src if HAS_CUDA else cpu_version(src)
    exec(compile(code, "<README snippet>", "exec"), {"__name__": "readme_snippet"})


def test_install_and_test_commands_are_what_ci_runs():
    assert ci_divergences(README, (ROOT / ".ci/run").read_text()) == []


def test_ci_comparison_can_fail():
    readme = '```bash\npython -m pip install -c constraints.txt -e ".[test]"\npython -m pytest -q tests\n```\n'
    same = 'set -e\npython -m pip install --quiet -c constraints.txt -e ".[test]"  # x\npython -m pytest -q tests\n'
    assert ci_divergences(readme, same) == []
    assert ci_divergences(readme, same.replace("-c constraints.txt ", ""))
    assert ci_divergences(readme, same.replace("-q tests", "-q tests -x"))
    assert ci_divergences(readme.replace("-c constraints.txt ", ""), same)


def test_the_two_commands_section_has_both():
    section = README.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    cmds = shell_commands("".join(code_blocks(section, "bash")))
    assert len(cmds) == 2 and cmds[0].startswith("leanfa bench ") and pytest_runs(cmds) == [cmds[1]]


def test_the_bench_command_parses():
    """The README's ``leanfa bench`` flags are real: its cases print with ``--dry-run``."""
    section = README.split("## The two commands", 1)[1]
    bench = shlex.split(shell_commands(code_blocks(section, "bash")[0])[0])[1:]
    r = subprocess.run([sys.executable, "-m", "leanfa.cli", *bench, "--dry-run"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^\d+ cases x \d+ implementations", r.stdout, re.M), r.stdout


def test_quickstart_runs_as_written():
    """In a fresh interpreter without TRITON_INTERPRET: on this machine's GPU, or on the CPU."""
    assert QUICKSTART.startswith("import os\n") and "## Quickstart" in README.split(QUICKSTART)[0]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-c", QUICKSTART], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    errors = {name: float(err) for name, err in QUICKSTART_OUTPUT.findall(r.stdout)}
    assert set(errors) == {"bf16", "fp8"}, r.stdout
    assert errors["bf16"] < 1.5e-2 and errors["fp8"] < 9e-2, errors  # the Numerics section's bounds


def test_readme_has_the_snippets():
    assert len(BLOCKS) >= 6  # quickstart, Use, flash-attn drop-in, transformers, torch.compile, CUDA graph
    assert sum(b.startswith("# GPU only") for b in BLOCKS) == 1


@pytest.mark.parametrize("index", range(1, len(BLOCKS)), ids=lambda i: BLOCKS[i].splitlines()[0][:40])
def test_readme_snippet_runs(index):
    src = BLOCKS[index]
    if src.startswith("# GPU only") and not HAS_CUDA:
        pytest.skip("GPU-only snippet")
    run_snippet(src)


def hard_codes_cuda(block: str) -> bool:
    """True when ``block`` names a CUDA device other than through DEVICE_LINE, or places
    tensors (``device=``) without DEVICE_LINE."""
    rest = block.replace(DEVICE_LINE, "")
    return bool(re.search(r"""["']cuda|\.cuda\(""", rest)) or ("device=" in rest and DEVICE_LINE not in block)


def test_no_example_hard_codes_cuda():
    assert [b for b in BLOCKS if hard_codes_cuda(b)] == []
    assert hard_codes_cuda('dev = "cuda"\n') and hard_codes_cuda("x = torch.ones(1).cuda()\n")
    assert hard_codes_cuda("x = torch.ones(1, device=dev)\n")
    assert not hard_codes_cuda(f"{DEVICE_LINE}\nx = torch.ones(1, device=device)\n")


def test_no_history_references():
    assert HISTORY.findall(README) == []
    assert HISTORY.search("FP8 (run 60) and the tenth session")  # the pattern itself matches


def test_snippet_runner_can_fail():
    """The harness really executes: a wrong snippet fails."""
    with pytest.raises(AssertionError):
        run_snippet("import torch\nassert torch.ones(1).sum() == 2\n")
    with pytest.raises(ValueError, match="head dims"):
        run_snippet(f"import torch, leanfa\n{DEVICE_LINE}\n"
                    "q = torch.zeros(1, 8, 2, 100, device=device, dtype=torch.bfloat16)\n"
                    "leanfa.flash_attn_func(q, q, q)\n")


def test_api_docs_build_without_warnings(tmp_path):
    pytest.importorskip("pdoc")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    r = subprocess.run(["bash", str(ROOT / "scripts/build_docs.sh"), str(tmp_path / "api")],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    for page in ("leanfa.html", "leanfa/ops.html", "leanfa/flash_attn_interface.html"):
        assert (tmp_path / "api" / page).exists(), page
    assert "flash_attn_varlen_func" in (tmp_path / "api" / "leanfa" / "api.html").read_text()
