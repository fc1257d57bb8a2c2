"""Facts about a CUDA device that do not change during a process, looked up once per device.

``torch.cuda.get_device_capability`` costs a few microseconds per call, and the API needs the answer up to
four times per FP8 call, on the host path that bounds short prefills (``scripts/host_time.py`` times it;
docs/perf-notes.md, "host time of the FP8 end-to-end call").
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` compute capability of a CUDA ``device`` (its index, or the current one)."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())
