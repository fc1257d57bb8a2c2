"""Hand-scheduled Hopper (sm90) attention kernels in Gluon. Not implemented yet."""

from __future__ import annotations


def supports(problem) -> tuple[bool, str]:
    return False, "the Hopper kernels are not implemented yet"


def run(problem):  # pragma: no cover - unreachable while supports() is False
    raise NotImplementedError
