"""The Hopper (sm90) attention forward kernel.

One CTA computes one ``BLOCK_M x Dv`` output tile of one (batch, query head): ``num_warps``
= 4 per consumer warpgroup, 64 query rows per warpgroup. Q is loaded once by TMA; K/V stream
through a ``STAGES``-deep shared-memory ring (see :mod:`.pipeline`), prefetched ``STAGES - 1``
blocks ahead. Per key block::

    S = Q K^T                       (wgmma, operands in shared memory, fp32 accumulator)
    P = exp2(S * c - (m - offset))  (Lean P, :mod:`.softmax`; masked only on diagonal/tail blocks)
    O = O * alpha + P V             (wgmma, P from registers; FP8: fresh fp32 block result
                                     added to O -- two-level accumulation)

Causal tiles visit only the key blocks some row can see, and are scheduled heaviest first.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait

from .epilogue import kmean_lse_term, store_output
from .layouts import a_operand_layout, wgmma_layout
from .masking import kv_block_range, mask_scores
from .pipeline import (
    alloc_barriers,
    invalidate_barriers,
    load_kv,
    load_q,
    qk_async,
    v_tile,
    wait_k,
)
from .schedule import program_tile
from .softmax import finish_rows, online_softmax_step

SCALE_BLOCK = gl.constexpr(128)  # tokens per Q/K scale block (leanfa.scales.SCALE_BLOCK)


@gluon.jit
def _attend_blocks(lo, hi, n_end, q_smem, k_desc, v_desc, k_bufs, v_bufs, k_bars, v_bars,
                   b, hkv, acc, m_i, l_i, c_q, k_scale_ptr, stride_ksb, stride_ksh, stride_ksblk,
                   offs_m, seqlen_q, seqlen_k,
                   MASK: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr,
                   V_KMAJOR: gl.constexpr, STAGES: gl.constexpr, P_OFFSET: gl.constexpr,
                   num_warps: gl.constexpr):
    """Run key blocks ``[lo, hi)``; ``MASK`` for the diagonal/tail blocks."""
    BLOCK_M: gl.constexpr = q_smem.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    QK_CHUNKS: gl.constexpr = q_smem.shape[0]
    BITS: gl.constexpr = 8 if IS_FP8 else 16
    s_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N, BITS)
    o_layout: gl.constexpr = acc.type.layout
    p_layout: gl.constexpr = a_operand_layout(o_layout, BITS)
    p_dtype: gl.constexpr = q_smem.dtype
    offs_n0 = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    k_scale_row = k_scale_ptr + b * stride_ksb + hkv * stride_ksh

    for j in range(lo, hi):
        # Every warpgroup is done with block j-1 (its wgmmas were waited on): refill its slot.
        gl.thread_barrier()
        nxt = j + STAGES - 1
        if nxt < n_end:
            load_kv(k_desc, v_desc, b, hkv, nxt, k_bufs, v_bufs, k_bars, v_bars, STAGES, V_KMAJOR, QK_CHUNKS)
        c = c_q * gl.load(k_scale_row + ((j * BLOCK_N) // SCALE_BLOCK) * stride_ksblk)

        # S = Q K^T
        slot = wait_k(k_bars, j, STAGES)
        s = qk_async(q_smem, 0, k_bufs, slot, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), QK_CHUNKS)
        s = warpgroup_mma_wait(0, deps=(s, ))
        if MASK:
            s = mask_scores(s, offs_m, j * BLOCK_N + offs_n0, seqlen_q, seqlen_k, CAUSAL)

        # Lean P
        p, m_i, l_i, alpha = online_softmax_step(s, c, m_i, l_i, P_OFFSET)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(p_dtype), p_layout)

        # O = O * alpha + P V
        v = v_tile(v_bufs, v_bars, j, STAGES, V_KMAJOR)
        if IS_FP8:
            # two-level accumulation: this block's PV in a fresh fp32 tile, folded in by one FFMA
            pv = warpgroup_mma(p_op, v, gl.zeros_like(acc), use_acc=False, is_async=True)
            pv = warpgroup_mma_wait(0, deps=(pv, ))
            acc = gl.fma(acc, alpha_o, pv)
        else:
            acc = warpgroup_mma(p_op, v, acc * alpha_o, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
    return acc, m_i, l_i


# head counts vary per call: not specialized, so new head layouts reuse the compiled kernel
# (sequence lengths stay specialized, as measured; see the portable kernel's note)
@gluon.jit(do_not_specialize=["num_heads", "group_size", "num_m_tiles"])
def attn_fwd_kernel(
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
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
    DCHUNK: gl.constexpr = q_desc.block_type.shape[3]
    QK_CHUNKS: gl.constexpr = HEAD_DQK // DCHUNK
    BITS: gl.constexpr = 8 if IS_FP8 else 16
    P_OFFSET: gl.constexpr = 8.0 if IS_FP8 else 0.0
    s_layout: gl.constexpr = wgmma_layout(num_warps, k_desc.block_type.shape[2], BITS)
    o_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DV, BITS)

    pid_bh, b, h, hkv, m_start = program_tile(num_heads, group_size, num_m_tiles, BLOCK_M)

    # Shared memory: Q, the K/V ring, barriers.
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [QK_CHUNKS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES * QK_CHUNKS] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = alloc_barriers(1)
    k_bars = alloc_barriers(STAGES)
    v_bars = alloc_barriers(STAGES)

    n_full, n_end = kv_block_range(m_start, seqlen_q, seqlen_k, BLOCK_M, k_desc.block_type.shape[2], CAUSAL)

    # Prologue: Q, then the first STAGES-1 key blocks.
    load_q(q_desc, b, h, m_start, q_bar.index(0), q_smem, QK_CHUNKS)
    for i in gl.static_range(STAGES - 1):
        if i < n_end:
            load_kv(k_desc, v_desc, b, hkv, i, k_bufs, v_bufs, k_bars, v_bars, STAGES, V_KMAJOR, QK_CHUNKS)

    # Q's dequant scale is one number per tile (BLOCK_M == SCALE_BLOCK), folded into c.
    c_q = qk_scale * gl.load(q_scale_ptr + b * stride_qsb + h * stride_qsh + (m_start // SCALE_BLOCK) * stride_qsblk)
    offs_m = m_start + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DV], gl.float32, o_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bar.index(0), 0)
    # Unmasked blocks, then the diagonal and tail blocks.
    acc, m_i, l_i = _attend_blocks(0, n_full, n_end, q_smem, k_desc, v_desc, k_bufs, v_bufs, k_bars, v_bars,
                                   b, hkv, acc, m_i, l_i, c_q, k_scale_ptr, stride_ksb, stride_ksh,
                                   stride_ksblk, offs_m, seqlen_q, seqlen_k,
                                   False, CAUSAL, IS_FP8, V_KMAJOR, STAGES, P_OFFSET, num_warps)
    acc, m_i, l_i = _attend_blocks(n_full, n_end, n_end, q_smem, k_desc, v_desc, k_bufs, v_bufs, k_bars, v_bars,
                                   b, hkv, acc, m_i, l_i, c_q, k_scale_ptr, stride_ksb, stride_ksh,
                                   stride_ksblk, offs_m, seqlen_q, seqlen_k,
                                   True, CAUSAL, IS_FP8, V_KMAJOR, STAGES, P_OFFSET, num_warps)

    # Epilogue: O = acc / l * v_scale; LSE.
    inv_l, lse = finish_rows(m_i, l_i, P_OFFSET)
    store_output(acc, inv_l, m_start, out_ptr, stride_ob, stride_os, stride_oh, b, h, hkv,
                 v_scale_ptr, stride_vsb, stride_vsh, stride_vsd, seqlen_q)
    if RETURN_LSE:
        if HAS_KMEAN:  # K was smoothed (K - mean): add back softmax_scale * <q_row, mean> per row
            corr = kmean_lse_term(q_smem, 0, QK_CHUNKS, k_mean_ptr, stride_kmb, stride_kmh, stride_kmd, b, hkv,
                                  (c_q / qk_scale) * sm_scale, num_warps)
            lse = lse + gl.convert_layout(corr, gl.SliceLayout(1, s_layout))
        gl.store(lse_ptr + pid_bh.to(gl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)

    invalidate_barriers(q_bar, 1)
    invalidate_barriers(k_bars, STAGES)
    invalidate_barriers(v_bars, STAGES)
