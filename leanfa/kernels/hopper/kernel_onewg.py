"""A v4 prototype of the *occupancy* family (issue 21): one warpgroup per CTA, no warp specialization,
several CTAs per SM.

A CTA computes 64 query rows of one head against the key blocks they see. Its four warps issue
everything themselves: the TMA loads of Q and of a ``STAGES``-deep K/V ring, the QK and PV wgmmas, and the
softmax. Nothing overlaps inside a CTA but the next block's QK with this block's PV; the overlap of one
CTA's softmax with another's matrix work comes from the hardware running ``CTAS`` CTAs on each SM (three
at FP8 d128: 168 registers and ~72 KB of shared memory each), the way SageAttention2's Hopper kernel
schedules.

Per key block ``j`` (the last one peeled, so that S has one definition per iteration):

    P_j = Lean-P softmax of S_j (one FFMA and one MUFU.EX2 per score, :mod:`.softmax_ws`)
    issue PV_j into O (fed ``O * alpha``) and QK_{j+1}; wait for both
    CTA barrier; refill ring slot ``j % STAGES`` with key block ``j + STAGES``

FP8 only (e4m3 Q/K/V, V stored K-major as :func:`leanfa.quantize_fp8` writes it), dense, no LSE: enough
to time the family against the v3 kernel, FA3 and cuDNN on the H200 (``scripts/v4_proto.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .epilogue import load_v_scale, write_rows
from .layouts import PERMUTED_KEYS, a_operand_layout, p_operand, wgmma_layout
from .masking import kv_block_range, mask_scores
from .pipeline import alloc_barriers, invalidate_barriers, load_kv, load_q, qk_async, v_tile, wait_k
from .softmax import finish_rows
from .softmax_ws import online_softmax_step_lazy

ROWS = gl.constexpr(64)  # query rows per CTA: one wgmma M
SCALE_BLOCK = gl.constexpr(128)  # tokens per Q/K scale block (leanfa.scales.SCALE_BLOCK)
P_OFFSET = gl.constexpr(8.0)  # FP8: P scaled by 2^8 into the e4m3 range


@gluon.jit
def _block(s, j, c, acc, m_i, l_i, offs_m, offs_n0, seqlen_q, seqlen_k, n_full, n_end, q_smem, k_bufs, v_bufs,
           k_bars, v_bars, s_zero, k_desc, v_desc, b, hkv, p_layout: gl.constexpr, o_layout: gl.constexpr,
           CAUSAL: gl.constexpr, V_KMAJOR: gl.constexpr, MASK: gl.constexpr, NEXT: gl.constexpr):
    """Key block ``j`` with scores ``s``: its softmax (``MASK``: the diagonal and tail blocks), PV_j (and QK_{j+1}
    when ``NEXT``), then the refill of its ring slot. Returns ``(acc, m_i, l_i, S_{j+1})``."""
    STAGES: gl.constexpr = v_bufs.shape[0]
    QK_CHUNKS: gl.constexpr = k_bufs.shape[0] // STAGES
    BLOCK_N: gl.constexpr = s.shape[1]
    if MASK:
        s = mask_scores(s, offs_m, j * BLOCK_N + offs_n0, seqlen_q, seqlen_k, CAUSAL)
    p, m_i, l_i, alpha = online_softmax_step_lazy(s, c, m_i, l_i, P_OFFSET, False)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = p_operand(p.to(v_bufs.dtype), p_layout, V_KMAJOR == PERMUTED_KEYS)
    v = v_tile(v_bufs, v_bars, j, STAGES, True)
    pv = warpgroup_mma(p_op, v, acc * alpha_o, is_async=True)
    if NEXT:
        s_acc = qk_async(q_smem, 0, k_bufs, wait_k(k_bars, j + 1, STAGES), s_zero, QK_CHUNKS)
        acc, s = warpgroup_mma_wait(0, deps=(pv, s_acc))
    else:
        acc = warpgroup_mma_wait(0, deps=(pv, ))
    if j + STAGES < n_end:
        gl.thread_barrier()  # every warp's wgmmas that read slot j % STAGES have retired
        load_kv(k_desc, v_desc, b, hkv, j + STAGES, k_bufs, v_bufs, k_bars, v_bars, STAGES, True, QK_CHUNKS)
    return acc, m_i, l_i, s


@gluon.jit
def _k_scale(k_scale_row, stride_ksblk, j, BLOCK_N: gl.constexpr):
    return gl.load(k_scale_row + (j * BLOCK_N // SCALE_BLOCK) * stride_ksblk)


@gluon.jit(do_not_specialize=["num_heads", "group_size", "num_m_tiles"])
def attn_fwd_onewg_kernel(
    q_desc, k_desc, v_desc,
    out_ptr, stride_ob, stride_os, stride_oh,
    q_scale_ptr, stride_qsb, stride_qsh, stride_qsblk,
    k_scale_ptr, stride_ksb, stride_ksh, stride_ksblk,
    v_scale_ptr, stride_vsb, stride_vsh, stride_vsd,
    seqlen_q, seqlen_k, num_heads, group_size, num_m_tiles,
    qk_scale,  # softmax_scale * log2(e)
    HEAD_DQK: gl.constexpr, HEAD_DV: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
    V_KMAJOR: gl.constexpr,  # True, or PERMUTED_KEYS: V's keys in layouts.key_slot_order (P needs no shuffle)
    num_warps: gl.constexpr,
):
    gl.static_assert(num_warps == 4, "one warpgroup per CTA")
    gl.static_assert(q_desc.block_type.shape[2] == ROWS, "Q loads in 64-row boxes")
    DCHUNK: gl.constexpr = q_desc.block_type.shape[3]
    QK_CHUNKS: gl.constexpr = HEAD_DQK // DCHUNK
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    gl.static_assert(BLOCK_N <= SCALE_BLOCK, "a key block lies in one K scale block")

    bh = gl.program_id(0)
    m_start = (num_m_tiles - 1 - gl.program_id(1)) * ROWS  # the heaviest causal tiles first
    b = bh // num_heads
    h = bh % num_heads
    hkv = h // group_size
    n_full, n_end = kv_block_range(m_start, seqlen_q, seqlen_k, ROWS, BLOCK_N, CAUSAL)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [QK_CHUNKS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES * QK_CHUNKS] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = alloc_barriers(1)
    k_bars = alloc_barriers(STAGES)
    v_bars = alloc_barriers(STAGES)

    s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N, 8)
    o_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DV, 8)
    p_layout: gl.constexpr = a_operand_layout(o_layout, 8)
    offs_m = m_start + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    offs_n0 = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([ROWS, HEAD_DV], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    c_q = qk_scale * gl.load(q_scale_ptr + b * stride_qsb + h * stride_qsh + (m_start // SCALE_BLOCK) * stride_qsblk)
    k_scale_row = k_scale_ptr + b * stride_ksb + hkv * stride_ksh

    if n_end > 0:
        load_q(q_desc, b, h, m_start, q_bar.index(0), q_smem, QK_CHUNKS)
        for i in gl.static_range(STAGES):
            if i < n_end:
                load_kv(k_desc, v_desc, b, hkv, i, k_bufs, v_bufs, k_bars, v_bars, STAGES, True, QK_CHUNKS)
        mbarrier.wait(q_bar.index(0), 0)
        s = warpgroup_mma_wait(0, deps=(qk_async(q_smem, 0, k_bufs, wait_k(k_bars, 0, STAGES), s_zero, QK_CHUNKS), ))
        # unmasked blocks, then the masked ones (diagonal, tail), then the last block (no next QK): three loops, so
        # that the steady state carries no mask code (one loop with `if j >= n_full` kept it behind a branch)
        n_plain = gl.minimum(n_full, n_end - 1)
        for j in range(0, n_plain):
            acc, m_i, l_i, s = _block(s, j, c_q * _k_scale(k_scale_row, stride_ksblk, j, BLOCK_N), acc, m_i, l_i,
                                      offs_m, offs_n0, seqlen_q, seqlen_k, n_full, n_end, q_smem, k_bufs, v_bufs,
                                      k_bars, v_bars, s_zero, k_desc, v_desc, b, hkv, p_layout, o_layout, CAUSAL,
                                      V_KMAJOR, False, True)
        for j in range(n_plain, n_end - 1):
            acc, m_i, l_i, s = _block(s, j, c_q * _k_scale(k_scale_row, stride_ksblk, j, BLOCK_N), acc, m_i, l_i,
                                      offs_m, offs_n0, seqlen_q, seqlen_k, n_full, n_end, q_smem, k_bufs, v_bufs,
                                      k_bars, v_bars, s_zero, k_desc, v_desc, b, hkv, p_layout, o_layout, CAUSAL,
                                      V_KMAJOR, True, True)
        last = n_end - 1
        acc, m_i, l_i, s = _block(s, last, c_q * _k_scale(k_scale_row, stride_ksblk, last, BLOCK_N), acc, m_i, l_i,
                                  offs_m, offs_n0, seqlen_q, seqlen_k, n_full, n_end, q_smem, k_bufs, v_bufs,
                                  k_bars, v_bars, s_zero, k_desc, v_desc, b, hkv, p_layout, o_layout, CAUSAL,
                                  V_KMAJOR, True, False)

    inv_l, _ = finish_rows(m_i, l_i, P_OFFSET)
    v_sc = load_v_scale(v_scale_ptr + b * stride_vsb + hkv * stride_vsh, stride_vsd, HEAD_DV, o_layout)
    write_rows(acc, inv_l, v_sc, m_start, out_ptr, stride_ob, stride_os, stride_oh, b, h, seqlen_q)
    invalidate_barriers(q_bar, 1)
    invalidate_barriers(k_bars, STAGES)
    invalidate_barriers(v_bars, STAGES)
