"""FP8 (e4m3) helpers shared by the Triton kernels."""

import triton
import triton.language as tl

#: largest finite float8_e4m3fn value (host code)
E4M3_MAX = 448.0
#: the same, readable from jit code (kernels may only read constexpr globals)
E4M3_MAX_C = tl.constexpr(448.0)


@triton.jit
def to_e4m3(x, SATURATE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """Round float32 ``x`` to float8_e4m3fn, nearest-even (ties to even), clamping to +-448 when SATURATE.

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
        # round half to even, as the hardware conversion does (ties are common: bf16 inputs
        # divided by amax/448 often land exactly between two e4m3 values)
        t = ax / quantum  # exact: quantum is a power of two
        f = tl.floor(t)
        frac = t - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f) * quantum
        r = tl.minimum(r, E4M3_MAX_C)
        x = tl.where(x < 0, -r, r)
    return x.to(tl.float8e4nv)
