"""Shared checks for the flash-attn compatibility layers."""

from __future__ import annotations


def reject(option: str, unsupported: bool, value=None) -> None:
    """Raise ``NotImplementedError`` naming ``option`` when ``unsupported``."""
    if unsupported:
        shown = "" if value is None else f"={value!r}" if not isinstance(value, str) else f"={value}"
        raise NotImplementedError(f"leanfa does not support {option}{shown}")
