"""The Hopper (sm90) attention forward kernel, v2: warp-specialized (``LEANFA_HOPPER_KERNEL=v2``).

Same math, tiles and Lean-P softmax as :mod:`.kernel` (v1); the schedule differs:

* **producer** partition (1 warp, few registers): loads Q once, then streams every key block
  the tile visits through the ``STAGES``-deep K/V ring. Before refilling slot ``s`` with block
  ``j >= STAGES`` it waits on ``empty[s]`` for the release of block ``j - STAGES`` (phase
  ``j // STAGES - 1``). It never waits on the consumers otherwise, so it runs up to ``STAGES``
  blocks ahead and no CTA-wide barrier is left in the loop.
* **consumer** partition (the default partition: ``num_warps`` = 8, two warpgroups of 64 query
  rows, most of the registers): per key block, S = Q K^T, Lean P, PV -- as in v1 -- then it
  releases the slot: a barrier over the 8 consumer warps (both warpgroups' wgmmas reading the
  slot were waited for) and one arrive on ``empty[slot]`` (count 1).

Intra-warpgroup software pipelining (``PIPE``, lever 2): the QK^T of block ``j + 1`` is issued
(async wgmma) *before* the softmax of block ``j``, so the tensor cores work on it while the
MUFU/FMA pipes do the exponentials; ``warpgroup_mma_wait(1)`` then retires only the older
group. The PV of block ``j`` is issued after the softmax and waited for at the end of the
iteration.

FP8 rescale skip (lever 3, ``RESCALE_SKIP``): see :func:`.softmax_ws.online_softmax_step_lazy`.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait

from .epilogue import kmean_lse_term, store_output
from .layouts import a_operand_layout, wgmma_layout
from .masking import kv_block_range, mask_scores
from .pipeline import (
    alloc_barriers,
    invalidate_barriers,
    load_q,
    produce_kv,
    qk_async,
    release_slot,
    v_tile,
    wait_k,
)
from .schedule import program_tile
from .softmax import finish_rows
from .softmax_ws import fold_pv, online_softmax_step_lazy

SCALE_BLOCK = gl.constexpr(128)  # tokens per Q/K scale block (leanfa.scales.SCALE_BLOCK)


# ----------------------------------------------------------------------------- producer

@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, empty_bars,
              b, h, hkv, m_start, n_end, V_KMAJOR: gl.constexpr):
    QK_CHUNKS: gl.constexpr = q_smem.shape[0]
    load_q(q_desc, b, h, m_start, q_bar.index(0), q_smem, QK_CHUNKS)
    produce_kv(k_desc, v_desc, b, hkv, n_end, k_bufs, v_bufs, k_bars, v_bars, empty_bars, V_KMAJOR)


# ----------------------------------------------------------------------------- consumer

@gluon.jit
def _softmax_pv(s, j, v_bufs, v_bars, acc, m_i, l_i, c, offs_m, offs_n0, seqlen_q, seqlen_k,
                MASK: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, V_KMAJOR: gl.constexpr,
                P_OFFSET: gl.constexpr, RESCALE_SKIP: gl.constexpr):
    """Mask, Lean P, and *issue* PV of block ``j`` (async; the caller waits and calls :func:`.softmax_ws.fold_pv`)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    STAGES: gl.constexpr = v_bufs.shape[0]
    BITS: gl.constexpr = 8 if IS_FP8 else 16
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = a_operand_layout(o_layout, BITS)
    if MASK:
        s = mask_scores(s, offs_m, j * BLOCK_N + offs_n0, seqlen_q, seqlen_k, CAUSAL)
    p, m_i, l_i, alpha = online_softmax_step_lazy(s, c, m_i, l_i, P_OFFSET, RESCALE_SKIP)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
    v = v_tile(v_bufs, v_bars, j, STAGES, V_KMAJOR)
    if IS_FP8:
        # two-level accumulation: this block's PV in a fresh fp32 tile, folded in by one FFMA
        pv = warpgroup_mma(p_op, v, gl.zeros_like(acc), use_acc=False, is_async=True)
    else:
        pv = warpgroup_mma(p_op, v, acc * alpha_o, is_async=True)
    return pv, alpha_o, m_i, l_i


@gluon.jit
def _attend_blocks(lo, hi, q_smem, k_bufs, v_bufs, k_bars, v_bars, empty_bars,
                   acc, m_i, l_i, c_q, k_scale_row, stride_ksblk,
                   offs_m, seqlen_q, seqlen_k,
                   MASK: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr,
                   V_KMAJOR: gl.constexpr, P_OFFSET: gl.constexpr, RESCALE_SKIP: gl.constexpr,
                   PIPE: gl.constexpr, num_warps: gl.constexpr):
    """Run key blocks ``[lo, hi)`` (``MASK`` for the diagonal/tail blocks)."""
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    QK_CHUNKS: gl.constexpr = q_smem.shape[0]
    STAGES: gl.constexpr = v_bufs.shape[0]
    BITS: gl.constexpr = 8 if IS_FP8 else 16
    s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N, BITS)
    offs_n0 = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    if PIPE:
        # S_j is issued one iteration early (during the softmax of block j-1) and retired by the
        # end-of-iteration wait together with PV_{j-1}.
        s_next = s_zero
        if lo < hi:
            s_next = warpgroup_mma_wait(0, deps=(qk_async(q_smem, 0, k_bufs, wait_k(k_bars, lo, STAGES), s_zero,
                                                           QK_CHUNKS), ))
        for j in range(lo, hi - 1):
            c = c_q * gl.load(k_scale_row + ((j * BLOCK_N) // SCALE_BLOCK) * stride_ksblk)
            s = s_next
            s_acc = qk_async(q_smem, 0, k_bufs, wait_k(k_bars, j + 1, STAGES), s_zero, QK_CHUNKS)
            pv, alpha_o, m_i, l_i = _softmax_pv(s, j, v_bufs, v_bars, acc, m_i, l_i, c, offs_m, offs_n0,
                                                seqlen_q, seqlen_k, MASK, CAUSAL, IS_FP8, V_KMAJOR, P_OFFSET,
                                                RESCALE_SKIP)
            pv, s_next = warpgroup_mma_wait(0, deps=(pv, s_acc))
            acc = fold_pv(acc, alpha_o, pv, IS_FP8)
            release_slot(empty_bars, j % STAGES)
        if lo < hi:
            j = hi - 1
            c = c_q * gl.load(k_scale_row + ((j * BLOCK_N) // SCALE_BLOCK) * stride_ksblk)
            pv, alpha_o, m_i, l_i = _softmax_pv(s_next, j, v_bufs, v_bars, acc, m_i, l_i, c, offs_m, offs_n0,
                                                seqlen_q, seqlen_k, MASK, CAUSAL, IS_FP8, V_KMAJOR, P_OFFSET,
                                                RESCALE_SKIP)
            pv = warpgroup_mma_wait(0, deps=(pv, ))
            acc = fold_pv(acc, alpha_o, pv, IS_FP8)
            release_slot(empty_bars, j % STAGES)
    else:
        for j in range(lo, hi):
            c = c_q * gl.load(k_scale_row + ((j * BLOCK_N) // SCALE_BLOCK) * stride_ksblk)
            s = qk_async(q_smem, 0, k_bufs, wait_k(k_bars, j, STAGES), s_zero, QK_CHUNKS)
            s = warpgroup_mma_wait(0, deps=(s, ))
            pv, alpha_o, m_i, l_i = _softmax_pv(s, j, v_bufs, v_bars, acc, m_i, l_i, c, offs_m, offs_n0,
                                                seqlen_q, seqlen_k, MASK, CAUSAL, IS_FP8, V_KMAJOR, P_OFFSET,
                                                RESCALE_SKIP)
            pv = warpgroup_mma_wait(0, deps=(pv, ))
            acc = fold_pv(acc, alpha_o, pv, IS_FP8)
            release_slot(empty_bars, j % STAGES)
    return acc, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, empty_bars,
              out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
              q_scale_ptr, stride_qsb, stride_qsh, stride_qsblk,
              k_scale_ptr, stride_ksb, stride_ksh, stride_ksblk,
              v_scale_ptr, stride_vsb, stride_vsh, stride_vsd,
              k_mean_ptr, stride_kmb, stride_kmh, stride_kmd,
              seqlen_q, seqlen_k, qk_scale, sm_scale,
              pid_bh, b, h, hkv, m_start, n_full, n_end,
              HEAD_DV: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, V_KMAJOR: gl.constexpr,
              RETURN_LSE: gl.constexpr, HAS_KMEAN: gl.constexpr, RESCALE_SKIP: gl.constexpr,
              PIPE: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    QK_CHUNKS: gl.constexpr = q_smem.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    BITS: gl.constexpr = 8 if IS_FP8 else 16
    P_OFFSET: gl.constexpr = 8.0 if IS_FP8 else 0.0
    s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N, BITS)
    o_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DV, BITS)

    c_q = qk_scale * gl.load(q_scale_ptr + b * stride_qsb + h * stride_qsh + (m_start // SCALE_BLOCK) * stride_qsblk)
    k_scale_row = k_scale_ptr + b * stride_ksb + hkv * stride_ksh
    offs_m = m_start + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DV], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bar.index(0), 0)
    acc, m_i, l_i = _attend_blocks(0, n_full, q_smem, k_bufs, v_bufs, k_bars, v_bars, empty_bars,
                                   acc, m_i, l_i, c_q, k_scale_row, stride_ksblk, offs_m, seqlen_q, seqlen_k,
                                   False, CAUSAL, IS_FP8, V_KMAJOR, P_OFFSET, RESCALE_SKIP, PIPE, num_warps)
    acc, m_i, l_i = _attend_blocks(n_full, n_end, q_smem, k_bufs, v_bufs, k_bars, v_bars, empty_bars,
                                   acc, m_i, l_i, c_q, k_scale_row, stride_ksblk, offs_m, seqlen_q, seqlen_k,
                                   True, CAUSAL, IS_FP8, V_KMAJOR, P_OFFSET, RESCALE_SKIP, PIPE, num_warps)

    # Epilogue: O = acc / l * v_scale; LSE.
    inv_l, lse = finish_rows(m_i, l_i, P_OFFSET)
    store_output(acc, inv_l, m_start, out_ptr, stride_ob, stride_os, stride_oh, b, h, hkv,
                 v_scale_ptr, stride_vsb, stride_vsh, stride_vsd, seqlen_q)
    if RETURN_LSE:
        if HAS_KMEAN:
            corr = kmean_lse_term(q_smem, 0, QK_CHUNKS, k_mean_ptr, stride_kmb, stride_kmh, stride_kmd, b, hkv,
                                  (c_q / qk_scale) * sm_scale, num_warps)
            lse = lse + gl.convert_layout(corr, gl.SliceLayout(1, s_layout))
        gl.store(lse_ptr + pid_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


# ----------------------------------------------------------------------------- kernel

# head counts vary per call: not specialized, so new head layouts reuse the compiled kernel
# (sequence lengths stay specialized, as measured; see the portable kernel's note)
@gluon.jit(do_not_specialize=["num_heads", "group_size", "num_m_tiles"])
def attn_fwd_ws_kernel(
    q_desc, k_desc, v_desc,
    out_ptr, stride_ob, stride_os, stride_oh,
    lse_ptr,
    q_scale_ptr, stride_qsb, stride_qsh, stride_qsblk,
    k_scale_ptr, stride_ksb, stride_ksh, stride_ksblk,
    v_scale_ptr, stride_vsb, stride_vsh, stride_vsd,
    k_mean_ptr, stride_kmb, stride_kmh, stride_kmd,
    seqlen_q, seqlen_k, num_heads, group_size, num_m_tiles,
    qk_scale,  # softmax_scale * log2(e)
    sm_scale,  # softmax_scale (for the K-mean LSE correction)
    HEAD_DQK: gl.constexpr, HEAD_DV: gl.constexpr,
    CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, V_KMAJOR: gl.constexpr,
    RETURN_LSE: gl.constexpr, HAS_KMEAN: gl.constexpr, STAGES: gl.constexpr,
    RESCALE_SKIP: gl.constexpr, PIPE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    DCHUNK: gl.constexpr = q_desc.block_type.shape[3]
    QK_CHUNKS: gl.constexpr = HEAD_DQK // DCHUNK
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]

    pid_bh, b, h, hkv, m_start = program_tile(num_heads, group_size, num_m_tiles, BLOCK_M)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [QK_CHUNKS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES * QK_CHUNKS] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = alloc_barriers(1)
    k_bars = alloc_barriers(STAGES)
    v_bars = alloc_barriers(STAGES)
    empty_bars = alloc_barriers(STAGES)

    n_full, n_end = kv_block_range(m_start, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)

    gl.warp_specialize([
        (_consumer, (q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, empty_bars,
                     out_ptr, stride_ob, stride_os, stride_oh, lse_ptr,
                     q_scale_ptr, stride_qsb, stride_qsh, stride_qsblk,
                     k_scale_ptr, stride_ksb, stride_ksh, stride_ksblk,
                     v_scale_ptr, stride_vsb, stride_vsh, stride_vsd,
                     k_mean_ptr, stride_kmb, stride_kmh, stride_kmd,
                     seqlen_q, seqlen_k, qk_scale, sm_scale,
                     pid_bh, b, h, hkv, m_start, n_full, n_end,
                     HEAD_DV, CAUSAL, IS_FP8, V_KMAJOR, RETURN_LSE, HAS_KMEAN, RESCALE_SKIP, PIPE, num_warps)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, empty_bars,
                     b, h, hkv, m_start, n_end, V_KMAJOR)),
    ], [1], [PRODUCER_REGS])

    invalidate_barriers(q_bar, 1)
    invalidate_barriers(k_bars, STAGES)
    invalidate_barriers(v_bars, STAGES)
    invalidate_barriers(empty_bars, STAGES)
