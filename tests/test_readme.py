"""README.md's Python snippets run (on the CPU: interpreter, small shapes), and the API reference
builds with pdoc without warnings.

Snippet rules: a block whose first line is ``# GPU only`` runs only with CUDA. On the CPU each
block is rewritten before it runs: ``dev = "cuda"``/``device="cuda"`` -> CPU, the size line
``B, S, Hq, Hkv, D = ...`` -> small sizes, fixed (1, 256, ...) shapes -> 32 tokens, and
``torch.compile(..., fullgraph=True)`` gets ``backend="aot_eager"``. An exception or failed assert in a snippet
fails its test.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
SIZE_LINE = re.compile(r"^B, S, Hq, Hkv, D = .*$", re.M)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def cpu_version(src: str) -> str:
    src = src.replace('dev = "cuda"', 'dev = "cpu"').replace('device="cuda"', 'device="cpu"')
    src = SIZE_LINE.sub("B, S, Hq, Hkv, D = 2, 32, 4, 2, 64", src)
    src = src.replace("torch.randn(1, 256, h, 128,", "torch.randn(1, 32, h, 64,")
    src = src.replace("fullgraph=True)", 'fullgraph=True, backend="aot_eager")')
    return src


def run_snippet(src: str) -> None:
    code = src if HAS_CUDA else cpu_version(src)
    if not HAS_CUDA:
        assert "cuda" not in code.replace("torch.cuda", ""), "snippet still names a CUDA device on CPU"
    exec(compile(code, "<README snippet>", "exec"), {"__name__": "readme_snippet"})


BLOCKS = python_blocks((ROOT / "README.md").read_text())


def test_readme_has_the_snippets():
    assert len(BLOCKS) >= 5  # Use, torch.compile, CUDA graph, transformers, flash-attn drop-in
    assert sum(b.startswith("# GPU only") for b in BLOCKS) == 1


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: BLOCKS[i].splitlines()[0][:40])
def test_readme_snippet_runs(index):
    src = BLOCKS[index]
    if src.startswith("# GPU only") and not HAS_CUDA:
        pytest.skip("GPU-only snippet")
    run_snippet(src)


def test_snippet_runner_can_fail():
    """The harness really executes: a wrong snippet fails."""
    with pytest.raises(AssertionError):
        run_snippet('import torch\nassert torch.ones(1, device="cuda" if False else "cpu").sum() == 2\n')
    with pytest.raises(ValueError, match="head dims"):
        run_snippet('import torch, leanfa\nq = torch.zeros(1, 8, 2, 96, device="cuda", dtype=torch.bfloat16)\n'
                    'leanfa.flash_attn_func(q, q, q)\n')


def test_api_docs_build_without_warnings(tmp_path):
    pytest.importorskip("pdoc")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    r = subprocess.run(["bash", str(ROOT / "scripts/build_docs.sh"), str(tmp_path / "api")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    for page in ("leanfa.html", "leanfa/ops.html", "leanfa/flash_attn_interface.html"):
        assert (tmp_path / "api" / page).exists(), page
    assert "flash_attn_varlen_func" in (tmp_path / "api" / "leanfa" / "api.html").read_text()
