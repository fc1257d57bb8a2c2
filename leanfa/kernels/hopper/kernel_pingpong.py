"""The Hopper (sm90) attention forward kernel: a TMA producer warp and two consumer warpgroups,
each in its own partition.

The CTA tile is 128 query rows of one head of one sequence (dense, or packed varlen through
``cu_seqlens``); a program computes one tile, or -- ``PERSISTENT``, the default for dense FP8 at head
dim <= 128 (:func:`.launch.persistent_default`; with the TMA-store epilogue, ``STORE_TMA``, 1.38x the
one-tile grid at S = 1K, run 48) -- one per round of a tile walk (:mod:`.schedule`). The partitions are:

* **producer** (1 warp, 24 registers): per tile, both 64-row halves of Q (one barrier each; the
  next tile's only after ``q_empty`` saw both consumers' last QK retire), then every key block the tile
  visits through the ``STAGES``-deep K/V ring; ring position ``g`` (counted over the program's
  tiles) is refilled after ``empty[g % STAGES]`` saw both consumers release ``g - STAGES``.
* **two consumers** (4 warps each, 240 registers): warpgroup ``w`` owns query rows
  ``[64 w, 64 w + 64)`` and runs the whole key loop on its own -- nothing couples the two but
  the K/V ring. Left alone, the two partitions drift out of step and overlap each other's softmax
  with wgmmas (docs/perf-notes.md, run 10).

Per key block a consumer computes the Lean-P softmax (:mod:`.softmax`: one FFMA and one MUFU
exponential per score) and issues ``[PV_j, QK_{j+1}]`` together. ``IS_FP8`` decides the QK side (FP8
Q and K, S from an FP8 wgmma), ``MIXED`` splits the PV side off it: an FP8 call with a 16-bit V (the
mixed mode, ``attention(precision="fp8qk")``) packs P to V's dtype and runs PV as the 16-bit path does
(a 16-bit wgmma accumulating into O, V token-major, no P offset). FP8 PV keeps the two-level
accumulation (a fresh fp32 tile per block, folded into O by one FFMA), so no block's products sit in
the FP8 wgmma accumulator for long; at head dim 256 (:func:`.launch.wide_head`) O alone takes 128
registers, so FP8 PV accumulates in O itself (``PV_IN_MMA``, ``acc * alpha`` fed back in) and BF16
runs 64-key blocks. ``SOFTCAP`` (flash-attn's ``softcap``) caps the scores first: one more MUFU op (tanh) per
score (:func:`_softmax_block`). ``ABLATE`` (:mod:`.ablation`) leaves parts out to time them (wrong results).

The key loop runs blocks ``[0, n_end - 1)`` with the next block's S issued alongside their PV and
the last block peeled off (:func:`_consumer_block`), so that every loop value has one definition
per iteration (a conditional QK made ptxas copy S's 64 registers at every block). The softmax of block
j + 1 under PV_j (FA3's intra-warpgroup overlap) was built four times and measured slower every time
(runs 14, 20, 53-54, 66; docs/perf-notes.md): the last build carried P in fp32 across the back edge, but
ptxas reuses P_j's registers (PV_j's A operand) for the next softmax and so retires PV_j before it.
Options measured not to pay were deleted (docs/perf-notes.md, "Deleted experiments").
"""

from __future__ import annotations

from .gluon_compat import gl, gluon, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .ablation import ABLATE_ONEWG, ablates
from .epilogue import kmean_lse_term, load_v_scale, stage_and_copy, stage_and_store, write_rows
from .layouts import a_operand_layout, p_operand, staged_out_layout, wgmma_layout
from .masking import kv_block_range, mask_band, mask_scores, window_block_range
from .pipeline import alloc_barriers, invalidate_barriers, load_q, produce_kv, qk_async, release_slot, v_tile, wait_k
from .schedule import program_tiles, round_tile, sequence_bounds, tile_coords, varlen_tile_coords
from .sink import load_sink, sink_block
from .softmax import (capped_scores, finish_rows, fold_pv, online_softmax_step, row_sums_like, row_totals,
                      thread_row_sums)
from .trace import record_clock, record_clock_rows, record_smid, trace_row

SCALE_BLOCK = gl.constexpr(128)  # tokens per Q/K scale block (leanfa.scales.SCALE_BLOCK)
WG_WARPS = gl.constexpr(4)  # warps per consumer warpgroup
WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)
WGS = gl.constexpr(2)  # consumer warpgroups: a tile is WGS x 64 query rows
CONSUMER_REGS = gl.constexpr(240)  # registers per consumer thread (setmaxnreg) ...
PRODUCER_REGS = gl.constexpr(24)  # ... and per producer thread: 2 x 4 x 240 + 24 <= 3 x 4 x 168 at launch


# ----------------------------------------------------------------------------- tiles

@gluon.jit
def _tile(t, num_bh, num_heads, group_size, num_m_tiles, num_tiles, seqlen_q, seqlen_k, cu_seqlens_q, seqs_t,
          tiles, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, VARLEN: gl.constexpr):
    """Everything about tile ``t`` (``WGS`` x 64 query rows) every partition needs: ``(b, h, hkv, m_start, tma_b, q_start,
    k_start, seqlen_q, seqlen_k, n_full, n_end, rows_q)``. A ``t`` past the last tile (a persistent
    program's last round may have none) reads as the last tile with no rows and no key blocks. ``seqs_t`` is
    ``(cu_seqlens_k, seqused_k, seqused_q)``: with ``seqused_k`` (FA3's, int32 per sequence; None: off) sequence ``b``
    has only its first ``seqused_k[b]`` keys (the causal alignment and the tail mask use that length); with
    ``seqused_q`` only its first ``seqused_q[b]`` query rows attend (``seqlen_q``, which the causal alignment and the
    key-block range use), and ``rows_q`` is the sequence's whole row count, every row of which the epilogue writes
    (those past ``seqlen_q`` as 0 with LSE -inf, :func:`_consumer_tile`). Without ``seqused_q``, ``rows_q`` is
    ``seqlen_q``."""
    cu_seqlens_k, seqused_k, seqused_q = seqs_t
    valid = t < num_tiles
    if VARLEN:  # (the tile table, varlen_tiles.py)
        b, h, hkv, m_start = varlen_tile_coords(gl.maximum(gl.minimum(t, num_tiles - 1), 0), tiles, num_heads,
                                                group_size, WGS * WG_ROWS)
    else:
        b, h, hkv, m_start = tile_coords(gl.minimum(t, num_tiles - 1), num_bh, num_heads, group_size, num_m_tiles,
                                         WGS * WG_ROWS)
    tma_b, q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(cu_seqlens_q, cu_seqlens_k, b, seqlen_q, seqlen_k,
                                                                  VARLEN)
    if seqused_k is not None:
        seqlen_k = gl.minimum(gl.load(seqused_k + b), seqlen_k)
    if seqused_q is not None:
        rows_q = gl.where(valid, seqlen_q, 0)
        seqlen_q = gl.minimum(gl.load(seqused_q + b), seqlen_q)
    seqlen_q = gl.where(valid, seqlen_q, 0)
    if seqused_q is None:
        rows_q = seqlen_q
    n_full, n_end = kv_block_range(m_start, seqlen_q, seqlen_k, WGS * WG_ROWS, BLOCK_N, CAUSAL)
    return b, h, hkv, m_start, tma_b, q_start, k_start, seqlen_q, seqlen_k, n_full, n_end, rows_q


@gluon.jit
def _fp8_blocks(n_end, SINK: gl.constexpr):
    """Key blocks of a tile that go through the ring: ``[0, n_end)``, or with BF16 sink keys ``[1, n_end)``
    (block 0 is read in 16 bits, :mod:`.sink`)."""
    if SINK:
        return gl.maximum(n_end - 1, 0)
    return n_end


# ----------------------------------------------------------------------------- producer

@gluon.jit
def _producer(args, cu_seqlens_v, sink_t, CAUSAL: gl.constexpr, V_KMAJOR: gl.constexpr, VARLEN: gl.constexpr,
              CONSUMERS: gl.constexpr, SINK: gl.constexpr, WINDOW: gl.constexpr = False, pages_t=None,
              PAGE_SIZE: gl.constexpr = 0):
    """Per tile: the ``WGS`` 64-row Q boxes (after the consumers released the previous tile's), then
    the tile's key blocks through the ring; ``ring`` counts key blocks over all of this program's
    tiles. ``CONSUMERS`` is ``WGS`` (1 only in the ``onewg`` timing ablation: no Q box for the idle
    warpgroups). ``cu_seqlens_v``: ``None``, or (FP8 varlen) each sequence's first token in V's
    descriptor, a multiple of 16 (:func:`.launch.align_varlen_v`). ``SINK`` (BF16 sink keys, :mod:`.sink`):
    ``sink_t`` holds the 16-bit Q/K/V descriptors, their buffers and barrier; the tile's 16-bit Q and
    sink block load with its Q, and the FP8 blocks start at block 1. ``WINDOW``: only the blocks of the tile's
    band, ``[n_start, n_end)`` (:func:`.masking.window_block_range`, ``window`` = (left, right)). ``PAGE_SIZE`` > 0
    (paged K/V): ``pages_t`` is ``(page_table, stride_b, stride_n)``, and the key blocks load page by page
    (:func:`.pipeline.load_kv_paged`; a window's blocks are the sequence's absolute key blocks too; FP8 V,
    ``V_KMAJOR``, from its dense transposed copy's row of sequence ``b``)."""
    (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, q_empty, k_bars, v_bars, empty_bars,
     seqlen_q, seqlen_k, cu_seqlens_q, seqs_t, tiles, num_bh, num_heads, group_size, num_m_tiles,
     first_tile, tile_step, num_tiles, window) = args
    QK_CHUNKS: gl.constexpr = k_bufs.shape[0] // v_bufs.shape[0]
    ring = 0
    qi = 0  # Q tiles loaded so far (tiles with no key block to visit load none)
    for r in range(0, (num_tiles + tile_step - 1) // tile_step):
        t = round_tile(r, first_tile, tile_step)
        b, h, hkv, m_start, tma_b, q_start, k_start, sq, sk, n_full, n_end, _ = _tile(
            t, num_bh, num_heads, group_size, num_m_tiles, num_tiles, seqlen_q, seqlen_k, cu_seqlens_q,
            seqs_t, tiles, k_bufs.shape[3], CAUSAL, VARLEN)
        if WINDOW:
            n_start, n_lfull, n_full, n_end = window_block_range(m_start, sq, sk, n_full, n_end, window[0], window[1],
                                                                 WGS * WG_ROWS, k_bufs.shape[3])
        if n_end > 0:
            if qi > 0:
                mbarrier.wait(q_empty.index(0), (qi - 1) & 1)
            for w in gl.static_range(CONSUMERS):  # Q box w -> q_smem[w * QK_CHUNKS + c], barrier q_bars[w]
                # (two load_q calls, not `if SINK and n_end < 2: arrive / else: load_q`: that form leaves the
                # default PTX alone too, but costs the SINK build 28-36 B more spills in sm90 AOT)
                if SINK:  # a tile whose only key block is the sink has no FP8 QK: its barrier completes empty
                    if n_end > 1:
                        load_q(q_desc, tma_b, h, q_start + m_start + w * WG_ROWS, q_bars.index(w), q_smem,
                               QK_CHUNKS, w * QK_CHUNKS)
                    else:
                        mbarrier.arrive(q_bars.index(w), count=1)
                else:
                    load_q(q_desc, tma_b, h, q_start + m_start + w * WG_ROWS, q_bars.index(w), q_smem, QK_CHUNKS,
                           w * QK_CHUNKS)
            if SINK:
                qs_desc, ks_desc, vs_desc, qs_smem, ks_smem, vs_smem, sink_bar = sink_t
                load_sink(qs_desc, ks_desc, vs_desc, sink_bar.index(0), qs_smem, ks_smem, vs_smem, tma_b, h, hkv,
                          q_start + m_start, k_start, CONSUMERS)
            qi += 1
        if cu_seqlens_v is None:
            v_start = None
        else:
            v_start = gl.load(cu_seqlens_v + b)
        FIRST: gl.constexpr = 1 if SINK else 0
        if PAGE_SIZE > 0:  # this sequence's row of the page table
            page_table, stride_ptb, stride_ptn = pages_t
            pages = (page_table + b * stride_ptb, stride_ptn)
            kv_b = b  # (FP8 V: the dense transposed copy has a row per sequence, varlen too)
        else:
            pages = None
            kv_b = tma_b
        if WINDOW:  # (no sink: the two are not combined)
            produce_kv(k_desc, v_desc, kv_b, hkv, n_end, k_bufs, v_bufs, k_bars, v_bars, empty_bars, V_KMAJOR,
                       k_start, ring, v_start, n_start, pages, sk, PAGE_SIZE)
            ring += n_end - n_start
        else:
            produce_kv(k_desc, v_desc, kv_b, hkv, n_end, k_bufs, v_bufs, k_bars, v_bars, empty_bars, V_KMAJOR,
                       k_start, ring, v_start, FIRST, pages, sk, PAGE_SIZE)
            ring += _fp8_blocks(n_end, SINK)


# ----------------------------------------------------------------------------- consumer pieces

@gluon.jit
def _issue_qk(q_smem, k_bufs, k_bars, j, s_zero, W: gl.constexpr, QK_CHUNKS: gl.constexpr):
    """Wait for key block ``j`` and issue S = Q_W K_j^T (async)."""
    STAGES: gl.constexpr = k_bufs.shape[0] // QK_CHUNKS
    return qk_async(q_smem, W * QK_CHUNKS, k_bufs, wait_k(k_bars, j, STAGES), s_zero, QK_CHUNKS)


@gluon.jit
def _softmax_block(s, j, c, m_i, l_i, offs_m, offs_n0, seqlen_q, seqlen_k, n_full, band,
                   p_dtype: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr,
                   CAUSAL: gl.constexpr, P_OFFSET: gl.constexpr, ABLATE: gl.constexpr, WINDOW: gl.constexpr = False,
                   cap=None, SOFTCAP: gl.constexpr = 0):
    """Lean P of key block ``j`` (masked on the diagonal / tail blocks only; ``c``: the block's
    score scale): the PV operand P, the new row max and sum, and the factor ``alpha`` (O's layout)
    that rescales O to the new max. ``WINDOW``: ``band = (n_start, n_lfull, left, right)``, the blocks before
    ``n_lfull`` masked too (:func:`.masking.mask_band`). ``SOFTCAP`` (1; 2: with the per-row shift of a smoothed
    K): the scores are capped first (:func:`.softmax.capped_scores`, ``c`` then scales tanh's argument),
    ``cap = (softcap * log2(e), shift)``, and masked after capping."""
    BLOCK_N: gl.constexpr = s.shape[1]
    PARTIAL_L: gl.constexpr = len(l_i.shape) == 2  # per-thread partial row sums (see _consumer_tile)
    if SOFTCAP:  # tanh(s c + shift) in [-1, 1]; the softmax scales it by softcap * log2(e)
        s = capped_scores(s, c, cap[1], SOFTCAP == 2)
        c = cap[0]
    if WINDOW:
        if (j < band[1]) | (j >= n_full):
            s = mask_band(s, offs_m, j * BLOCK_N + offs_n0, seqlen_q, seqlen_k, band[2], band[3])
    else:
        if j >= n_full:
            s = mask_scores(s, offs_m, j * BLOCK_N + offs_n0, seqlen_q, seqlen_k, CAUSAL)
    p, m_i, l_i, alpha = online_softmax_step(s, c, m_i, l_i, P_OFFSET, ABLATE, PARTIAL_L)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = p_operand(p, p_dtype, p_layout)
    return p_op, m_i, l_i, alpha_o


@gluon.jit
def _k_scale(k_scale_row, stride_ksblk, key, valid):
    """The K dequantization scale of the ``SCALE_BLOCK`` tokens holding ``key``; 1 where not
    ``valid`` (nothing is read)."""
    return gl.load(k_scale_row + (key // SCALE_BLOCK) * stride_ksblk, mask=valid, other=1.0)


@gluon.jit
def _issue_pv(p_op, v, acc, alpha_o, TWO_LEVEL: gl.constexpr):
    """Issue PV (async). Two-level (FP8): into a fresh fp32 tile that :func:`.softmax.fold_pv` adds to O;
    otherwise into O itself, rescaled first."""
    if TWO_LEVEL:
        pv_acc = warpgroup_mma(p_op, v, gl.zeros_like(acc), use_acc=False, is_async=True)
    else:
        pv_acc = warpgroup_mma(p_op, v, acc * alpha_o, is_async=True)
    return pv_acc


@gluon.jit
def _consumer_block(s, j, c, acc, m_i, l_i, offs_m, offs_n0, seqlen_q, seqlen_k, n_full, band, q_smem, k_bufs, v_bufs,
                    k_bars, v_bars, empty_bars, ring, s_zero, tr, v_scale_row, stride_vsd,
                    p_layout: gl.constexpr, o_layout: gl.constexpr, CAUSAL: gl.constexpr, V_KMAJOR: gl.constexpr,
                    P_OFFSET: gl.constexpr, ABLATE: gl.constexpr, TWO_LEVEL: gl.constexpr, NEXT: gl.constexpr,
                    READ_VS: gl.constexpr, W: gl.constexpr, WINDOW: gl.constexpr = False, cap=None,
                    SOFTCAP: gl.constexpr = 0):
    """Key block ``j`` (ring position ``ring + j``): softmax of its scores ``s``, then ``[PV_j, QK_{j+1}]``
    (``NEXT``; else PV_j alone) issued together and waited for, PV folded into O and the K/V slot
    released. Returns ``(acc, m_i, l_i, S_{j+1}, v_scale)``: with ``READ_VS`` (the last block) V's descale
    for the epilogue (:func:`.epilogue.load_v_scale`), read once S is dead so that the load's latency hides
    under the block's PV (0 otherwise). ``tr``: this warpgroup's trace record (:mod:`.trace`), or ``None``.
    ``cap``, ``SOFTCAP``: soft-capping (:func:`_softmax_block`)."""
    QK_CHUNKS: gl.constexpr = k_bufs.shape[0] // v_bufs.shape[0]
    STAGES: gl.constexpr = v_bufs.shape[0]
    p_op, m_i, l_i, alpha_o = _softmax_block(s, j, c, m_i, l_i, offs_m, offs_n0, seqlen_q, seqlen_k, n_full, band,
                                             v_bufs.dtype, p_layout, o_layout, CAUSAL, P_OFFSET, ABLATE, WINDOW, cap,
                                             SOFTCAP)
    if READ_VS:
        v_sc = load_v_scale(v_scale_row, stride_vsd, acc.shape[1], o_layout)
    else:
        v_sc = 0.0
    record_clock_rows(tr, 1 + j, 0, row_sums_like(l_i, offs_m), offs_m, WG_ROWS)  # (after the exponentials)
    v = v_tile(v_bufs, v_bars, ring + j, STAGES, V_KMAJOR)
    record_clock(tr, 1 + j, 1, j)
    pv_acc = _issue_pv(p_op, v, acc, alpha_o, TWO_LEVEL)
    if NEXT:
        s_acc = _issue_qk(q_smem, k_bufs, k_bars, ring + j + 1, s_zero, W, QK_CHUNKS)
        record_clock(tr, 1 + j, 2, j)
        pv, s = warpgroup_mma_wait(0, deps=(pv_acc, s_acc))
    else:
        record_clock(tr, 1 + j, 2, j)
        pv = warpgroup_mma_wait(0, deps=(pv_acc, ))
    record_clock(tr, 1 + j, 3, j)
    acc = fold_pv(acc, alpha_o, pv, TWO_LEVEL)
    release_slot(empty_bars, (ring + j) % STAGES)  # one release per warpgroup (empty counts 2)
    record_clock(tr, 1 + j, 4, j)
    return acc, m_i, l_i, s, v_sc


@gluon.jit
def _consumer_tile(q_smem, k_bufs, v_bufs, k_bars, v_bars, empty_bars, q_empty,
                   out_t, lse_t, q_scale_t, k_scale_t, v_scale_t, k_mean_t,
                   seqlen_q, seqlen_k, qk_scale, sm_scale,
                   b, h, hkv, q_start, m_start, n_full, n_end, ring, tr, sink_t, qi, ostore,
                   HEAD_DV: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, PV_FP8: gl.constexpr,
                   V_KMAJOR: gl.constexpr, RETURN_LSE: gl.constexpr, HAS_KMEAN: gl.constexpr, ABLATE: gl.constexpr,
                   TWO_LEVEL: gl.constexpr, SINK: gl.constexpr, STORE_TMA: gl.constexpr,
                   STORE_STAGED: gl.constexpr, W: gl.constexpr, band, WINDOW: gl.constexpr = False, softcap=None,
                   SOFTCAP: gl.constexpr = 0, rows_q=None, seqused_q=None):
    """Warpgroup ``W`` (of ``WGS``) on one tile: rows ``[m_start + 64 W, + 64)`` of sequence ``b`` against its key
    blocks ``[0, n_end)``, which sit at ring positions ``ring + j``. Output row ``r`` is token ``q_start + r`` of ``out`` (and of the LSE). ``out_t``,
    ``lse_t`` and the ``*_scale_t``/``k_mean_t`` tables are ``(pointer, strides...)`` tuples. ``SINK``
    (1; 2: K was smoothed): key block 0 is the BF16 sink block (``sink_t``'s buffers, loaded with the
    tile's ``qi``-th Q), attended after the FP8 blocks ``[1, n_end)`` (:mod:`.sink`). The warpgroup hands
    its Q box back (``q_empty``) as soon as its last QK retired, so a persistent program's producer loads the
    next tile's Q under this tile's last block and epilogue; with the K-mean LSE term (it reads Q at the
    end) or the sink (its buffers load with Q) only after the epilogue. ``STORE_TMA`` (dense): the output
    rows leave through ``ostore = (out_desc, o_smem)`` (:func:`.epilogue.stage_and_store`); ``STORE_STAGED``
    (varlen): through ``ostore``, one shared buffer per warpgroup, and 16-byte row-masked stores
    (:func:`.epilogue.stage_and_copy`). ``IS_FP8``: S comes
    from an FP8 wgmma (Q, K in e4m3 with their scales); ``PV_FP8``: P and V are e4m3 too (P scaled by
    2^P_OFFSET into its range), else P is packed to V's 16-bit dtype for a 16-bit PV wgmma (the mixed mode
    when IS_FP8). ``WINDOW`` (a sliding window): the blocks ``[n_start, n_end)`` of the tile's band, ``band =
    (n_start, n_lfull, left, right)`` (:func:`.masking.window_block_range`), at ring positions
    ``ring + j - n_start``. ``SOFTCAP`` (flash-attn's ``softcap``, the runtime ``softcap``; the host's
    ``qk_scale`` is then ``softmax_scale / softcap``, tanh's argument's scale): the scores are capped before
    the mask and the softmax (:func:`_softmax_block`); ``SOFTCAP == 2`` (K was smoothed): tanh's argument gets the
    per-row ``q . mean`` term back (:func:`.epilogue.kmean_lse_term`, from the Q tile before the key loop), and the
    LSE needs no K-mean term (``HAS_KMEAN`` is off). ``seqused_q`` (FA3's; None: off): only rows below ``seqlen_q``
    attend, and the rows ``[seqlen_q, rows_q)`` are written as 0 with LSE -inf (selected, so whatever they computed,
    a NaN from an unused query row included, stays out)."""
    out_ptr, stride_ob, stride_os, stride_oh = out_t
    lse_ptr, stride_lb, stride_lh = lse_t
    q_scale_ptr, stride_qsb, stride_qsh, stride_qsblk = q_scale_t
    k_scale_ptr, stride_ksb, stride_ksh, stride_ksblk = k_scale_t
    v_scale_ptr, stride_vsb, stride_vsh, stride_vsd = v_scale_t
    k_mean_ptr, stride_kmb, stride_kmh, stride_kmd = k_mean_t
    QK_CHUNKS: gl.constexpr = k_bufs.shape[0] // v_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    FIRST: gl.constexpr = 1 if SINK else 0  # the first FP8 key block; ring position ring + j - FIRST
    if WINDOW:  # (no sink with a window)
        first = band[0]
    else:
        first = FIRST
    QK_BITS: gl.constexpr = 8 if IS_FP8 else 16  # the operands of S = Q K^T ...
    PV_BITS: gl.constexpr = 8 if PV_FP8 else 16  # ... and of P V (16 in the mixed mode)
    P_OFFSET: gl.constexpr = 8.0 if PV_FP8 else 0.0  # (e4m3 P's range; a 16-bit P needs none)
    s_layout: gl.constexpr = wgmma_layout(WG_WARPS, BLOCK_N, QK_BITS)
    o_layout: gl.constexpr = wgmma_layout(WG_WARPS, HEAD_DV, PV_BITS)
    p_layout: gl.constexpr = a_operand_layout(o_layout, PV_BITS)

    row0 = m_start + W * WG_ROWS
    # the Q scale block of this warpgroup's rows: the tile's 128 rows are one scale block, m_start's
    c_q = qk_scale * gl.load(q_scale_ptr + b * stride_qsb + h * stride_qsh + (m_start // SCALE_BLOCK) * stride_qsblk)
    k_scale_row = k_scale_ptr + b * stride_ksb + hkv * stride_ksh
    v_scale_row = v_scale_ptr + b * stride_vsb + hkv * stride_vsh
    offs_m = row0 + gl.arange(0, WG_ROWS, gl.SliceLayout(1, s_layout))
    offs_n0 = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([WG_ROWS, HEAD_DV], gl.float32, o_layout)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    if SINK:  # (the sink block takes whole row sums; partial ones cost its builds 20 -> 108 B of spills, AOT)
        l_i = gl.zeros([WG_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    else:  # per-thread partial row sums, reduced across the quad once after the loop
        l_i = thread_row_sums(s_zero)
    if SOFTCAP:  # (softcap * log2(e), the per-row shift of tanh's argument: SOFTCAP == 2, K smoothed)
        shift = gl.zeros_like(m_i)
        if SOFTCAP == 2:
            if n_end > 0:  # (no key block: no Q was loaded)
                shift = gl.convert_layout(kmean_lse_term(q_smem, W * QK_CHUNKS, QK_CHUNKS, k_mean_ptr, stride_kmb,
                                                         stride_kmh, stride_kmd, b, hkv, c_q, WG_WARPS),
                                          gl.SliceLayout(1, s_layout))
        cap = (softcap * 1.4426950408889634, shift)
    else:
        cap = softcap  # (unused)

    # S_FIRST
    s = s_zero
    if n_end > first:
        s_acc = _issue_qk(q_smem, k_bufs, k_bars, ring, s_zero, W, QK_CHUNKS)
        s = warpgroup_mma_wait(0, deps=(s_acc, ))
    record_clock(tr, 0, 2, n_end)
    ring = ring - first  # key block j sits at ring position ring + j
    # Blocks [0, n_end - 1) issue the next block's S with their PV; the last one is peeled off, so
    # S has one definition per iteration (with a conditional second QK, ptxas copied all 64 S
    # registers at every block). The K scale is loaded a block ahead, off the softmax's path.
    k_sc = _k_scale(k_scale_row, stride_ksblk, first * BLOCK_N, first < n_end)
    for j in range(first, n_end - 1):
        k_sc_next = _k_scale(k_scale_row, stride_ksblk, (j + 1) * BLOCK_N, j + 1 < n_end)
        acc, m_i, l_i, s, _ = _consumer_block(
            s, j, c_q * k_sc, acc, m_i, l_i, offs_m, offs_n0, seqlen_q, seqlen_k, n_full, band, q_smem, k_bufs,
            v_bufs, k_bars, v_bars, empty_bars, ring, s_zero, tr, v_scale_row, stride_vsd, p_layout,
            o_layout, CAUSAL, V_KMAJOR, P_OFFSET, ABLATE, TWO_LEVEL, True, False, W, WINDOW, cap, SOFTCAP)
        k_sc = k_sc_next
    # Q's last reader, the QK of block n_end - 1, has retired
    EARLY_Q: gl.constexpr = not SINK and not HAS_KMEAN
    if EARLY_Q:
        if n_end > 0:
            release_slot(q_empty, 0)
    # the last block also reads V's descale, under its PV (in the epilogue it was a global load on the
    # tile's critical path); not at head dim 256 (O's 128 registers leave no room: AOT spills 52 -> 144 B)
    # or with the sink (its block follows: 4 -> 40 B)
    VS_EARLY: gl.constexpr = HEAD_DV <= 128 and not SINK
    if n_end > first:
        acc, m_i, l_i, s, v_sc = _consumer_block(
            s, n_end - 1, c_q * k_sc, acc, m_i, l_i, offs_m, offs_n0, seqlen_q, seqlen_k, n_full, band, q_smem,
            k_bufs, v_bufs, k_bars, v_bars, empty_bars, ring, s_zero, tr, v_scale_row, stride_vsd,
            p_layout, o_layout, CAUSAL, V_KMAJOR, P_OFFSET, ABLATE, TWO_LEVEL, False, VS_EARLY, W, WINDOW, cap,
            SOFTCAP)
    else:
        if VS_EARLY:
            v_sc = load_v_scale(v_scale_row, stride_vsd, HEAD_DV, o_layout)
        else:
            v_sc = 0.0

    if not SINK:
        l_i = row_totals(l_i, gl.SliceLayout(1, s_layout))
    if SINK:
        q_shift = gl.zeros_like(m_i)
        if n_end > 0:
            qs_smem, ks_smem, vs_smem, sink_bar = sink_t
            mbarrier.wait(sink_bar.index(0), qi & 1)
            inv_vs = 1.0 / load_v_scale(v_scale_row, stride_vsd, HEAD_DV, o_layout)
            acc, m_i, l_i, q_shift = sink_block(qs_smem, ks_smem, vs_smem, W, acc, m_i, l_i, offs_m, seqlen_q,
                                                seqlen_k, qk_scale, inv_vs, k_mean_ptr, stride_kmb, stride_kmh,
                                                stride_kmd, b, hkv, s_layout, o_layout, CAUSAL, SINK == 2, P_OFFSET,
                                                WG_WARPS)

    # Epilogue: O = acc / l * v_scale; LSE.
    inv_l, lse = finish_rows(m_i, l_i, P_OFFSET)
    rows_out = seqlen_q  # the rows this tile writes
    if seqused_q is not None:  # the rows past the used ones: 0 (and LSE -inf, below)
        used_o = row0 + gl.arange(0, WG_ROWS, gl.SliceLayout(1, o_layout)) < seqlen_q
        acc = gl.where(used_o[:, None], acc, 0.0)
        inv_l = gl.where(offs_m < seqlen_q, inv_l, 0.0)
        rows_out = rows_q
    out_seq = out_ptr + q_start.to(gl.int64) * stride_os  # this sequence's first row (varlen)
    if not VS_EARLY:
        v_sc = load_v_scale(v_scale_row, stride_vsd, HEAD_DV, o_layout)
    if STORE_TMA:
        out_desc, o_smem = ostore
        if row0 < rows_out:  # (TMA clips rows past the tensor; a persistent program's empty last round,
            # which reads as the last tile with no rows, must not store at all)
            stage_and_store(acc, inv_l, v_sc, out_desc, o_smem.index(W), b, h, row0)
    elif STORE_STAGED:  # (varlen: the rows staged in this warpgroup's buffer ``ostore[W]``, copied out 16 B at a time)
        stage_and_copy(acc, inv_l, v_sc, ostore.index(W), row0, out_seq, stride_ob, stride_os, stride_oh, b, h,
                       rows_out, WG_WARPS)
    else:
        write_rows(acc, inv_l, v_sc, row0, out_seq, stride_ob, stride_os, stride_oh, b, h, rows_out)
    if RETURN_LSE:
        if SINK == 2:  # the 16-bit q's q . mean (exact; the sink's scores used it too)
            lse = lse + q_shift * sm_scale
        elif HAS_KMEAN:
            if n_end > 0:  # (with no key block no Q was loaded, and every LSE is -inf anyway)
                corr = kmean_lse_term(q_smem, W * QK_CHUNKS, QK_CHUNKS, k_mean_ptr, stride_kmb, stride_kmh,
                                      stride_kmd, b, hkv, (c_q / qk_scale) * sm_scale, WG_WARPS)
                lse = lse + gl.convert_layout(corr, gl.SliceLayout(1, s_layout))
        if seqused_q is not None:
            lse = gl.where(offs_m < seqlen_q, lse, float("-inf"))
        lse_row = lse_ptr + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + q_start
        gl.store(lse_row + offs_m, lse, mask=offs_m < rows_out)
    if not EARLY_Q:
        if n_end > 0:
            release_slot(q_empty, 0)  # the K-mean term and the sink block are done with Q and the sink buffers
    record_clock(tr, 0, 3, n_end)


@gluon.jit
def _consumer_step(t, ring, qi, q_smem, k_bufs, v_bufs, q_bars, q_empty, k_bars, v_bars, empty_bars,
                   out_t, lse_t, q_scale_t, k_scale_t, v_scale_t, k_mean_t,
                   seqlen_q, seqlen_k, qk_scale, sm_scale, cu_seqlens_q, seqs_t, tiles,
                   num_bh, num_heads, group_size, num_m_tiles, num_tiles, trace, sink_t, ostore,
                   HEAD_DV: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, PV_FP8: gl.constexpr,
                   V_KMAJOR: gl.constexpr, RETURN_LSE: gl.constexpr, HAS_KMEAN: gl.constexpr, ABLATE: gl.constexpr,
                   TWO_LEVEL: gl.constexpr, VARLEN: gl.constexpr, SINK: gl.constexpr, STORE_TMA: gl.constexpr,
                   STORE_STAGED: gl.constexpr, W: gl.constexpr, window, WINDOW: gl.constexpr = False, softcap=None,
                   SOFTCAP: gl.constexpr = 0):
    """Tile ``t``; ``ring``, ``qi``: key blocks and Q tiles of the program's earlier tiles (ring position,
    ``q_bars`` phase). Returns them updated.
    ``trace``: the clock-trace buffer (:mod:`.trace`), or ``None``. ``WINDOW``: ``window = (left, right)``.
    ``SOFTCAP``: ``softcap`` caps the scores (:func:`_consumer_tile`)."""
    b, h, hkv, m_start, tma_b, q_start, k_start, sq, sk, n_full, n_end, rows_q = _tile(
        t, num_bh, num_heads, group_size, num_m_tiles, num_tiles, seqlen_q, seqlen_k, cu_seqlens_q, seqs_t,
        tiles, k_bufs.shape[3], CAUSAL, VARLEN)
    if WINDOW:
        n_start, n_lfull, n_full, n_end = window_block_range(m_start, sq, sk, n_full, n_end, window[0], window[1],
                                                             WGS * WG_ROWS, k_bufs.shape[3])
        band = (n_start, n_lfull, window[0], window[1])
    else:
        band = window  # (unused)
    tr = trace
    if trace is not None:
        tr = trace_row(trace, t, W, WGS)
    record_smid(tr, t)
    record_clock(tr, 0, 1, t)
    if n_end > 0:
        mbarrier.wait(q_bars.index(W), qi & 1)
    _consumer_tile(q_smem, k_bufs, v_bufs, k_bars, v_bars, empty_bars, q_empty,
                   out_t, lse_t, q_scale_t, k_scale_t, v_scale_t, k_mean_t,
                   sq, sk, qk_scale, sm_scale,
                   b, h, hkv, q_start, m_start, n_full, n_end, ring, tr, sink_t, qi, ostore,
                   HEAD_DV, CAUSAL, IS_FP8, PV_FP8, V_KMAJOR, RETURN_LSE, HAS_KMEAN, ABLATE,
                   TWO_LEVEL, SINK, STORE_TMA, STORE_STAGED, W, band, WINDOW, softcap, SOFTCAP, rows_q, seqs_t[2])
    loaded = gl.minimum(n_end, 1)  # this tile had a Q tile
    if WINDOW:
        ring += n_end - n_start
    else:
        ring += _fp8_blocks(n_end, SINK)
    return ring, qi + loaded


@gluon.jit
def _consumer(args, trace, sink_t, ostore, HEAD_DV: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr,
              PV_FP8: gl.constexpr, V_KMAJOR: gl.constexpr, RETURN_LSE: gl.constexpr, HAS_KMEAN: gl.constexpr,
              ABLATE: gl.constexpr, TWO_LEVEL: gl.constexpr, VARLEN: gl.constexpr, PERSISTENT: gl.constexpr,
              SINK: gl.constexpr, STORE_TMA: gl.constexpr, STORE_STAGED: gl.constexpr, W: gl.constexpr,
              WINDOW: gl.constexpr = False, SOFTCAP: gl.constexpr = 0):
    """Warpgroup ``W`` over this program's tiles; in each it hands its Q box back (``q_empty``
    counts every consumer warpgroup), so the producer can load the next tile's. Tiles with no key block to
    visit (causal rows before the first key, varlen tiles past a sequence) load no Q. One tile per
    program runs without the loop: inside it LLVM hoists the epilogue's tile-invariant addresses
    and ptxas spills them (AOT: 60 -> 340 B for FP8 d128). With the ``onewg`` timing ablation
    every warpgroup but 0 does nothing: one warpgroup's chain alone, for comparison."""
    (q_smem, k_bufs, v_bufs, q_bars, q_empty, k_bars, v_bars, empty_bars,
     out_t, lse_t, q_scale_t, k_scale_t, v_scale_t, k_mean_t,
     seqlen_q, seqlen_k, qk_scale, sm_scale, cu_seqlens_q, seqs_t, tiles,
     num_bh, num_heads, group_size, num_m_tiles, first_tile, tile_step, num_tiles, window, softcap) = args
    if W > 0 and ablates(ABLATE, ABLATE_ONEWG):
        pass
    elif PERSISTENT:
        ring = 0
        qi = 0
        for r in range(0, (num_tiles + tile_step - 1) // tile_step):
            ring, qi = _consumer_step(
                round_tile(r, first_tile, tile_step), ring, qi, q_smem, k_bufs, v_bufs, q_bars, q_empty, k_bars, v_bars,
                empty_bars,
                out_t, lse_t, q_scale_t, k_scale_t, v_scale_t, k_mean_t,
                seqlen_q, seqlen_k, qk_scale, sm_scale, cu_seqlens_q, seqs_t, tiles,
                num_bh, num_heads, group_size, num_m_tiles, num_tiles, trace, sink_t, ostore,
                HEAD_DV, CAUSAL, IS_FP8, PV_FP8, V_KMAJOR, RETURN_LSE, HAS_KMEAN, ABLATE, TWO_LEVEL, VARLEN, SINK,
                STORE_TMA, STORE_STAGED, W, window, WINDOW, softcap, SOFTCAP)
    else:
        _consumer_step(
            first_tile, 0, 0, q_smem, k_bufs, v_bufs, q_bars, q_empty, k_bars, v_bars, empty_bars,
            out_t, lse_t, q_scale_t, k_scale_t, v_scale_t, k_mean_t,
            seqlen_q, seqlen_k, qk_scale, sm_scale, cu_seqlens_q, seqs_t, tiles,
            num_bh, num_heads, group_size, num_m_tiles, num_tiles, trace, sink_t, ostore,
            HEAD_DV, CAUSAL, IS_FP8, PV_FP8, V_KMAJOR, RETURN_LSE, HAS_KMEAN, ABLATE, TWO_LEVEL, VARLEN, SINK,
            STORE_TMA, STORE_STAGED, W, window, WINDOW, softcap, SOFTCAP)
    if STORE_TMA:
        tma.store_wait(0)  # the last tile's output store has read its shared memory


@gluon.jit
def _partitions(cargs, pargs, trace, cu_seqlens_v, psink, csink, ostore,
                HEAD_DV: gl.constexpr, CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, PV_FP8: gl.constexpr,
                V_KMAJOR: gl.constexpr,
                RETURN_LSE: gl.constexpr, HAS_KMEAN: gl.constexpr, ABLATE: gl.constexpr, TWO_LEVEL: gl.constexpr,
                VARLEN: gl.constexpr, PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr, SINK: gl.constexpr,
                STORE_TMA: gl.constexpr, STORE_STAGED: gl.constexpr, WINDOW: gl.constexpr = False,
                SOFTCAP: gl.constexpr = 0, pages_t=None, PAGE_SIZE: gl.constexpr = 0):
    """The warp-specialized body: the two consumer warpgroups (the first in the default partition) and
    the producer warp. ``psink``/``csink``: the BF16 sink keys' tuples, or None; ``pages_t``, ``PAGE_SIZE``: paged
    K/V (the producer's alone)."""
    gl.warp_specialize([
        (_consumer, (cargs, trace, csink, ostore, HEAD_DV, CAUSAL, IS_FP8, PV_FP8, V_KMAJOR, RETURN_LSE,
                     HAS_KMEAN, ABLATE, TWO_LEVEL, VARLEN, PERSISTENT, SINK, STORE_TMA, STORE_STAGED, 0, WINDOW,
                     SOFTCAP)),
        (_consumer, (cargs, trace, csink, ostore, HEAD_DV, CAUSAL, IS_FP8, PV_FP8, V_KMAJOR, RETURN_LSE,
                     HAS_KMEAN, ABLATE, TWO_LEVEL, VARLEN, PERSISTENT, SINK, STORE_TMA, STORE_STAGED, 1, WINDOW,
                     SOFTCAP)),
        (_producer, (pargs, cu_seqlens_v, psink, CAUSAL, V_KMAJOR, VARLEN, CONSUMERS, SINK, WINDOW, pages_t,
                     PAGE_SIZE)),
    ], [WG_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ----------------------------------------------------------------------------- kernel

# head counts vary per call: not specialized (sequence lengths stay specialized)
@gluon.jit(do_not_specialize=["num_heads", "group_size", "num_m_tiles", "num_bh", "window_left", "window_right"])
def attn_fwd_pingpong_kernel(
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
    window_left, window_right,  # WINDOW: the band's sides (>= 0; launch.window_bounds), else unused
    num_bh,  # batch * query heads: tile t is query tile (num_m_tiles - 1 - t // num_bh) of (b, h) = t % num_bh
    cu_seqlens_q, cu_seqlens_k,  # varlen: (batch + 1) int32 token offsets (dense: unused)
    tiles,  # varlen: the int32 tile table (varlen_tiles.py; dense: unused)
    stride_lb, stride_lh,  # LSE strides of batch and head (dense (B, H, Sq); varlen (H, total_q))
    trace,  # None, or the int32 clock-trace buffer (LEANFA_HOPPER_TRACE, see trace.py)
    cu_seqlens_v,  # None, or (FP8 varlen) each sequence's first token in V, 16-aligned (launch.align_varlen_v)
    page_table, stride_ptb, stride_ptn,  # None, or (PAGE_SIZE) paged K/V's int32 page table (B, max_pages)
    sink_q_desc, sink_k_desc, sink_v_desc,  # None, or (SINK) the 16-bit Q, K, V of the BF16 sink keys (sink.py)
    out_desc,  # None, or (STORE_TMA) the output as (B, H, S, D) for TMA stores of 64-row boxes
    softcap,  # SOFTCAP: flash-attn's softcap (qk_scale is then softmax_scale / softcap), else unused
    seqused_k,  # None, or FA3's seqused_k: int32 (batch,), sequence b's first seqused_k[b] keys only (_tile)
    seqused_q,  # None, or FA3's seqused_q: int32 (batch,), sequence b's first seqused_q[b] query rows only (_tile)
    HEAD_DQK: gl.constexpr, HEAD_DV: gl.constexpr,
    CAUSAL: gl.constexpr, IS_FP8: gl.constexpr, V_KMAJOR: gl.constexpr,
    RETURN_LSE: gl.constexpr, HAS_KMEAN: gl.constexpr, VARLEN: gl.constexpr, STAGES: gl.constexpr,
    ABLATE: gl.constexpr,  # 0, or timing ablations (ablation.py: wrong results)
    PV_IN_MMA: gl.constexpr,  # FP8 PV accumulates in the wgmma accumulator (head dim 256, launch.wide_head)
    PERSISTENT: gl.constexpr,
    SINK: gl.constexpr,  # 0; BF16 sink keys [0, 128): 1, or 2 when K was smoothed (sink.py)
    STORE_TMA: gl.constexpr,  # dense: the output leaves through shared memory and TMA (epilogue.stage_and_store)
    num_warps: gl.constexpr,
    MIXED: gl.constexpr = False,  # IS_FP8 with a 16-bit V: FP8 QK, P and V in 16 bits (attention(precision="fp8qk"))
    STORE_STAGED: gl.constexpr = False,  # varlen: the output staged in shared memory, 16-byte row-masked stores
    WINDOW: gl.constexpr = False,  # a sliding window (window_left/right): only the band's key blocks (masking.py)
    SOFTCAP: gl.constexpr = 0,  # soft-capped scores (softcap); 2: K was smoothed, tanh's argument gets q . mean back
    PAGE_SIZE: gl.constexpr = 0,  # paged K/V: keys per page; k_desc (v_desc too but with V_KMAJOR) over the caches
    #                               [page, head, row, dim]; V_KMAJOR (FP8): v_desc over V's dense transposed copy
    KV_BOXES: gl.constexpr = 1,  # paged K/V: boxes (pages) per key block (page_size < BLOCK_N)
):
    gl.static_assert(num_warps == WG_WARPS, "the kernel launches with num_warps=4 (the first consumer warpgroup)")
    gl.static_assert(q_desc.block_type.shape[2] == WG_ROWS, "the kernel loads Q in 64-row boxes")
    DCHUNK: gl.constexpr = q_desc.block_type.shape[3]
    QK_CHUNKS: gl.constexpr = HEAD_DQK // DCHUNK
    gl.static_assert(IS_FP8 or not MIXED, "the mixed mode has FP8 Q and K")
    PV_FP8: gl.constexpr = IS_FP8 and not MIXED  # IS_FP8: the QK side; PV_FP8: P and V in e4m3
    TWO_LEVEL: gl.constexpr = PV_FP8 and not PV_IN_MMA
    gl.static_assert(not (WINDOW and SINK), "sliding windows are not combined with the BF16 sink keys")
    gl.static_assert(not (SOFTCAP and SINK), "softcap is not combined with the BF16 sink keys")

    first_tile, tile_step, num_tiles = program_tiles(num_bh, num_m_tiles, num_heads, tiles, PERSISTENT, VARLEN)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [WGS * QK_CHUNKS] + q_desc.block_type.shape,
                                       q_desc.layout)
    if KV_BOXES > 1:  # a key block's slot holds KV_BOXES page boxes (pipeline.load_kv_paged) ...
        KV_ROWS: gl.constexpr = KV_BOXES * k_desc.block_type.shape[2]
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES * QK_CHUNKS, 1, 1, KV_ROWS, DCHUNK], k_desc.layout)
        if V_KMAJOR:  # ... of K; FP8 V comes in one box from its dense transposed copy
            v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        else:  # ... of K and of V, token-major
            v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, KV_ROWS, HEAD_DV], v_desc.layout)
    else:
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES * QK_CHUNKS] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = alloc_barriers(WGS)
    CONSUMERS: gl.constexpr = 1 if ablates(ABLATE, ABLATE_ONEWG) else WGS  # the working ones
    q_empty = alloc_barriers(1, CONSUMERS)  # every consumer warpgroup is done with the tile's Q
    k_bars = alloc_barriers(STAGES)
    v_bars = alloc_barriers(STAGES)
    empty_bars = alloc_barriers(STAGES, CONSUMERS)  # one release per consumer warpgroup
    seqs_t = (cu_seqlens_k, seqused_k, seqused_q)  # each sequence's keys and used query rows (_tile)
    # every consumer warpgroup gets the same arguments but its index. The constexprs go in the
    # argument list itself: a tuple held in a variable makes them runtime values.
    cargs = (q_smem, k_bufs, v_bufs, q_bars, q_empty, k_bars, v_bars, empty_bars,
             (out_ptr, stride_ob, stride_os, stride_oh), (lse_ptr, stride_lb, stride_lh),
             (q_scale_ptr, stride_qsb, stride_qsh, stride_qsblk), (k_scale_ptr, stride_ksb, stride_ksh, stride_ksblk),
             (v_scale_ptr, stride_vsb, stride_vsh, stride_vsd), (k_mean_ptr, stride_kmb, stride_kmh, stride_kmd),
             seqlen_q, seqlen_k, qk_scale, sm_scale, cu_seqlens_q, seqs_t, tiles,
             num_bh, num_heads, group_size, num_m_tiles, first_tile, tile_step, num_tiles,
             (window_left, window_right), softcap)
    pargs = (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bars, q_empty, k_bars, v_bars, empty_bars,
             seqlen_q, seqlen_k, cu_seqlens_q, seqs_t, tiles, num_bh, num_heads, group_size, num_m_tiles,
             first_tile, tile_step, num_tiles, (window_left, window_right))
    if STORE_TMA:  # one output box per consumer warpgroup
        o_smem = gl.allocate_shared_memory(out_desc.dtype, [WGS] + out_desc.block_type.shape, out_desc.layout)
        ostore = (out_desc, o_smem)
    elif STORE_STAGED:  # one 64 x Dv buffer per consumer warpgroup (epilogue.stage_and_copy)
        o_dtype: gl.constexpr = out_ptr.dtype.element_ty
        ostore = gl.allocate_shared_memory(o_dtype, [WGS, WG_ROWS, HEAD_DV],
                                           staged_out_layout(WG_ROWS, HEAD_DV, o_dtype))
    else:
        ostore = out_desc  # (None)
    if SINK:  # the BF16 sink keys' 16-bit Q boxes, K and V blocks, and their barrier (sink.py)
        gl.static_assert(k_desc.block_type.shape[2] == sink_k_desc.block_type.shape[2], "the sink is key block 0")
        qs_smem = gl.allocate_shared_memory(sink_q_desc.dtype, [WGS] + sink_q_desc.block_type.shape,
                                            sink_q_desc.layout)
        ks_smem = gl.allocate_shared_memory(sink_k_desc.dtype, [1] + sink_k_desc.block_type.shape, sink_k_desc.layout)
        vs_smem = gl.allocate_shared_memory(sink_v_desc.dtype, [1] + sink_v_desc.block_type.shape, sink_v_desc.layout)
        sink_bar = alloc_barriers(1)
        _partitions(cargs, pargs, trace, cu_seqlens_v,
                    (sink_q_desc, sink_k_desc, sink_v_desc, qs_smem, ks_smem, vs_smem, sink_bar),
                    (qs_smem, ks_smem, vs_smem, sink_bar), ostore,
                    HEAD_DV, CAUSAL, IS_FP8, PV_FP8, V_KMAJOR, RETURN_LSE, HAS_KMEAN, ABLATE, TWO_LEVEL, VARLEN,
                    PERSISTENT, CONSUMERS, SINK, STORE_TMA, STORE_STAGED, WINDOW, SOFTCAP,
                    (page_table, stride_ptb, stride_ptn), PAGE_SIZE)
        invalidate_barriers(sink_bar, 1)
    else:  # (the None sink_q_desc stands for both sink tuples: a None made here cannot be passed on)
        _partitions(cargs, pargs, trace, cu_seqlens_v, sink_q_desc, sink_q_desc, ostore,
                    HEAD_DV, CAUSAL, IS_FP8, PV_FP8, V_KMAJOR, RETURN_LSE, HAS_KMEAN, ABLATE, TWO_LEVEL, VARLEN,
                    PERSISTENT, CONSUMERS, SINK, STORE_TMA, STORE_STAGED, WINDOW, SOFTCAP,
                    (page_table, stride_ptb, stride_ptn), PAGE_SIZE)

    invalidate_barriers(q_bars, WGS)
    invalidate_barriers(q_empty, 1)
    invalidate_barriers(k_bars, STAGES)
    invalidate_barriers(v_bars, STAGES)
    invalidate_barriers(empty_bars, STAGES)

