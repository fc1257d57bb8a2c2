"""FlashAttention-3's own forward tests, run against leanfa's drop-in module (GPU).

    python scripts/flash_attn_tests.py --src DIR [--every 3] [--out FILE.xml] [-- pytest args]

``DIR`` holds FlashAttention-3's ``hopper/test_flash_attn.py``, ``padding.py`` and ``test_util.py`` (from a
flash-attention checkout; they are not part of leanfa). The tests run unchanged in a scratch folder where
``import flash_attn_interface`` is :mod:`leanfa.flash_attn_interface`, with the backward parts off
(``FLASH_ATTENTION_DISABLE_BACKWARD=TRUE``). A call leanfa refuses with ``NotImplementedError`` (an option it
does not implement, named in the message) is reported as a skip with that message; anything else --
a wrong result, another exception -- is a failure. ``--every N`` keeps every N-th collected case (a
deterministic sample; 1 runs all); ``--part K/N`` runs the K-th of N interleaved parts of that sample, so that a
sample longer than one GPU call runs as N calls covering it once. The summary counts passes, failures and skips by reason.
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

FILES = ("test_flash_attn.py", "padding.py", "test_util.py")

CONFTEST = '''
import functools
import sys

import pytest

import leanfa.flash_attn_interface as _lf


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


sys.modules["flash_attn_interface"] = _Module()


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
    ap.add_argument("--src", required=True, help="folder with FlashAttention-3's hopper test files")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--part", default="0/1", metavar="K/N",
                    help="run the K-th of N interleaved parts of the sample (0-based): a sample too long for one run "
                         "is run as N runs that together cover it once")
    ap.add_argument("--out", default=None, help="JUnit XML of the run (default: in the scratch folder)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds; then the run is interrupted (SIGINT: the cases done so far are reported)")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fa3_tests_")
    for f in FILES:
        shutil.copy(os.path.join(args.src, f), work)
    with open(os.path.join(work, "conftest.py"), "w") as fh:
        part, parts = (int(x) for x in args.part.split("/"))
        if not 0 <= part < parts:
            ap.error(f"--part K/N needs 0 <= K < N, got {args.part}")
        fh.write(CONFTEST.replace("@EVERY@", str(max(args.every, 1))).replace("@PART@", str(part))
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
