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
def staged_out_layout(rows, cols, dtype):
    """Shared layout of a ``[rows, cols]`` output tile staged for its copy to global memory (the TMA box's)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


@gluon.constexpr_function
def copy_layout(num_warps, cols, dtype):
    """Blocked layout that gives each thread 16 contiguous bytes of a row of ``cols`` elements of ``dtype`` (a warp
    covers whole rows), for 16-byte global stores."""
    bits = getattr(dtype, "primitive_bitwidth", None) or dtype.itemsize * 8  # (a torch dtype in the emulator)
    vec = 128 // bits
    per_row = min(32, max(cols // vec, 1))
    return gl.BlockedLayout([1, vec], [32 // per_row, per_row], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def rows_layout(num_warps):
    """A plain blocked layout for reading a Q tile back from shared memory (epilogue only)."""
    return gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])


@gluon.jit
def p_operand(p, p_dtype: gl.constexpr, p_layout: gl.constexpr):
    """P (in the QK accumulator layout) as PV's register A operand, converted to ``p_dtype``."""
    return gl.convert_layout(p.to(p_dtype), p_layout)
