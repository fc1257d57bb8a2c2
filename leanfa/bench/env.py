"""What a result file records about where it was measured: GPU, driver, library versions,
git commit, date — and the default output folder ``bench/results/<date>-<gpu>/``."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import platform
import re
import subprocess


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(cwd: str | None = None) -> str | None:
    """``<sha>`` of HEAD, with ``-dirty`` if tracked files changed; None outside git."""
    cwd = cwd or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def git_tree(cwd: str | None = None) -> str | None:
    """Git tree hash of the working tree as it is (tracked and new, non-ignored files), without
    touching the real index. It names the measured code even where HEAD is stale (a copied
    working tree, a dirty checkout): ``git log --format='%h %T' | grep <tree>`` finds the commit."""
    cwd = cwd or os.path.dirname(os.path.abspath(__file__))
    import shutil
    import tempfile

    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel", "--git-path", "index"], cwd=cwd,
                             capture_output=True, text=True, timeout=10)
        if top.returncode != 0:
            return None
        root, index = top.stdout.split("\n")[:2]
        with tempfile.TemporaryDirectory() as d:
            tmp = os.path.join(d, "index")
            src = index if os.path.isabs(index) else os.path.join(cwd, index)
            if os.path.exists(src):  # copy2 keeps the index's mtime: git's check for racily-clean entries
                shutil.copy2(src, tmp)  # (a file rewritten at the same size within the index's timestamp) needs it
            env = dict(os.environ, GIT_INDEX_FILE=tmp)
            if subprocess.run(["git", "add", "-A"], cwd=root, env=env, capture_output=True, timeout=60).returncode:
                return None
            tree = subprocess.run(["git", "write-tree"], cwd=root, env=env, capture_output=True, text=True, timeout=30)
            return tree.stdout.strip() or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def gpu_name(device_index: int = 0) -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device_index)


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA GeForce RTX 4090' -> 'geforce-rtx-4090'."""
    s = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def today() -> str:
    return _dt.date.today().isoformat()


def default_out_dir(kind_root: str = "bench/results", device_index: int = 0) -> str:
    return os.path.join(kind_root, f"{today()}-{gpu_slug(gpu_name(device_index))}")


def environment(device_index: int = 0) -> dict:
    """GPU, driver, versions, commit and date for a result file's header."""
    import torch

    from .power import device_info

    env = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "git_tree": git_tree(),
        "gpu": gpu_name(device_index),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cudnn_torch": None,
        "cudnn_frontend": _version("nvidia-cudnn-frontend"),
        "flash_attn_3": _version("flash_attn_3") or _version("flash-attn-3"),
        "flashinfer": _version("flashinfer-python") or _version("flashinfer"),
        "hostname": platform.node(),
    }
    try:
        env["cudnn_torch"] = torch.backends.cudnn.version()
    except Exception:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device_index)
        env.update(sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                   memory_gb=round(props.total_memory / 2**30, 1),
                   l2_bytes=getattr(props, "L2_cache_size", None))
        env.update(device_info(device_index))
        try:
            import cudnn

            env["cudnn_backend"] = cudnn.backend_version()
        except Exception:
            pass
    return env
