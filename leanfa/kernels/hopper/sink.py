"""BF16 sink keys inside the v3 FP8 kernel (``attention(..., precision="fp8", bf16_sink_keys=128)``).

On model-like activations most of the FP8 error is the attention sink's score (docs/accuracy-notes.md):
keys ``[0, 128)`` of every sequence are attended from the 16-bit Q, K and V instead, after the FP8
key blocks ``[1, n_end)``, in the same online softmax -- the portable kernel's scheme
(:mod:`leanfa.sink_split`), here with BF16 wgmmas. Per tile the producer loads, with the FP8 Q, each
warpgroup's 64 rows of the 16-bit Q and the sink's K and V (token-major) into buffers of their own
(``load_sink``); after its last FP8 block a consumer warpgroup runs one 16-bit block
(``sink_block``):

* ``S = Q16 K16^T`` (fp32), minus ``q . k_mean`` per row when K was smoothed (the FP8 scores are
  ``q . (k - mean)``), masked like key block 0, scaled by ``softmax_scale * log2(e)`` alone;
* the same Lean-P step as the FP8 blocks (``P_OFFSET`` included), P in BF16;
* ``O = O * alpha + (P V16) / v_scale``: the FP8 accumulator holds O in units of V's per-channel
  descale, the sink's P V is in real units.

The sink block is always 128 keys (one FP8 key block; the kernel's FP8 loop starts at block 1).
"""

from __future__ import annotations

from .gluon_compat import gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .epilogue import kmean_lse_term
from .layouts import a_operand_layout, wgmma_layout
from .masking import mask_scores
from .pipeline import as_2d
from .softmax import online_softmax_step


@gluon.jit
def load_sink(qs_desc, ks_desc, vs_desc, bar, qs_smem, ks_smem, vs_smem, tma_b, h, hkv, q_row0, k_start,
              WGS: gl.constexpr):
    """The tile's 16-bit Q rows (``WGS`` boxes of 64 from token ``q_row0``) and the sequence's first
    128 keys and values (from token ``k_start``), all on one barrier."""
    ROWS: gl.constexpr = qs_desc.block_type.shape[2]
    mbarrier.expect(bar, WGS * qs_desc.block_type.nbytes + ks_desc.block_type.nbytes + vs_desc.block_type.nbytes)
    for w in gl.static_range(WGS):
        tma.async_copy_global_to_shared(qs_desc, [tma_b, h, q_row0 + w * ROWS, 0], bar, qs_smem.index(w))
    tma.async_copy_global_to_shared(ks_desc, [tma_b, hkv, k_start, 0], bar, ks_smem.index(0))
    tma.async_copy_global_to_shared(vs_desc, [tma_b, hkv, k_start, 0], bar, vs_smem.index(0))


@gluon.jit
def sink_block(qs_smem, ks_smem, vs_smem, W: gl.constexpr, acc, m_i, l_i, offs_m, seqlen_q, seqlen_k, qk_scale,
               inv_v_scale, k_mean_ptr, stride_kmb, stride_kmh, stride_kmd, b, hkv,
               s_layout: gl.constexpr, o_layout: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
               P_OFFSET: gl.constexpr, num_warps: gl.constexpr):
    """Warpgroup ``W``'s sink block (its buffers loaded and waited for): ``(acc, m_i, l_i, q_shift)``
    with ``q_shift = q16 . k_mean`` per row (0 when ``SHIFT`` is off); ``s_layout``/``o_layout``: the
    FP8 blocks' S and O layouts (``m_i`` is in ``SliceLayout(1, s_layout)``)."""
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    BLOCK_N: gl.constexpr = ks_smem.shape[3]
    HEAD_DV: gl.constexpr = acc.shape[1]
    s16_layout: gl.constexpr = wgmma_layout(num_warps, BLOCK_N, 16)
    o16_layout: gl.constexpr = wgmma_layout(num_warps, HEAD_DV, 16)

    s_acc = warpgroup_mma(as_2d(qs_smem.index(W)), as_2d(ks_smem.index(0)).permute((1, 0)),
                          gl.zeros([acc.shape[0], BLOCK_N], gl.float32, s16_layout), use_acc=False, is_async=True)
    s = gl.convert_layout(warpgroup_mma_wait(0, deps=(s_acc, )), s_layout)
    q_shift = gl.zeros_like(m_i)
    if SHIFT:
        q_shift = gl.convert_layout(kmean_lse_term(qs_smem, W, 1, k_mean_ptr, stride_kmb, stride_kmh, stride_kmd,
                                                   b, hkv, 1.0, num_warps), row_layout)
        s = s - q_shift[:, None]
    s = mask_scores(s, offs_m, gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout)), seqlen_q, seqlen_k, CAUSAL)
    p, m_i, l_i, alpha = online_softmax_step(s, qk_scale, m_i, l_i, P_OFFSET)
    p16 = gl.convert_layout(p.to(vs_smem.dtype), a_operand_layout(o16_layout, 16))
    pv_acc = warpgroup_mma(p16, as_2d(vs_smem.index(0)), gl.zeros([acc.shape[0], HEAD_DV], gl.float32, o16_layout),
                           use_acc=False, is_async=True)
    pv = gl.convert_layout(warpgroup_mma_wait(0, deps=(pv_acc, )), o_layout)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc = gl.fma(acc, alpha_o, pv * inv_v_scale[None, :])
    return acc, m_i, l_i, q_shift
