"""The torch/triton versions leanfa supports (the one place they are declared).

:data:`SUPPORTED`: the Hopper (Gluon) kernels build with these major.minor versions: CI compiles every
default kernel variant for sm90 with each supported Triton (``.ci/run``), and the Gluon API moves between
them are covered in :mod:`leanfa.kernels.hopper.gluon_compat`. :data:`GPU_VALIDATED`: the Tritons whose
Hopper kernels ran the GPU suite on the H200. On a supported Triton that is not GPU-validated the
dispatcher checks each kernel configuration against the portable kernel once per process before using it
(:mod:`leanfa.kernels.dispatch`).

An unsupported combination still runs: :func:`check` warns once per process and the dispatcher uses the
portable kernel only.
"""

from __future__ import annotations

import warnings

#: major.minor versions the Hopper kernels build with (each Triton compiled for sm90 in CI)
SUPPORTED = {"torch": ("2.11", "2.12", "2.13", "2.14", "2.15"), "triton": ("3.6", "3.7", "3.8", "3.9")}
#: Tritons whose Hopper kernels passed the GPU suite on the H200
GPU_VALIDATED = {"triton": ("3.6",)}

_checked: bool | None = None
_validated: bool | None = None


def _matches(version: str, prefixes) -> bool:
    return any(version == p or version.startswith(p + ".") for p in prefixes)


def unsupported(versions: dict[str, str]) -> list[str]:
    """``"name version"`` for each entry of ``versions`` that is not a supported version."""
    return [f"{n} {v}" for n, v in versions.items() if not _matches(v, SUPPORTED[n])]


def gpu_validated(triton_version: str) -> bool:
    """Whether the Hopper kernels ran the GPU suite with this Triton (:data:`GPU_VALIDATED`)."""
    return _matches(triton_version, GPU_VALIDATED["triton"])


def triton_gpu_validated() -> bool:
    """Whether the installed Triton is GPU-validated (:func:`gpu_validated`; looked up once per process)."""
    global _validated
    if _validated is None:
        _validated = gpu_validated(installed()["triton"])
    return _validated


def installed() -> dict[str, str]:
    """The installed ``{"torch": ..., "triton": ...}`` versions (torch's without its ``+cpu``-style tag)."""
    import torch
    import triton

    return {"torch": torch.__version__.split("+")[0], "triton": triton.__version__}


def check() -> bool:
    """True when the installed torch and triton are supported versions; otherwise warn once
    (``UserWarning``) and return False."""
    global _checked
    if _checked is None:
        bad = unsupported(installed())
        _checked = not bad
        if bad:
            warnings.warn(
                f"leanfa does not support {', '.join(bad)} (supported: "
                + "; ".join(f"{n} {', '.join(v)}" for n, v in SUPPORTED.items())
                + "); using the portable kernel only",
                UserWarning, stacklevel=3)
    return _checked
