"""The end of a query tile: the output rows and the LSE's K-mean term.

``O = acc / l * v_scale`` (V's per-channel FP8 descale, ones for 16-bit V) is written straight
from the wgmma accumulator layout with a row mask (:func:`write_rows`), or (dense calls, :func:`.launch.store_tma`) staged in
shared memory and written by one TMA store per warpgroup (:func:`stage_and_store`), which also clips
the rows past the sequence's end, or (varlen calls, :func:`.launch.store_staged`) staged in shared memory and copied
out 16 bytes per thread with the row mask (:func:`stage_and_copy`: a TMA box would cross into the next sequence). When K was smoothed (``K - mean`` before
quantization, softmax-exact) the LSE lacks ``softmax_scale * <q_row, mean>``, added back from the
Q tile still in shared memory.
"""

from __future__ import annotations

from .gluon_compat import fence_async_shared, gl, gluon, tma

from .layouts import copy_layout, rows_layout
from .pipeline import as_2d


@gluon.jit
def load_v_scale(v_scale_row, stride_vsd, HEAD_DV: gl.constexpr, o_layout: gl.constexpr):
    """V's per-channel descale (ones for 16-bit V) from ``v_scale_row`` (one KV head's table), in O's column
    layout."""
    return gl.load(v_scale_row + gl.arange(0, HEAD_DV, gl.SliceLayout(0, o_layout)) * stride_vsd)


@gluon.jit
def write_rows(acc, inv_l, v_scale, row0, out_ptr, stride_ob, stride_os, stride_oh, b, h, seqlen_q):
    """Rows ``[row0, row0 + acc.shape[0])`` of head ``h``: ``acc * inv_l * v_scale`` (``v_scale`` from
    :func:`load_v_scale`)."""
    o_layout: gl.constexpr = acc.type.layout
    ROWS: gl.constexpr = acc.shape[0]
    HEAD_DV: gl.constexpr = acc.shape[1]
    offs_m = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DV, gl.SliceLayout(0, o_layout))
    out = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None] * v_scale[None, :]
    o_base = out_ptr + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    o_ptrs = o_base + offs_m.to(gl.int64)[:, None] * stride_os + offs_d[None, :]
    gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_m[:, None] < seqlen_q)


@gluon.jit
def stage_and_store(acc, inv_l, v_scale, out_desc, o_buf, b, h, row0):
    """Rows ``[row0, row0 + acc.shape[0])`` of head ``h`` of sequence ``b`` (``acc * inv_l * v_scale``) through
    the shared-memory box ``o_buf`` and one TMA store of ``out_desc`` ((B, H, S, D) view; rows past S are
    clipped). The store is left in flight: the next call waits for it before writing ``o_buf`` again, and
    the caller waits once (``tma.store_wait(0)``) before its partition exits."""
    o_layout: gl.constexpr = acc.type.layout
    out = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None] * v_scale[None, :]
    tma.store_wait(0)  # the previous tile's store has read o_buf (persistent programs)
    gl.thread_barrier()
    as_2d(o_buf).store(out.to(out_desc.dtype))
    fence_async_shared()  # the generic writes, visible to the TMA unit ...
    gl.thread_barrier()  # ... from every warp of the warpgroup, before one thread issues the store
    tma.async_copy_shared_to_global(out_desc, [b, h, row0, 0], o_buf)


@gluon.jit
def stage_and_copy(acc, inv_l, v_scale, o_buf, row0, out_ptr, stride_ob, stride_os, stride_oh, b, h, seqlen_q,
                   num_warps: gl.constexpr):
    """Rows ``[row0, row0 + acc.shape[0])`` of head ``h`` (``acc * inv_l * v_scale``, rows from ``seqlen_q`` on
    masked) through this warpgroup's shared buffer ``o_buf``: written in the accumulator's layout, read back 16
    bytes per thread along the row (:func:`.layouts.copy_layout`) and stored with 16-byte stores."""
    o_layout: gl.constexpr = acc.type.layout
    ROWS: gl.constexpr = acc.shape[0]
    HEAD_DV: gl.constexpr = acc.shape[1]
    o_dtype: gl.constexpr = out_ptr.dtype.element_ty
    c_layout: gl.constexpr = copy_layout(num_warps, HEAD_DV, o_dtype)
    out = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, o_layout))[:, None] * v_scale[None, :]
    gl.thread_barrier()  # every warp of the warpgroup has read the previous tile's rows out of o_buf
    o_buf.store(out.to(o_dtype))
    gl.thread_barrier()
    vals = o_buf.load(c_layout)
    offs_m = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, c_layout))
    offs_d = gl.arange(0, HEAD_DV, gl.SliceLayout(0, c_layout))
    o_base = out_ptr + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    gl.store(o_base + offs_m.to(gl.int64)[:, None] * stride_os + offs_d[None, :], vals, mask=offs_m[:, None] < seqlen_q)


@gluon.jit
def kmean_lse_term(q_smem, FIRST: gl.constexpr, QK_CHUNKS: gl.constexpr, k_mean_ptr, stride_kmb, stride_kmh,
                   stride_kmd, b, hkv, scale, num_warps: gl.constexpr):
    """``scale * <q_row, k_mean>`` per row of the Q tile held in ``q_smem[FIRST : FIRST + QK_CHUNKS]``
    (head-dim chunks), in ``SliceLayout(1, rows_layout(num_warps))``."""
    ROWS: gl.constexpr = q_smem.shape[3]
    DCHUNK: gl.constexpr = q_smem.shape[4]
    r_layout: gl.constexpr = rows_layout(num_warps)
    offs_k = gl.arange(0, DCHUNK, gl.SliceLayout(0, r_layout))
    dot = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, r_layout))
    for c in gl.static_range(QK_CHUNKS):
        qv = as_2d(q_smem.index(FIRST + c)).load(r_layout).to(gl.float32)
        km = gl.load(k_mean_ptr + b * stride_kmb + hkv * stride_kmh + (c * DCHUNK + offs_k) * stride_kmd)
        dot += gl.sum(qv * km[None, :], axis=1)
    return dot * scale
