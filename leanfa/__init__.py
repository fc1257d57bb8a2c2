"""leanfa: FP8 and BF16 prefill attention (flash-attn compatible) for LLM serving.

The public names load on first use, so ``import leanfa`` (and the ``leanfa`` command) can
decide on Triton's CPU interpreter before Triton itself is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "attention": "api",
    "flash_attn_func": "api",
    "flash_attn_varlen_func": "api",
    "varlen_schedule": "api",
    "quantize_fp8": "quant",
    "FP8QKV": "quant",
    "SCALE_BLOCK": "scales",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from .api import attention, flash_attn_func, flash_attn_varlen_func, varlen_schedule
    from .quant import FP8QKV, quantize_fp8
    from .scales import SCALE_BLOCK


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'leanfa' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
