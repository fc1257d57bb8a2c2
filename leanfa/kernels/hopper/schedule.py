"""Which query tile a program computes (the tile scheduler of the Hopper kernels).

The grid is ``(batch * heads, query tiles)``. Axis 1 runs backwards so that, for causal
attention, every head's last (heaviest: it sees the most keys) query tile is launched before
any first tile and the last wave is made of cheap tiles. GQA: query head ``h`` reads KV head
``h // group_size``. A persistent scheduler (one program per SM looping over tiles) would live
here too.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def program_tile(num_heads, group_size, num_m_tiles, BLOCK_M: gl.constexpr):
    """``(pid_bh, b, h, hkv, m_start)`` of this program's query tile, heaviest tiles first."""
    pid_bh = gl.program_id(0)
    pid_m = num_m_tiles - 1 - gl.program_id(1)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hkv = h // group_size
    return pid_bh, b, h, hkv, pid_m * BLOCK_M
