"""Where a sequence lives in a (dense or packed varlen) tensor: shared by the Triton kernels."""

import triton
import triton.language as tl


@triton.jit
def sequence_span(CU, b, seqlen_dense, VARLEN: tl.constexpr):
    """(start token, length) of sequence ``b``: from ``cu_seqlens`` when VARLEN, else the
    dense tensor's own axis (start 0; the batch offset comes from the batch stride)."""
    if VARLEN:
        start = tl.load(CU + b)
        seqlen = tl.load(CU + b + 1) - start
    else:
        start = b * 0  # a tensor zero (int literals have no .to())
        seqlen = seqlen_dense
    return start, seqlen


def block_slots(tokens: int, batch: int, block: int) -> int:
    """The most ``block``-token blocks ``batch`` packed sequences of ``tokens`` tokens in all can have (each
    sequence's last block may be partial): the grid that :func:`packed_block` maps, and the Hopper varlen tile
    table's capacity."""
    return tokens // block + batch


@triton.jit
def packed_block(i, CU, batch, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, block) of the ``i``-th ``BLOCK_S``-token block of a packed batch whose blocks are counted
    sequence after sequence (sequence ``b`` has ``ceil(len_b / BLOCK_S)``, an empty one none), by a running sum
    of the block counts over ``BLOCK_B`` sequences per step. The sequence is ``batch`` when ``i`` lies past
    the last block. A grid of :func:`block_slots` programs covers every block of the batch."""
    b = i * 0
    before = i * 0  # blocks of the sequences before b
    counted = i * 0  # blocks of the sequences of the steps done
    for b0 in range(0, batch, BLOCK_B):
        j = b0 + tl.arange(0, BLOCK_B)
        m = j < batch
        n = tl.load(CU + j + 1, mask=m, other=0) - tl.load(CU + j, mask=m, other=0)
        blocks = (n + BLOCK_S - 1) // BLOCK_S
        ends = counted + tl.cumsum(blocks, 0)  # one past each sequence's last block
        passed = m & (ends <= i)
        b += tl.sum(passed.to(tl.int32), 0)
        before += tl.sum(tl.where(passed, blocks, 0), 0)
        counted += tl.sum(blocks, 0)
    return b, i - before
