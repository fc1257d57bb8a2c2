"""Register and shared-memory layouts of the Hopper kernel (all compile-time constants).

The kernel runs ``num_warps`` = 4 per consumer warpgroup; a tile of ``BLOCK_M`` query rows is
split across the warpgroups along M (64 rows per warpgroup, one ``wgmma`` M=64 per row slab).
Every ``wgmma`` result lives in an ``NVMMADistributedLayout`` (version 3); its instruction
shape is ``[16, N, 256 // bits]`` where N is the full tile width (one instruction spans all
columns) and K is 32 bytes of the operand type.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon


@gluon.constexpr_function
def wgmma_layout(num_warps, n, operand_bits):
    """Accumulator layout of a ``[BLOCK_M, n]`` wgmma whose operands have ``operand_bits``."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 256 // operand_bits]
    )


@gluon.constexpr_function
def a_operand_layout(acc_layout, operand_bits):
    """Register layout of the A operand (P) of a wgmma with accumulator ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=32 // operand_bits)


@gluon.constexpr_function
def rows_layout(num_warps):
    """A plain blocked layout for reading a Q tile back from shared memory (epilogue only)."""
    return gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])


#: ``V_KMAJOR`` value of a K-major FP8 V whose keys are permuted within groups of 16
#: (:func:`key_slot_order`; ``LEANFA_HOPPER_V_PERMUTED``).
PERMUTED_KEYS = gl.constexpr(2)


def key_slot_order(n: int) -> list[int]:
    """The key each of ``n`` V slots holds (``n`` a multiple of 16): in every group of 16, slot
    ``4t + 2q + e`` holds key ``8q + 2t + e`` -- keys 0,1,8,9,2,3,10,11,4,5,12,13,6,7,14,15.

    That is the order in which a thread of an FP8 QK^T wgmma accumulator holds its columns of P
    (thread ``t`` = lane % 4 holds columns ``8i + 2t + e``) relative to the k-slots it must supply
    as PV's A operand (``4t .. 4t + 3``): with V in this order, P becomes the A operand by a
    permutation of each thread's own registers (:func:`p_operand`) instead of 16 shuffles."""
    order = []
    for s in range(n):
        g, r = divmod(s, 16)
        t, q, e = r // 4, (r // 2) % 2, r % 2
        order.append(16 * g + 8 * q + 2 * t + e)
    return order


@gluon.jit
def p_operand(p, p_dtype: gl.constexpr, p_layout: gl.constexpr, PERMUTED: gl.constexpr):
    """P (in the QK accumulator layout) as PV's register A operand. ``PERMUTED``: V's keys are in
    :func:`key_slot_order`, so slot ``k`` of the operand takes P's column ``key_slot_order[k]`` --
    a reshape/permute that keeps every value in its thread (the conversion is asserted trivial)."""
    p = p.to(p_dtype)
    if PERMUTED:
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p = p.reshape([M, N // 16, 2, 4, 2]).permute(0, 1, 3, 2, 4).reshape([M, N])
        return gl.convert_layout(p, p_layout, assert_trivial=True)
    return gl.convert_layout(p, p_layout)
