"""Pick the kernel backend for a validated :class:`leanfa.api.Problem` and run it.

Order: the Hopper kernel where it applies (sm90, supported shape, tested Triton) *and* it has
passed its GPU validation (``hopper.VALIDATED``) *and* the portable kernel was not measured faster
for the call (``hopper.portable_faster``: FP8 at head dim 64), else the portable kernel.
``backend="hopper"`` demands the Hopper kernel (also before validation, for development) and
raises where it does not apply; ``backend="portable"`` forces the portable kernel.
"""

from __future__ import annotations

from .. import _versions
from . import portable


def _hopper():
    try:
        from . import hopper
    except ImportError:  # Gluon missing in this Triton
        return None
    return hopper


def hopper_sink_enabled(dims=None, sink_keys=None) -> bool:
    """Whether FP8 calls with BF16 sink keys may run on the Hopper kernel (:mod:`.hopper.sink`); with
    ``dims`` (Dqk, Dv) and ``sink_keys``, also whether it supports them."""
    hopper = _hopper()
    return hopper is not None and hopper.sink_in_kernel(dims, sink_keys)


def hopper_applies(problem) -> tuple[bool, str]:
    """Whether the Hopper kernel can run this problem, and if not, why."""
    hopper = _hopper()
    if hopper is None:
        return False, "triton.experimental.gluon is not available"
    if problem.sink_keys and not hopper.sink_in_kernel():
        return False, ("BF16 sink keys (bf16_sink_keys) run in the portable kernel here: the Hopper kernel's "
                       "sink is off (LEANFA_HOPPER_SINK=0)")
    return hopper.supports(problem)


def run(problem, backend: str):
    # an untested torch/triton warns once (leanfa/_versions.py) and "auto" stays portable
    tested = _versions.check()
    if backend == "hopper" or (backend == "auto" and tested and getattr(_hopper(), "VALIDATED", False)):
        ok, why = hopper_applies(problem)
        if ok and (backend == "hopper" or not _hopper().portable_faster(problem)):
            return _hopper().run(problem)
        if backend == "hopper":
            raise ValueError(f"backend='hopper' cannot run this call: {why}")
    return portable.run(problem)
