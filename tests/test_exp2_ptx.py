"""The mixed MUFU/polynomial exp2 of the Hopper v3 kernel (leanfa/kernels/hopper/exp2.py), run
on the CPU by interpreting its PTX text with NumPy float32/int32 arithmetic.

The GPU compiles the same strings (tests/test_hopper.py compiles them for sm90); here every
instruction's semantics is emulated so a wrong operand order, register name or constant in
the PTX shows up as a wrong value, without a GPU. ``ex2.approx.ftz.f32`` is emulated as exact
exp2 (the hardware's error, ~2^-22 relative, is far below what is checked here).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from leanfa.kernels.hopper import exp2 as E


def _f32(bits_hex: str) -> np.float32:
    return np.array([int(bits_hex[2:], 16)], dtype=np.uint32).view(np.float32)[0]


def run_ptx(ptx: str, inputs: np.ndarray) -> np.ndarray:
    """Interpret ``ptx`` (one mixed-exp2 block) on ``inputs`` of shape (n, PACK)."""
    regs: dict[str, np.ndarray] = {}
    for i in range(E.PACK):
        regs[f"${i + E.PACK}"] = inputs[:, i].astype(np.float32)

    def val(tok, kind):
        tok = tok.strip()
        if tok.startswith("0f"):
            return np.full(len(inputs), _f32(tok), dtype=np.float32)
        if re.fullmatch(r"-?\d+", tok):
            return np.full(len(inputs), int(tok), dtype=np.int32)
        v = regs[tok]
        return v.view(np.float32) if kind == "f" else v.view(np.int32)

    body = ptx.replace("{", " ").replace("}", " ")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], args[1:]
        with np.errstate(all="ignore"):
            if op == "max.f32":
                r = np.maximum(val(srcs[0], "f"), val(srcs[1], "f"))
            elif op == "add.rn.f32":
                r = (val(srcs[0], "f") + val(srcs[1], "f")).astype(np.float32)
            elif op == "sub.rn.f32":
                r = (val(srcs[0], "f") - val(srcs[1], "f")).astype(np.float32)
            elif op == "fma.rn.f32":  # float64 product+sum then round: the single rounding of an FMA
                r = (val(srcs[0], "f").astype(np.float64) * val(srcs[1], "f") + val(srcs[2], "f")).astype(np.float32)
            elif op == "ex2.approx.ftz.f32":
                r = np.exp2(val(srcs[0], "f").astype(np.float64)).astype(np.float32)
            elif op == "mov.b32":
                r = regs[srcs[0]].copy()
            elif op == "shl.b32":
                r = (val(srcs[0], "i").astype(np.int64) << int(srcs[1])).astype(np.uint64)
                r = (r & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
            elif op == "add.s32":  # wraps modulo 2^32 like the hardware
                r = (val(srcs[0], "i").astype(np.int64) + val(srcs[1], "i"))
                r = ((r + 2**31) % 2**32 - 2**31).astype(np.int32)
            elif op == "max.s32":
                r = np.maximum(val(srcs[0], "i"), val(srcs[1], "i"))
            else:
                raise AssertionError(f"unexpected PTX instruction {op!r} in {stmt!r}")
        regs[d] = r
    return np.stack([regs[f"${i}"].view(np.float32) for i in range(E.PACK)], axis=1)


# what the kernel feeds it: s * c - m + P_OFFSET lies in [-inf, P_OFFSET + TAU] (TAU <= 0.81)
GRID = np.concatenate([np.linspace(-140.0, 8.8, 40_003), [-np.inf, -1e30, -200.5, -126.0, 0.0, 8.0]])


@pytest.mark.parametrize("poly", [0, 1, 2, 8])
def test_mixed_exp2_matches_exp2(poly):
    n = len(GRID) // E.PACK * E.PACK
    x = GRID[:n].astype(np.float32).reshape(-1, E.PACK)
    got = run_ptx(E.MIXED_EXP2_PTX[poly], x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    # results within a factor 2 of the denormal range may lose the implicit bit (the exponent
    # field reaches 0): irrelevant for probabilities ~1e-38, so only checked for size below
    normal = ref >= 2.0**-125
    rel = np.abs(got[normal] - ref[normal]) / ref[normal]
    assert rel.max() < 1.0e-4  # polynomial: 7.5e-5 minimax (relative); MUFU exact here
    assert np.all(got[~normal] <= 2.0**-124) and np.all(got >= 0.0)


def test_poly_exp2_of_minus_inf_is_exactly_zero():
    # a fully masked row must keep l = 0 (LSE = -inf): exp2(-inf) has to be 0, not 2^-126
    x = np.full((1, E.PACK), -np.inf, dtype=np.float32)
    assert np.all(run_ptx(E.MIXED_EXP2_PTX[E.PACK], x) == 0.0)


def test_poly_share_is_what_the_name_says():
    for poly in range(E.PACK + 1):
        ptx = E.MIXED_EXP2_PTX[poly]
        assert ptx.count("ex2.approx.ftz.f32") == E.PACK - poly
        assert ptx.count("fma.rn.f32") == 3 * poly
