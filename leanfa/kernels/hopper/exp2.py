"""exp2 split between the MUFU pipe and a polynomial on the FMA pipe (lever "fewer MUFU cycles").

On the H200 MUFU.EX2 retires 16 results per clock per SM, FFMA ~90 (docs/design.md §1.2–1.3): in FP8 the
exponentials of a 128x128 tile take as long as its two wgmmas. ``exp2_mixed`` computes
``POLY`` of every 8 consecutive elements a thread holds with a polynomial (Cody-Waite split):

    x  = max(x, -200)                 FMNMX   (-inf -> -200: exp2 must give exactly 0)
    t  = x + 1.5 * 2^23               FADD    (round to nearest: t's low bits hold j = round(x))
    f  = x - (t - 1.5 * 2^23)         2 FADD  (f in [-0.5, 0.5])
    p  = c0 + f (c1 + f (c2 + f c3))  3 FFMA  (2^f, relative error 7.5e-5: far below e4m3's 2^-4 and bf16's 2^-8)
    r  = max(bits(p) + (bits(t) << 23), 0)    SHL, IADD, IMNMX (exponent insert; (bits(t) << 23) == j << 23 mod 2^32;
                                                 j <= -128 gives a negative sum -> 0.0, so exp2(-inf) == 0)

and the rest with ``ex2.approx.ftz.f32`` (what ``gl.exp2`` emits). 6 FMA-pipe + 4 ALU ops
replace one MUFU op; where the pipes balance is measured (docs/perf-notes.md), the founding
estimate (docs/design.md §1.2) is ~20%. ``POLY = 0`` is plain ``gl.exp2``. Inputs are at most ~2^7 above 0 here
(Lean P keeps ``x <= P_OFFSET + TAU``), so no overflow clamp is needed.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon

#: minimax-fitted (relative error) 2^f on [-0.5, 0.5], highest power first, as f32 bit patterns
POLY_COEFFS = ("0f3D61FE4F", "0f3E7870B0", "0f3F31798F", "0f3F7FFB41")
PACK = 8
PACK_C = gl.constexpr(PACK)  # the same, readable from jit code


#: one element by the polynomial: {o} = exp2({x}); scratch registers are declared by the caller
POLY_PTX = ("max.f32 xc, {x}, 0fC3480000; add.rn.f32 t, xc, 0f4B400000; sub.rn.f32 jf, t, 0f4B400000; "
            "sub.rn.f32 fr, xc, jf; fma.rn.f32 pp, fr, {c3}, {c2}; fma.rn.f32 pp, pp, fr, {c1}; "
            "fma.rn.f32 pp, pp, fr, {c0}; mov.b32 tb, t; shl.b32 tb, tb, 23; mov.b32 pb, pp; "
            "add.s32 pb, pb, tb; max.s32 pb, pb, 0; mov.b32 {o}, pb;")


def _mixed_exp2_ptx(poly: int) -> str:
    """PTX for ``PACK`` elements: the first ``poly`` by the polynomial, the rest on MUFU."""
    c3, c2, c1, c0 = POLY_COEFFS
    body = [".reg .f32 xc, t, jf, fr, pp; .reg .b32 tb, pb;"]
    for i in range(PACK):
        o, x = f"${i}", f"${i + PACK}"
        if i < poly:
            body.append(POLY_PTX.format(o=o, x=x, c3=c3, c2=c2, c1=c1, c0=c0))
        else:
            body.append(f"ex2.approx.ftz.f32 {o}, {x};")
    return "{ " + " ".join(body) + " }"


#: built once here (a constexpr function may only index plain data)
MIXED_EXP2_PTX = tuple(_mixed_exp2_ptx(p) for p in range(PACK + 1))
MIXED_EXP2_CONSTRAINTS = ",".join(["=f"] * PACK + ["f"] * PACK)


@gluon.constexpr_function
def mixed_exp2_asm(poly):
    return MIXED_EXP2_PTX[poly]


@gluon.constexpr_function
def mixed_exp2_constraints():
    return MIXED_EXP2_CONSTRAINTS


#: timing ablations (``LEANFA_HOPPER_ABLATE``, wrong results): ``POLY = -bits`` with these bits
ABLATE_EXP = gl.constexpr(1)  # no exponential: p = x (removes the MUFU work, keeps everything else)
ABLATE_MAX = gl.constexpr(2)  # no row max: the block max is the old one (removes the FMNMX/SHFL chain)
ABLATE_ONEWG = gl.constexpr(4)  # v3: consumer warpgroup 1 does nothing (one 64-row chain per CTA)
ABLATE_BITS = {"exp": ABLATE_EXP.value, "max": ABLATE_MAX.value, "onewg": ABLATE_ONEWG.value}


@gluon.constexpr_function
def ablates(poly, bit):
    """Whether the kernel's ``POLY`` constexpr asks for the timing ablation ``bit``."""
    return poly < 0 and bool((-poly) & bit)


@gluon.jit
def exp2_mixed(x, POLY: gl.constexpr):
    """``exp2(x)`` elementwise (f32), ``POLY`` of every ``PACK`` on the FMA pipe (``POLY < 0``: the
    timing ablations above)."""
    if ablates(POLY, ABLATE_EXP):
        return x
    elif POLY <= 0:
        return gl.exp2(x)
    else:
        return gl.inline_asm_elementwise(mixed_exp2_asm(POLY), mixed_exp2_constraints(), [x], dtype=gl.float32,
                                         is_pure=True, pack=PACK_C)
