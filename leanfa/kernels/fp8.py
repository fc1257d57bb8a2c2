"""FP8 (e4m3) helpers shared by the Triton kernels."""

import triton
import triton.language as tl

#: largest finite float8_e4m3fn value (host code)
E4M3_MAX = 448.0
#: the same, readable from jit code (kernels may only read constexpr globals)
E4M3_MAX_C = tl.constexpr(448.0)


@triton.jit
def to_e4m3(x, SATURATE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """Round float32 ``x`` to float8_e4m3fn, nearest-even, clamping to +-448 when SATURATE.

    On a GPU the conversion instruction does the rounding. Triton's CPU interpreter (3.6)
    rounds wrongly when the mantissa carries into the exponent (31.5 -> 16), so with
    EXACT_ROUND the value is first rounded to the e4m3 grid in float32 arithmetic; the
    conversion of an exactly representable value is then exact.
    """
    if SATURATE:
        x = tl.clamp(x, -E4M3_MAX_C, E4M3_MAX_C)
    if EXACT_ROUND:
        ax = tl.abs(x)
        # e4m3: 3 mantissa bits, smallest normal exponent -6 (subnormal quantum 2^-9)
        e = tl.maximum(tl.floor(tl.log2(ax)), -6.0)
        quantum = tl.exp2(e - 3.0)
        r = tl.floor(ax / quantum + 0.5) * quantum
        r = tl.minimum(r, E4M3_MAX_C)
        x = tl.where(x < 0, -r, r)
    return x.to(tl.float8e4nv)
