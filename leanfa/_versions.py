"""The torch/triton versions leanfa is tested with (the one place they are declared).

An untested combination still runs: :func:`check` warns once per process and the dispatcher
uses the portable kernel (the Hopper kernel is only picked on a tested combination).
"""

from __future__ import annotations

import warnings

#: version prefixes (major.minor) tested in CI / on the H200
TESTED = {"triton": ("3.6",), "torch": ("2.11", "2.13")}

_checked: bool | None = None


def _tested(name: str, version: str) -> bool:
    return any(version == p or version.startswith(p + ".") for p in TESTED[name])


def untested(versions: dict[str, str]) -> list[str]:
    """``"name version"`` for each entry of ``versions`` that is not a tested version."""
    return [f"{n} {v}" for n, v in versions.items() if not _tested(n, v)]


def check() -> bool:
    """True when the installed torch and triton are tested versions; otherwise warn once
    (``UserWarning``) and return False."""
    global _checked
    if _checked is None:
        import torch
        import triton

        bad = untested({"torch": torch.__version__.split("+")[0], "triton": triton.__version__})
        _checked = not bad
        if bad:
            warnings.warn(
                f"leanfa is untested with {', '.join(bad)} (tested: "
                + "; ".join(f"{n} {', '.join(v)}" for n, v in TESTED.items())
                + "); using the portable kernel only",
                UserWarning, stacklevel=3)
    return _checked
