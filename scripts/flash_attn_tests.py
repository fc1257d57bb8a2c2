"""flash-attn's own forward tests, run against leanfa's drop-in modules (GPU).

    python scripts/flash_attn_tests.py --src DIR [--suite fa3|fa2] [--every 3] [--out FILE.xml] [-- pytest args]

``--suite fa3`` (the default): ``DIR`` holds FlashAttention-3's ``hopper/test_flash_attn.py``, ``padding.py`` and
``test_util.py``; the tests run unchanged in a scratch folder where ``import flash_attn_interface`` is
:mod:`leanfa.flash_attn_interface`, with the backward parts off (``FLASH_ATTENTION_DISABLE_BACKWARD=TRUE``).
``--suite fa2``: ``DIR`` holds flash-attn 2's ``tests/test_flash_attn.py`` and ``flash_attn/bert_padding.py``; the
tests run unchanged against a ``flash_attn`` package made in the scratch folder whose functions are
:mod:`leanfa.compat.flash_attn`'s (``bert_padding`` is flash-attn's own file; ``apply_rotary_emb`` skips the case:
leanfa refuses rotary embedding). flash-attn 2's tests interleave the backward with the forward checks, so
``torch.autograd.grad`` returns zeros there (leanfa is forward-only): the gradient asserts compare zeros with zeros
and only the forward asserts check anything; the backward-only tests and those calling flash-attn's C++ entry points
are left out (:data:`FA2_LEFT_OUT`).

(These files come from a flash-attention checkout; they are not part of leanfa.) A call leanfa refuses with
``NotImplementedError`` (an option it does not implement, named in the message) is reported as a skip with that
message; anything else -- a wrong result, another exception -- is a failure. ``--every N`` keeps every N-th
collected case (a deterministic sample; 1 runs all); ``--part K/N`` runs the K-th of N interleaved parts of that
sample, so that a sample longer than one GPU call runs as N calls covering it once. The summary counts passes,
failures and skips by reason.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

FILES = {"fa3": ("test_flash_attn.py", "padding.py", "test_util.py"),
         "fa2": ("test_flash_attn.py", "bert_padding.py")}

#: flash-attn 2 tests that test the backward alone, or call flash-attn's C++ entry points (``flash_attn_gpu``,
#: ``_flash_attn_varlen_forward``), or repeat a call 250 times on a 60-sequence batch (the race condition test)
FA2_LEFT_OUT = ("race_condition", "bwd_overflow", "bwd_transpose", "bwd_varlen_overflow", "deterministic",
                "paged_kv_num_splits", "generator_arg")

#: the flash_attn package the fa2 suite imports (bert_padding.py is copied next to it)
FA2_PACKAGE = {
    "__init__.py": ("import sys\n\n\n"
                    "def __getattr__(name):  # leanfa.compat.flash_attn's functions, wrapped by conftest.py\n"
                    "    return getattr(sys.modules['leanfa_fa2_conftest_module'], name)\n"),
    "flash_attn_interface.py": (
        "USE_TRITON_ROCM = False\n\n\n"
        "def _get_block_size_n(device, head_dim, is_dropout, is_causal):\n"
        "    raise NotImplementedError('leanfa does not support dropout (no dropout mask to compare)')\n"),
    "layers/__init__.py": "",
    "layers/rotary.py": (
        "import pytest\n\n\n"
        "def apply_rotary_emb(*args, **kwargs):\n"
        "    pytest.skip('leanfa refuses: rotary_cos/rotary_sin (rotary embedding)')\n"),
}

CONFTEST_FA3 = '''
import leanfa.flash_attn_interface as _lf
MODULE = "flash_attn_interface"
'''

CONFTEST_FA2 = '''
import torch

import leanfa.compat.flash_attn as _lf
MODULE = "leanfa_fa2_conftest_module"


def _zero_grads(outputs, inputs, *args, **kwargs):
    """leanfa is forward-only: the gradients flash-attn 2's tests take between their forward checks are zeros."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return tuple(torch.zeros_like(t) for t in inputs)


torch.autograd.grad = _zero_grads
'''

CONFTEST = '''
import functools
import sys

import pytest


def _refusal_is_skip(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            pytest.skip(f"leanfa refuses: {e}")
    return call


class _Module:
    def __getattr__(self, name):
        attr = getattr(_lf, name)
        return _refusal_is_skip(attr) if callable(attr) else attr


sys.modules[MODULE] = _Module()


@pytest.fixture(autouse=True)
def _release_cached_memory():
    """Each case's tensors go back to the device after it: the caching allocators of parallel workers otherwise
    hold the GPU's memory between cases (H200 run 95: out-of-memory failures in the other workers)."""
    yield
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
EVERY = @EVERY@
PART, PARTS = @PART@, @PARTS@


def pytest_collection_modifyitems(config, items):
    items[:] = [item for i, item in enumerate(items) if i % EVERY == 0 and (i // EVERY) % PARTS == PART]
'''


def summarize(xml_path: str) -> None:
    root = ET.parse(xml_path).getroot()
    counts, skips, failures = collections.Counter(), collections.Counter(), collections.Counter()
    for case in root.iter("testcase"):
        name = case.get("name", "").split("[")[0]
        kids = {child.tag: child for child in case}
        if "failure" in kids or "error" in kids:
            counts["failed"] += 1
            msg = (kids.get("failure") if "failure" in kids else kids["error"]).get("message", "")
            failures[f"{name}: {msg.splitlines()[0][:150] if msg else '?'}"] += 1
        elif "skipped" in kids:
            counts["skipped"] += 1
            skips[kids["skipped"].get("message", "")[:150]] += 1
        else:
            counts["passed"] += 1
    print(f"\n{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    for title, table in (("failures", failures), ("skips", skips)):
        if table:
            print(f"\n{title} by reason:")
            for reason, n in table.most_common(25):
                print(f"  {n:5d}  {reason}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True, help="folder with the suite's test files (module docstring)")
    ap.add_argument("--suite", choices=sorted(FILES), default="fa3",
                    help="fa3: FlashAttention-3's hopper tests through leanfa.flash_attn_interface; fa2: flash-attn "
                         "2's tests through leanfa.compat.flash_attn")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--part", default="0/1", metavar="K/N",
                    help="run the K-th of N interleaved parts of the sample (0-based): a sample too long for one run "
                         "is run as N runs that together cover it once")
    ap.add_argument("--out", default=None, help="JUnit XML of the run (default: in the scratch folder)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds; then the run is interrupted (SIGINT: the cases done so far are reported)")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix=f"{args.suite}_tests_")
    for f in FILES[args.suite]:
        shutil.copy(os.path.join(args.src, f), work)
    part, parts = (int(x) for x in args.part.split("/"))
    if not 0 <= part < parts:
        ap.error(f"--part K/N needs 0 <= K < N, got {args.part}")
    head = CONFTEST_FA3
    if args.suite == "fa2":
        head = CONFTEST_FA2
        for name, text in {**FA2_PACKAGE, "bert_padding.py": None}.items():
            path = os.path.join(work, "flash_attn", name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if text is None:
                shutil.move(os.path.join(work, name), path)
            else:
                with open(path, "w") as fh:
                    fh.write(text)
        args.pytest_args = ["-k", " and ".join(f"not {n}" for n in FA2_LEFT_OUT), *args.pytest_args]
    with open(os.path.join(work, "conftest.py"), "w") as fh:
        fh.write(head + CONFTEST.replace("@EVERY@", str(max(args.every, 1))).replace("@PART@", str(part))
                 .replace("@PARTS@", str(parts)))
    xml = args.out or os.path.join(work, "results.xml")
    env = dict(os.environ, FLASH_ATTENTION_DISABLE_BACKWARD="TRUE")
    env["PYTHONPATH"] = os.pathsep.join([work, os.getcwd(), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", work,
           f"--junitxml={xml}", os.path.join(work, "test_flash_attn.py"), *args.pytest_args]
    proc = subprocess.Popen(cmd, cwd=work, env=env)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"\n-- interrupted after {args.timeout:.0f} s: the cases run so far --", flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    if os.path.exists(xml):
        summarize(xml)
    sys.exit(rc)


if __name__ == "__main__":
    main()
