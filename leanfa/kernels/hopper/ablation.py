"""Timing ablations of the Hopper kernel (``LEANFA_HOPPER_ABLATE``, :func:`.launch._ablation`): parts of
the kernel left out to time what they cost. The answers are wrong; the launch warns on every plan.

The kernel's ``ABLATE`` constexpr is a sum of these bits (0: none, the only value a real call passes).
"""

from __future__ import annotations

from .gluon_compat import gl, gluon

ABLATE_EXP = gl.constexpr(1)  # no exponential: p = x (removes the MUFU work, keeps everything else)
ABLATE_MAX = gl.constexpr(2)  # no row max: the block max is the old one (removes the FMNMX/SHFL chain)
ABLATE_ONEWG = gl.constexpr(4)  # consumer warpgroup 1 does nothing (one 64-row chain per CTA)
ABLATE_BITS = {"exp": ABLATE_EXP.value, "max": ABLATE_MAX.value, "onewg": ABLATE_ONEWG.value}


@gluon.constexpr_function
def ablates(ablate, bit):
    """Whether the kernel's ``ABLATE`` constexpr asks for the timing ablation ``bit``."""
    return bool(ablate & bit)
