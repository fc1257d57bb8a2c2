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
