"""Portable attention forward in ``triton.language``: any Triton GPU, and the CPU interpreter.

The algorithm (one program = one block of BLOCK_M query rows of one head):

    c      = q_descale[row] * k_descale[block] * softmax_scale * log2(e)   # per row, per KV block
    s      = Q Kᵀ                      (raw FP8/BF16 products, fp32 accumulate)
    m_new  = max(m, rowmax(s) * c)      (c > 0, so the max commutes with the scale)
    p      = exp2(s * c - (m_new - P_SHIFT))     <- "Lean P": one FFMA + one exp2 per score
    l      = l * exp2(m - m_new) + rowsum(p)
    O      = O * exp2(m - m_new) + P V  (FP8: P in e4m3, each block's P V added in fp32)

P_SHIFT = 8 for FP8 scales P by 256 into the e4m3 range at no cost (l carries the same
factor, so O / l is unchanged); 0 for BF16/FP16. The mixed mode (MIXED: FP8 Q and K with their
descales, a 16-bit V; ``attention(precision="fp8qk")``) takes the FP8 path for S and the 16-bit one
for P V: P in V's dtype, accumulated into O by the MMA, P_SHIFT 0, no V descale. At the end O / l is
multiplied by the per-channel V descale (FP8 V), and LSE = (m - P_SHIFT + log2 l) * ln 2 (plus softmax_scale * q·k_mean
when K was smoothed). Causal programs skip KV blocks entirely above the diagonal and mask only
the blocks that cross it; the grid launches the heaviest query blocks first.

``seqused_q``/``seqused_k`` (FA3's): sequence ``b`` has only its first ``seqused_q[b]`` queries
and ``seqused_k[b]`` keys (the causal mask is aligned to those lengths); rows past
``seqused_q[b]`` are written as rows that see no key (output 0, LSE -inf). Query tiles wholly
past ``seqused_q[b]`` visit no key block.

Sliding windows (flash-attn's ``window_size=(left, right)``): query row ``r`` sits at key position
``pos = r + Sk - Sq`` and sees keys ``pos - left <= j <= pos + right``. The right side reuses the
causal path with the diagonal moved right by ``window_right`` (the launch sets CAUSAL); the left
side (HAS_WINDOW_LEFT) starts the key loop at the block holding the tile's first row's lowest
visible key and masks the blocks until every row of the tile sees the whole block, so keys wholly
outside the band are never loaded. Rows whose window holds no key are 0 with LSE -inf, as any row
that sees no key. ``softcap`` (HAS_SOFTCAP): scores ``s`` (``softmax_scale * q.k``, the true K's
when K was smoothed) become ``softcap * tanh(s / softcap)`` before the softmax. All three switches
are constexprs, off by default: the kernels without them compile as before.

Chunked attention (FA3's ``attention_chunk = c``, HAS_CHUNK): row ``r`` sees only keys in
``[floor(pos / c) * c, floor(pos / c) * c + c)``, ``pos = r + Sk - Sq``, on top of the causal mask and the window:
the key loop starts at the block of the tile's first row's chunk and ends with its last row's chunk, and masks the
blocks not every row of the tile sees whole. ``qv`` (FA3's, HAS_QV): the scores gain ``qv . v`` per key block (one
more dot on the V tile, read before the softmax then); in FP8 ``qv`` shares the Q descale, and an FP8 V's per-channel
descale is folded into ``qv`` (bf16) once per tile. Both constexprs are off by default, as above.

Paged K/V (PAGE_SIZE > 0): K and V are caches ``(num_pages, PAGE_SIZE, Hkv, D)`` and key position ``n`` of
sequence ``b`` is row ``n % PAGE_SIZE`` of page ``PT[b, n // PAGE_SIZE]``. Page sizes divide the key tile or are
multiples of it (:func:`leanfa.problem.page_size_supported`): a tile inside one page reads one page id and contiguous rows,
a tile over several pages one id per key (:func:`_paged_rows`); the key loop, masks and scales are those of a
contiguous call (key positions are logical), so a paged call gives the contiguous call's bits. A sequence's key
slot is the table row's capacity (``seqlen_k_dense``), or its ``cu_seqlens_k`` length, cut by ``seqused_k``.
KV_PER_SEQ: packed queries (VARLEN) over K/V indexed per sequence (a dense ``(B, S_cache)`` cache, or pages)
rather than packed by ``cu_seqlens_k``. Both constexprs are off by default, as above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scales import SCALE_BLOCK, broadcast_strides
from .fp8 import to_e4m3
from .outputs import allocate_outputs
from .sequences import sequence_span

LOG2E = 1.4426950408889634
NEG_INF = tl.constexpr(float("-inf"))  # a constexpr: jit code may read it


@triton.jit
def _load_tile(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    if MASK_ROWS:
        if MASK_COLS:
            return tl.load(ptrs, mask=row_ok & col_ok, other=0.0)
        else:
            return tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        if MASK_COLS:
            return tl.load(ptrs, mask=col_ok, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _upcast(x, DOT_UPCAST: tl.constexpr):
    """Operand for tl.dot: as is (0), or converted to fp32 (2: the CPU interpreter, whose bf16
    dot is wrong in Triton 3.6). (FP8 needs sm89+, where FP8 MMA exists: the API checks.)"""
    if DOT_UPCAST == 2:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _softcap_log2(t, cap_log2, two_over_cap):
    """``softcap * tanh(x / softcap)`` in the log2 domain: ``t = x * log2(e)``, ``cap_log2 = softcap * log2(e)``,
    ``two_over_cap = 2 / softcap``. tanh(y) = 1 - 2 / (exp(2y) + 1), with exp(2y) = exp2(t * 2 / softcap): finite
    for every t (exp2 overflows to inf, giving cap_log2; underflows to 0, giving -cap_log2)."""
    return cap_log2 - (2.0 * cap_log2) / (tl.math.exp2(t * two_over_cap) + 1.0)


@triton.jit
def _chunk_start(pos, chunk):
    """``floor(pos / chunk) * chunk`` for a key position ``pos`` of either sign (Triton's integer division
    truncates toward zero; positions are negative for the first rows of a call with more queries than keys)."""
    return tl.where(pos >= 0, pos // chunk, -((chunk - 1 - pos) // chunk)) * chunk


@triton.jit
def _softmax_step(s, c, acc, l_i, m_i, P_SHIFT: tl.constexpr):
    """Online-softmax update for one block of raw scores ``s`` (scaled by ``c`` per row, log2
    domain): returns P = exp2(s c - (m_new - P_SHIFT)), O and l rescaled to the new max, m_new."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * c)
    m_use = tl.where(m_new == NEG_INF, 0.0, m_new)  # rows with nothing visible yet
    p = tl.math.exp2(s * c[:, None] - (m_use - P_SHIFT)[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, acc, l_i, m_new


@triton.jit
def _block_start(base, start_n, stride_s, PAGE_SIZE: tl.constexpr):
    """Where a key block of a K or V sequence starts: ``base`` itself for paged K/V (the block's rows are
    gathered through the page table: :func:`_paged_rows`)."""
    if PAGE_SIZE > 0:
        return base
    else:
        return base + tl.cast(start_n, tl.int64) * stride_s


@triton.jit
def _paged_rows(pages, stride_pn, start_n, offs_n, key_ok, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """Where a key block lies in a paged cache: ``(page, row)`` with key ``n`` at row ``n % PAGE_SIZE`` of page
    ``pages[n // PAGE_SIZE]`` (table entries ``stride_pn`` apart); a cache's element offset is
    ``page * page_stride + row * row_stride``. A block inside one page (PAGE_SIZE a multiple of the block: blocks
    start at multiples of their size) reads one page id (a scalar page, contiguous rows); a block of several
    pages gathers one id per key (keys past the sequence read id 0: their loads are masked). Block starts lie
    below the sequence's length, so the ids read are the sequence's own."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    if PAGE_SIZE >= BLOCK_N:
        page = tl.load(pages + (start_n // PAGE_SIZE) * stride_pn).to(tl.int64)
        rows = (start_n % PAGE_SIZE) + offs_n
    else:
        cols = start_n + offs_n
        if MASKED:
            page = tl.load(pages + (cols // PAGE_SIZE) * stride_pn, mask=key_ok, other=0).to(tl.int64)
        else:
            page = tl.load(pages + (cols // PAGE_SIZE) * stride_pn).to(tl.int64)
        rows = cols % PAGE_SIZE
    return page, rows


@triton.jit
def _load_v_block(v_blk, page, rows, offs_n, offs_dv, key_ok, stride_vs, stride_vd, stride_vp,
                  HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """A key block's V tile ``(BLOCK_N, BLOCK_DV)``: contiguous rows, or (PAGE_SIZE > 0) the rows
    :func:`_paged_rows` found."""
    if PAGE_SIZE > 0:
        return _load_tile(v_blk + (page * stride_vp + rows * stride_vs)[:, None] + offs_dv[None, :] * stride_vd,
                          key_ok[:, None], offs_dv[None, :] < HEAD_DIM_V, MASKED, BLOCK_DV != HEAD_DIM_V)
    else:
        return _load_tile(v_blk + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                          key_ok[:, None], offs_dv[None, :] < HEAD_DIM_V, MASKED, BLOCK_DV != HEAD_DIM_V)


@triton.jit
def _attend_kv_block(
    acc, l_i, m_i, q, c_row,
    k_blk, v_blk, k_scale,
    start_n, offs_m, offs_n, offs_dqk, offs_dv,
    seqlen_k, causal_offset,
    stride_ks, stride_kd, stride_vs, stride_vd,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    PV_FP8: tl.constexpr, DOT_UPCAST: tl.constexpr, EXACT_FP8_ROUND: tl.constexpr,
    P_SHIFT: tl.constexpr,
    lo_offset, cap_shift, cap_log2, two_over_cap,
    WINDOW_LEFT: tl.constexpr, SOFTCAP: tl.constexpr,
    pages, stride_pn, stride_kp, stride_vp, PAGE_SIZE: tl.constexpr,
    chunk_lo, attention_chunk, CHUNK: tl.constexpr, qv, QV: tl.constexpr,
):
    """One KV block of the online softmax; MASKED blocks check key bounds and the causal mask
    (``causal_offset``: row ``r`` sees keys ``<= r + causal_offset``), and with WINDOW_LEFT the window's
    left side (keys ``>= r + lo_offset``). SOFTCAP caps the scores (``cap_shift``: per row, what K
    smoothing took out of them, in log2 units) before the softmax. With PAGE_SIZE > 0 (paged K/V) ``k_blk``/
    ``v_blk`` point at the caches' head and the block's keys are gathered through ``pages`` (the sequence's row
    of the page table; pages ``stride_kp``/``stride_vp`` apart). PV_FP8: P rounded to e4m3 for an FP8
    V; otherwise P in V's (16-bit) dtype. CHUNK (masked blocks): row ``r`` sees only keys in
    ``[chunk_lo[r], chunk_lo[r] + attention_chunk)``. QV: the scores gain ``qv . v`` (``qv``: the tile's
    FA3 ``qv`` rows in a 16-bit dtype, times the V descale for an FP8 V), in units of the block's K descale
    (``k_scale``: the scores are multiplied by it with the Q descale and the softmax scale)."""
    cols = start_n + offs_n
    key_ok = cols < seqlen_k
    if PAGE_SIZE > 0:
        page, rows = _paged_rows(pages, stride_pn, start_n, offs_n, key_ok, PAGE_SIZE, MASKED)
        kt = _load_tile(k_blk + (page * stride_kp + rows * stride_ks)[None, :] + offs_dqk[:, None] * stride_kd,
                        key_ok[None, :], offs_dqk[:, None] < HEAD_DIM_QK,
                        MASKED, BLOCK_DQK != HEAD_DIM_QK)
    else:
        page = 0  # (unused: contiguous rows)
        rows = offs_n
        kt = _load_tile(k_blk + offs_n[None, :] * stride_ks + offs_dqk[:, None] * stride_kd,
                        key_ok[None, :], offs_dqk[:, None] < HEAD_DIM_QK,
                        MASKED, BLOCK_DQK != HEAD_DIM_QK)
    s = tl.dot(q, _upcast(kt, DOT_UPCAST))
    if QV:  # FA3's qv: s += qv . v, in the units of s (raw Q.K products times k_scale); V is read here, once
        v = _load_v_block(v_blk, page, rows, offs_n, offs_dv, key_ok, stride_vs, stride_vd, stride_vp,
                          HEAD_DIM_V, BLOCK_DV, MASKED, PAGE_SIZE)
        qv_v = tl.dot(_upcast(qv, DOT_UPCAST), _upcast(tl.trans(v.to(qv.dtype)), DOT_UPCAST))
        s = s + qv_v * (1.0 / k_scale)
    c = c_row * k_scale
    if SOFTCAP:  # capped scores in the log2 domain; the softmax then takes them unscaled
        s = _softcap_log2(s * c[:, None] + cap_shift[:, None], cap_log2, two_over_cap)
        c = tl.full(c.shape, 1.0, tl.float32)
    if MASKED:
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
        if WINDOW_LEFT:
            visible = visible & (cols[None, :] >= offs_m[:, None] + lo_offset)
        if CHUNK:
            visible = visible & (cols[None, :] >= chunk_lo[:, None]) & (cols[None, :] < chunk_lo[:, None] + attention_chunk)
        s = tl.where(visible, s, NEG_INF)
    p, acc, l_i, m_new = _softmax_step(s, c, acc, l_i, m_i, P_SHIFT)
    if not QV:
        v = _load_v_block(v_blk, page, rows, offs_n, offs_dv, key_ok, stride_vs, stride_vd, stride_vp,
                          HEAD_DIM_V, BLOCK_DV, MASKED, PAGE_SIZE)
    if PV_FP8:
        p8 = to_e4m3(p, False, EXACT_FP8_ROUND)
        # a fresh accumulator per block: the MMA's reduced-precision sum covers one block,
        # and the running sum stays in fp32
        acc += tl.dot(_upcast(p8, DOT_UPCAST), _upcast(v, DOT_UPCAST))
    else:
        acc = tl.dot(_upcast(p.to(v.dtype), DOT_UPCAST), _upcast(v, DOT_UPCAST), acc)
    return acc, l_i, m_new


@triton.jit
def _attend_sink_block(
    acc, l_i, m_i, qb, q_shift, c_row, inv_v_scale,
    kb_blk, vb_blk, start_n, offs_m, offs_n, offs_dqk, offs_dv, seqlen_k, causal_offset,
    stride_ks, stride_kd, stride_vs, stride_vd,
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_UPCAST: tl.constexpr, P_SHIFT: tl.constexpr,
):
    """One block of the BF16 sink keys inside an FP8 call: 16-bit Q, K, V and P. Scores are
    ``q.k - q_shift`` (q_shift = q.k_mean when K was smoothed, so they match the FP8 scores of
    the smoothed K); this block's P V is in real units, the FP8 accumulator in units of the V
    descale, hence the ``inv_v_scale``."""
    cols = start_n + offs_n
    key_ok = cols < seqlen_k
    kt = _load_tile(kb_blk + offs_n[None, :] * stride_ks + offs_dqk[:, None] * stride_kd,
                    key_ok[None, :], offs_dqk[:, None] < HEAD_DIM_QK, True, BLOCK_DQK != HEAD_DIM_QK)
    s = tl.dot(qb, _upcast(kt, DOT_UPCAST)) - q_shift[:, None]
    visible = key_ok[None, :]
    if CAUSAL:
        visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
    s = tl.where(visible, s, NEG_INF)
    p, acc, l_i, m_new = _softmax_step(s, c_row, acc, l_i, m_i, P_SHIFT)
    v = _load_tile(vb_blk + offs_n[:, None] * stride_vs + offs_dv[None, :] * stride_vd,
                   key_ok[:, None], offs_dv[None, :] < HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V)
    pv = tl.dot(_upcast(p.to(v.dtype), DOT_UPCAST), _upcast(v, DOT_UPCAST))
    acc += pv * inv_v_scale[None, :]
    return acc, l_i, m_new


# Head counts and the GQA group change from call to call but not the code: they are not
# specialized (Triton would compile a variant per ==1 / divisible-by-16 pattern). The dense
# sequence lengths stay specialized: without it the FP8 kernel measured 6% slower on the H200
# (16K causal d128: 600 vs 632 TFLOP/s, docs/perf-notes.md). ``seq_bucket`` is read only by
# the autotuner's key.
@triton.jit(do_not_specialize=["num_heads", "group", "seq_bucket", "window_left", "window_right", "attention_chunk"])
def _attn_fwd(
    Q, K, V, O, LSE, QS, KS, VS, KMEAN, CU_Q, CU_K, CU_V, SQ, SK, SV, USED_Q, USED_K,
    qk_scale, sm_scale, seqlen_q_dense, seqlen_k_dense, num_heads, group, seq_bucket,
    window_left, window_right, softcap, attention_chunk,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh, stride_ls,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_vsb, stride_vsh, stride_vsd,
    stride_kmb, stride_kmh, stride_kmd,
    stride_sqb, stride_sqs, stride_sqh, stride_sqd,
    stride_skb, stride_sks, stride_skh, stride_skd,
    stride_svb, stride_svs, stride_svh, stride_svd,
    PT, stride_ptb, stride_ptn,  # paged K/V's page table; None without paging (no kernel parameters then)
    QV, stride_qvb, stride_qvs, stride_qvh, stride_qvd,  # FA3's qv (layout of O); None without it, as PT
    HEAD_DIM_QK: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    IS_FP8: tl.constexpr, DOT_UPCAST: tl.constexpr, EXACT_FP8_ROUND: tl.constexpr,
    RETURN_LSE: tl.constexpr, HAS_KMEAN: tl.constexpr,
    SCALE_BLK: tl.constexpr, SINK: tl.constexpr, SINK_SHIFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_USED_Q: tl.constexpr = False, HAS_USED_K: tl.constexpr = False,
    HAS_WINDOW_LEFT: tl.constexpr = False, HAS_WINDOW_RIGHT: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False, MIXED: tl.constexpr = False,
    PAGE_SIZE: tl.constexpr = 0, KV_PER_SEQ: tl.constexpr = False,
    HAS_CHUNK: tl.constexpr = False, HAS_QV: tl.constexpr = False,
):
    tl.static_assert(SCALE_BLK % BLOCK_N == 0, "a KV tile must lie inside one K scale block")
    tl.static_assert(IS_FP8 or not MIXED, "the mixed mode has FP8 Q and K")
    PV_FP8: tl.constexpr = IS_FP8 and not MIXED  # IS_FP8: the QK side; PV_FP8: P and V in e4m3
    P_SHIFT: tl.constexpr = 8.0 if PV_FP8 else 0.0
    pid_bh = tl.program_id(0)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (last) query blocks first
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    hk = h // group
    q_start, seqlen_q_slot = sequence_span(CU_Q, b, seqlen_q_dense, VARLEN)
    if KV_PER_SEQ:  # packed queries, K/V per sequence (a dense cache or pages): the key slot is seqlen_k_dense
        k_start, seqlen_k = sequence_span(CU_K, b, seqlen_k_dense, False)
        v_start = k_start
    else:
        k_start, seqlen_k = sequence_span(CU_K, b, seqlen_k_dense, VARLEN)
        v_start, _ = sequence_span(CU_V, b, seqlen_k_dense, VARLEN)  # (packed FP8 V: CU_V may be quantize_fp8's)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q_slot:
        return
    # seqused: only the first seqused_q[b] queries / seqused_k[b] keys of the sequence's slot
    # exist (clamped to the slot); the mask and its bottom-right alignment use these lengths
    seqlen_q = seqlen_q_slot
    if HAS_USED_Q:
        seqlen_q = tl.minimum(tl.load(USED_Q + b), seqlen_q_slot)
    if HAS_USED_K:
        seqlen_k = tl.minimum(tl.load(USED_K + b), seqlen_k)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q

    # 64-bit base offsets: B * S * H * D can exceed 2^31 at long context
    q_base = Q + b.to(tl.int64) * stride_qb + (q_start + start_m).to(tl.int64) * stride_qs + h.to(tl.int64) * stride_qh
    pages = PT  # (None without paging)
    if PAGE_SIZE > 0:  # the caches' head; stride_kb/stride_vb are the page strides
        tl.static_assert(SINK == 0, "BF16 sink keys are not read from paged K/V")
        pages = PT + b.to(tl.int64) * stride_ptb  # this sequence's row of the page table
        k_base = K + hk.to(tl.int64) * stride_kh
        v_base = V + hk.to(tl.int64) * stride_vh
    else:
        k_base = K + b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + hk.to(tl.int64) * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + v_start.to(tl.int64) * stride_vs + hk.to(tl.int64) * stride_vh
    q = _load_tile(q_base + tl.arange(0, BLOCK_M)[:, None] * stride_qs + offs_dqk[None, :] * stride_qd,
                   row_ok[:, None], offs_dqk[None, :] < HEAD_DIM_QK, True, BLOCK_DQK != HEAD_DIM_QK)
    q = _upcast(q, DOT_UPCAST)
    if IS_FP8:
        q_scale = tl.load(QS + b * stride_qsb + h * stride_qsh + (offs_m // SCALE_BLK) * stride_qsn,
                          mask=row_ok, other=1.0)
        c_row = q_scale * qk_scale
    else:
        c_row = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale

    qv = q  # (a placeholder without HAS_QV)
    if HAS_QV:  # FA3's qv rows of this tile, in V's 16-bit dtype (bf16 and times the V descale for an FP8 V)
        tl.static_assert(SINK == 0, "qv is not applied to BF16 sink keys")
        qv_base = (QV + b.to(tl.int64) * stride_qvb + (q_start + start_m).to(tl.int64) * stride_qvs
                   + h.to(tl.int64) * stride_qvh)
        qv = _load_tile(qv_base + tl.arange(0, BLOCK_M)[:, None] * stride_qvs + offs_dv[None, :] * stride_qvd,
                        row_ok[:, None], offs_dv[None, :] < HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V)
        if PV_FP8:
            qv_v_scale = tl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd,
                                 mask=offs_dv < HEAD_DIM_V, other=1.0)
            qv = (qv.to(tl.float32) * qv_v_scale[None, :]).to(tl.bfloat16)
        else:
            qv = qv.to(V.dtype.element_ty)

    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    causal_offset = seqlen_k - seqlen_q  # bottom-right alignment
    chunk_lo = offs_m  # (a placeholder without HAS_CHUNK)
    if HAS_CHUNK:  # Llama-4's chunked attention: row r sees keys [chunk_lo[r], chunk_lo[r] + attention_chunk)
        chunk_lo = _chunk_start(offs_m + causal_offset, attention_chunk)
        first_chunk = _chunk_start(start_m + causal_offset, attention_chunk)  # the tile's first and last rows'
        last_chunk = _chunk_start(start_m + BLOCK_M - 1 + causal_offset, attention_chunk)
    lo_offset = 0
    if HAS_WINDOW_LEFT:  # the window's left side: row r sees keys >= r + lo_offset
        lo_offset = causal_offset - window_left
    if HAS_WINDOW_RIGHT:  # non-causal window's right side: the causal path with the diagonal moved right
        tl.static_assert(CAUSAL, "the window's right side runs on the causal path")
        causal_offset = causal_offset + window_right
    n_end = seqlen_k
    n_full = (seqlen_k // BLOCK_N) * BLOCK_N
    if HAS_USED_Q:  # a tile past the used queries visits no key (its rows are written as 0, LSE -inf)
        n_end = tl.where(start_m < seqlen_q, n_end, 0)
        n_full = tl.where(start_m < seqlen_q, n_full, 0)
    if CAUSAL:
        last_visible = start_m + BLOCK_M + causal_offset  # keys < this are seen by some row
        if last_visible < n_end:
            n_end = last_visible
        if n_end < 0:
            n_end = 0
        # blocks whose every key is visible to the block's first row need no mask
        first_row_sees = start_m + causal_offset + 1
        if first_row_sees < 0:
            first_row_sees = 0
        if (first_row_sees // BLOCK_N) * BLOCK_N < n_full:
            n_full = (first_row_sees // BLOCK_N) * BLOCK_N
    if HAS_CHUNK:  # keys past the last row's chunk are skipped, those past the first row's chunk masked
        n_end = tl.maximum(tl.minimum(n_end, last_chunk + attention_chunk), 0)
        n_full = tl.minimum(n_full, (tl.maximum(first_chunk + attention_chunk, 0) // BLOCK_N) * BLOCK_N)
    k_scale_ptr = KS + b * stride_ksb + hk * stride_ksh
    if SINK > 0:  # keys [0, SINK) are attended in 16 bits after the FP8 keys (below)
        n_full = tl.maximum(n_full, SINK)

    cap_log2 = 0.0
    two_over_cap = 0.0
    cap_shift = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SOFTCAP:
        tl.static_assert(SINK == 0, "softcap is not applied to BF16 sink keys")
        cap_log2 = softcap * 1.4426950408889634
        two_over_cap = 2.0 / softcap
        if HAS_KMEAN:  # K was stored as K - mean: tanh needs the true scores, q.k = q.(k - mean) + q.mean
            cap_mean = tl.load(KMEAN + b * stride_kmb + hk * stride_kmh + offs_dqk * stride_kmd,
                               mask=offs_dqk < HEAD_DIM_QK, other=0.0)
            cap_shift = tl.sum(q.to(tl.float32) * cap_mean[None, :], 1) * sm_scale
            if IS_FP8:
                cap_shift = cap_shift * q_scale
            cap_shift = cap_shift * 1.4426950408889634
    n_begin = SINK
    if HAS_WINDOW_LEFT or HAS_CHUNK:
        # blocks below the tile's first row's lowest key are skipped, those below its last row's lowest
        # key are masked (this loop), the rest go through the loops below as without a window
        tl.static_assert(SINK == 0, "sliding windows and chunks are not applied to BF16 sink keys")
        if HAS_WINDOW_LEFT:
            first_lo = tl.maximum(start_m + lo_offset, 0)
            last_lo = tl.maximum(start_m + BLOCK_M - 1 + lo_offset, 0)
            if HAS_CHUNK:
                first_lo = tl.maximum(first_lo, first_chunk)
                last_lo = tl.maximum(last_lo, last_chunk)
        else:
            first_lo = tl.maximum(first_chunk, 0)
            last_lo = tl.maximum(last_chunk, 0)
        n_lo = (first_lo // BLOCK_N) * BLOCK_N
        n_mid = ((last_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        for start_n in range(n_lo, tl.minimum(n_mid, n_end), BLOCK_N):
            k_scale = tl.load(k_scale_ptr + (start_n // SCALE_BLK) * stride_ksn) if IS_FP8 else 1.0
            acc, l_i, m_i = _attend_kv_block(
                acc, l_i, m_i, q, c_row,
                _block_start(k_base, start_n, stride_ks, PAGE_SIZE), _block_start(v_base, start_n, stride_vs, PAGE_SIZE),
                k_scale, start_n, offs_m, offs_n, offs_dqk, offs_dv, seqlen_k, causal_offset,
                stride_ks, stride_kd, stride_vs, stride_vd,
                HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV,
                True, CAUSAL, PV_FP8, DOT_UPCAST, EXACT_FP8_ROUND, P_SHIFT,
                lo_offset, cap_shift, cap_log2, two_over_cap, HAS_WINDOW_LEFT, HAS_SOFTCAP,
                pages, stride_ptn, stride_kb, stride_vb, PAGE_SIZE, chunk_lo, attention_chunk, HAS_CHUNK, qv, HAS_QV)
        n_begin = n_mid
        n_full = tl.maximum(n_full, n_mid)  # the masked loop below starts past the first one

    for start_n in range(n_begin, n_full, BLOCK_N):
        k_scale = tl.load(k_scale_ptr + (start_n // SCALE_BLK) * stride_ksn) if IS_FP8 else 1.0
        acc, l_i, m_i = _attend_kv_block(
            acc, l_i, m_i, q, c_row,
            _block_start(k_base, start_n, stride_ks, PAGE_SIZE), _block_start(v_base, start_n, stride_vs, PAGE_SIZE),
            k_scale, start_n, offs_m, offs_n, offs_dqk, offs_dv, seqlen_k, causal_offset,
            stride_ks, stride_kd, stride_vs, stride_vd,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV,
            False, CAUSAL, PV_FP8, DOT_UPCAST, EXACT_FP8_ROUND, P_SHIFT,
            lo_offset, cap_shift, cap_log2, two_over_cap, False, HAS_SOFTCAP,
            pages, stride_ptn, stride_kb, stride_vb, PAGE_SIZE, chunk_lo, attention_chunk, False, qv, HAS_QV)
    for start_n in range(n_full, n_end, BLOCK_N):
        k_scale = tl.load(k_scale_ptr + (start_n // SCALE_BLK) * stride_ksn) if IS_FP8 else 1.0
        acc, l_i, m_i = _attend_kv_block(
            acc, l_i, m_i, q, c_row,
            _block_start(k_base, start_n, stride_ks, PAGE_SIZE), _block_start(v_base, start_n, stride_vs, PAGE_SIZE),
            k_scale, start_n, offs_m, offs_n, offs_dqk, offs_dv, seqlen_k, causal_offset,
            stride_ks, stride_kd, stride_vs, stride_vd,
            HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV,
            True, CAUSAL, PV_FP8, DOT_UPCAST, EXACT_FP8_ROUND, P_SHIFT,
            lo_offset, cap_shift, cap_log2, two_over_cap, HAS_WINDOW_LEFT, HAS_SOFTCAP,
            pages, stride_ptn, stride_kb, stride_vb, PAGE_SIZE, chunk_lo, attention_chunk, HAS_CHUNK, qv, HAS_QV)
    if SINK > 0:
        # BF16 sink keys, last: the FP8 blocks' P was scaled by their own running max (as if
        # the sink were a separate call), and the online softmax merges the two exactly
        tl.static_assert(PV_FP8, "BF16 sink keys are part of an FP8 call")
        tl.static_assert(SINK % BLOCK_N == 0, "the sink is whole KV tiles")
        qb = _load_tile(SQ + b.to(tl.int64) * stride_sqb + (q_start + start_m).to(tl.int64) * stride_sqs
                        + h.to(tl.int64) * stride_sqh + tl.arange(0, BLOCK_M)[:, None] * stride_sqs
                        + offs_dqk[None, :] * stride_sqd,
                        row_ok[:, None], offs_dqk[None, :] < HEAD_DIM_QK, True, BLOCK_DQK != HEAD_DIM_QK)
        q_shift = tl.zeros([BLOCK_M], tl.float32)
        if SINK_SHIFT:  # K was smoothed: the FP8 scores are q.(k - mean)
            sink_mean = tl.load(KMEAN + b * stride_kmb + hk * stride_kmh + offs_dqk * stride_kmd,
                                mask=offs_dqk < HEAD_DIM_QK, other=0.0)
            q_shift = tl.sum(qb.to(tl.float32) * sink_mean[None, :], 1)
        qb = _upcast(qb, DOT_UPCAST)
        inv_v_scale = 1.0 / tl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd,
                                    mask=offs_dv < HEAD_DIM_V, other=1.0)
        c_sink = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
        kb_base = SK + b.to(tl.int64) * stride_skb + k_start.to(tl.int64) * stride_sks + hk.to(tl.int64) * stride_skh
        vb_base = SV + b.to(tl.int64) * stride_svb + k_start.to(tl.int64) * stride_svs + hk.to(tl.int64) * stride_svh
        for start_n in range(0, SINK, BLOCK_N):
            acc, l_i, m_i = _attend_sink_block(
                acc, l_i, m_i, qb, q_shift, c_sink, inv_v_scale,
                kb_base + start_n * stride_sks, vb_base + start_n * stride_svs,
                start_n, offs_m, offs_n, offs_dqk, offs_dv, seqlen_k, causal_offset,
                stride_sks, stride_skd, stride_svs, stride_svd,
                HEAD_DIM_QK, HEAD_DIM_V, BLOCK_DQK, BLOCK_DV, CAUSAL, DOT_UPCAST, P_SHIFT)

    # epilogue: normalize, V per-channel descale, store O (and LSE)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if PV_FP8:
        v_scale = tl.load(VS + b * stride_vsb + hk * stride_vsh + offs_dv * stride_vsd,
                          mask=offs_dv < HEAD_DIM_V, other=1.0)
        out = out * v_scale[None, :]
    if HAS_USED_Q:  # rows past the used queries (their q was read as zeros): output 0, LSE -inf
        out = tl.where(row_ok[:, None], out, 0.0)
    o_base = O + b.to(tl.int64) * stride_ob + (q_start + start_m).to(tl.int64) * stride_os + h.to(tl.int64) * stride_oh
    tl.store(o_base + tl.arange(0, BLOCK_M)[:, None] * stride_os + offs_dv[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=(offs_m < seqlen_q_slot)[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    if RETURN_LSE:
        lse = (m_i - P_SHIFT + tl.math.log2(l_i)) * 0.6931471805599453
        if HAS_KMEAN and not HAS_SOFTCAP:  # K was stored as K - mean: add back softmax_scale * q . mean
            if SINK > 0 and SINK_SHIFT:
                q_dot_mean = q_shift  # from the 16-bit q: exact (the sink's scores used it too)
            else:
                k_mean = tl.load(KMEAN + b * stride_kmb + hk * stride_kmh + offs_dqk * stride_kmd,
                                 mask=offs_dqk < HEAD_DIM_QK, other=0.0)
                q_dot_mean = tl.sum(q.to(tl.float32) * k_mean[None, :], 1)
                if IS_FP8:
                    q_dot_mean = q_dot_mean * q_scale
            lse = lse + q_dot_mean * sm_scale
        if HAS_USED_Q:
            lse = tl.where(row_ok, lse, NEG_INF)
        lse_ptrs = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + (q_start + offs_m).to(tl.int64) * stride_ls
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q_slot)


def _configs():
    shapes = [  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
        (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),  # head dim <= 128
        (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 32, 4, 2),    # head dim 192/256
        (64, 32, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2), (64, 32, 8, 1),      # V head dim 512 (FA3's MLA form)
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


def _prune_configs(configs, named_args, **kwargs):
    """Four candidates per head-dim class (up to 128, 192/256, V 512), so a new shape costs four compiles, not 12.
    FP8 with ``qv`` at a V head dim of 256 takes the three smallest tiles instead: its sm90 build spills 3.5 KB at
    128 x 64 and 1.4 KB at 64 x 32 with two stages, against 0-844 B for 32 x 32 and 64 x 32 with one stage."""
    widest = max(kwargs.get("BLOCK_DQK", 128), kwargs.get("BLOCK_DV", 128))
    if kwargs.get("HAS_QV") and kwargs.get("IS_FP8") and 128 < widest <= 256:
        return configs[9:]
    return configs[8:] if widest > 256 else configs[4:8] if widest > 128 else configs[:4]


_attn_fwd_tuned = triton.autotune(
    configs=_configs(),
    key=["HEAD_DIM_QK", "HEAD_DIM_V", "IS_FP8", "MIXED", "CAUSAL", "VARLEN", "group", "seq_bucket", "RETURN_LSE",
         "SINK", "HAS_WINDOW_LEFT", "HAS_WINDOW_RIGHT", "HAS_SOFTCAP", "PAGE_SIZE", "KV_PER_SEQ", "HAS_CHUNK",
         "HAS_QV"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_attn_fwd)

#: tile used under the CPU interpreter (no autotuning there: every config would run)
INTERPRETER_TILE = {"BLOCK_M": 32, "BLOCK_N": 32}
#: below this many (query x key) pairs per sequence a fixed tile is used instead of autotuning
AUTOTUNE_MIN_WORK = 1024 * 1024
SMALL_TILE = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
#: the fixed tile of small problems with a V head dim above 256 (a 64 x 512 fp32 accumulator over 4 warps would
#: take 256 registers a thread), and of FP8 ``qv`` calls above 128 (see :func:`_prune_configs`)
SMALL_TILE_WIDE_V = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def _interpreting(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _strides4(t: torch.Tensor, varlen: bool):
    """(batch, seq, head, dim) strides; varlen tensors have no batch axis."""
    return (0, *t.stride()) if varlen else t.stride()


def run(problem):
    """Launch the portable kernel for a validated :class:`leanfa.problem.Problem`; returns (out, lse)."""
    out, lse = allocate_outputs(problem)
    _launch(problem, out, lse)
    return out, lse


def _launch(problem, out, lse):
    p = problem
    q, k, v = p.q, p.k, p.v
    if p.varlen:
        lse_strides = (0, *lse.stride()) if lse is not None else (0, 0, 0)
    else:
        lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    if out.numel() == 0:
        return
    q_scale, k_scale = p.q_scale, p.k_scale
    # a one-block table serves every token: stride 0 keeps token // 128 in bounds
    qs_strides, ks_strides = broadcast_strides(q_scale), broadcast_strides(k_scale)
    k_mean = p.k_mean
    # the K-mean term: in the LSE, or (softcap) inside the scores, which tanh does not shift
    has_kmean = k_mean is not None and (p.return_lse or p.softcap > 0)
    km = k_mean if k_mean is not None else q_scale
    km_strides = k_mean.stride() if k_mean is not None else (0, 0, 0)
    cu_q = p.cu_seqlens_q if p.varlen else q_scale
    cu_k = p.cu_seqlens_k if p.cu_seqlens_k is not None else q_scale
    cu_v = p.cu_seqlens_v if p.cu_seqlens_v is not None else cu_k  # where each sequence's V starts
    sink = p.sink_keys > 0
    sq, sk, sv = (p.sink_q, p.sink_k, p.sink_v) if sink else (q, k, v)
    sink_strides = [*_strides4(sq, p.varlen), *_strides4(sk, p.varlen), *_strides4(sv, p.varlen)] if sink else [0] * 12
    interp = _interpreting(q)
    args = dict(
        HEAD_DIM_QK=p.head_dim_qk, HEAD_DIM_V=p.head_dim_v,
        BLOCK_DQK=triton.next_power_of_2(p.head_dim_qk), BLOCK_DV=triton.next_power_of_2(p.head_dim_v),
        CAUSAL=p.causal, VARLEN=p.varlen,
        IS_FP8=p.is_fp8, DOT_UPCAST=2 if interp else 0,
        EXACT_FP8_ROUND=interp,
        RETURN_LSE=p.return_lse, HAS_KMEAN=has_kmean, SCALE_BLK=SCALE_BLOCK,
        SINK=p.sink_keys, SINK_SHIFT=sink and k_mean is not None,
        HAS_USED_Q=p.seqused_q is not None, HAS_USED_K=p.seqused_k is not None, MIXED=p.is_mixed,
    )
    # sliding windows and softcap: switched on only where a call has them (the default kernels are unchanged);
    # a window's right side runs on the causal path with the diagonal moved right by window_right
    if p.window_left >= 0:
        args["HAS_WINDOW_LEFT"] = True
    if p.window_right >= 0 and not p.causal:
        args.update(CAUSAL=True, HAS_WINDOW_RIGHT=True)
    if p.softcap > 0:
        args["HAS_SOFTCAP"] = True
    # paged K/V and packed queries over per-sequence K/V: switched on only where a call has them, as above
    if p.paged:
        args["PAGE_SIZE"] = p.page_size
    if p.kv_per_sequence:
        args["KV_PER_SEQ"] = True
    # chunked attention and qv: switched on only where a call has them, as above
    if p.attention_chunk > 0:
        args["HAS_CHUNK"] = True
    if p.qv is not None:
        args["HAS_QV"] = True
    if p.cu_seqlens_k is not None:
        seqlen_k_dense = 0
    else:  # a dense key slot per sequence: the tensor's, or the page table row's capacity
        seqlen_k_dense = p.page_table.shape[1] * p.page_size if p.paged else k.shape[1]
    # the page table and its strides; None without paging: Triton makes None arguments constexprs, so the kernels
    # without paging keep their parameter list and compile to the same TTGIR as before paging existed
    pt = p.page_table if p.paged else None
    pt_strides = p.page_table.stride() if p.paged else (None, None)
    qv_strides = _strides4(p.qv, p.varlen) if p.qv is not None else (None,) * 4
    if interp:
        kernel = _attn_fwd
        args.update(INTERPRETER_TILE)
    elif p.max_seqlen_q * max(p.max_seqlen_k, 1) < AUTOTUNE_MIN_WORK:
        kernel = _attn_fwd  # small problems: a fixed tile, no autotuning sweep
        wide = p.head_dim_v > 256 or (p.qv is not None and p.is_fp8 and p.head_dim_v > 128)
        args.update(SMALL_TILE_WIDE_V if wide else SMALL_TILE)
    else:
        kernel = _attn_fwd_tuned

    def grid(meta):
        return (p.batch * p.heads, triton.cdiv(p.max_seqlen_q, meta["BLOCK_M"]))

    kernel[grid](
        q, k, v, out, lse if lse is not None else out, q_scale, k_scale, p.v_scale, km, cu_q, cu_k, cu_v, sq, sk, sv,
        p.seqused_q if p.seqused_q is not None else cu_q, p.seqused_k if p.seqused_k is not None else cu_k,
        p.softmax_scale * LOG2E, p.softmax_scale,
        p.max_seqlen_q if not p.varlen else 0, seqlen_k_dense, p.heads,
        p.heads // p.kv_heads, min(triton.next_power_of_2(p.max_seqlen_q), 1 << 15),
        max(p.window_left, 0), max(p.window_right, 0), float(p.softcap), p.attention_chunk,
        *_strides4(q, p.varlen), *_strides4(k, k.dim() == 3), *_strides4(v, v.dim() == 3), *_strides4(out, p.varlen),
        *lse_strides, *qs_strides, *ks_strides, *p.v_scale.stride(), *km_strides, *sink_strides, pt, *pt_strides,
        p.qv, *qv_strides, **args,
    )
