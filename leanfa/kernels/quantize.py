"""Triton kernels of the FP8 quantizer (the host side is :mod:`leanfa.quant`).

Two building blocks, each a ``@triton.jit`` helper:

* :func:`chunk_stats` -- per-channel sum and/or max |x| over one chunk of tokens of one head;
* :func:`quantize_tile` -- one block of ``BLOCK_S`` tokens of one head to e4m3, divided by its
  own block scale (computed here), a given per-head/tensor scale, or a per-channel scale,
  after an optional per-channel mean is subtracted.

They make up two families of kernels:

* the general ones, one tensor per launch (:func:`channel_stats`, :func:`quantize_blocks`),
  which serve every granularity;
* the fused ones for the default ``granularity="block"``: :func:`kv_stats` (K channel sums
  and V channel amax in one pass) and :func:`quantize_qkv` (Q, K and V in one launch, with
  the K mean and the V scales finished inside the kernel from the partial statistics). Two
  launches instead of five and no PyTorch reductions in between: the quantizer's host time
  bounds short prefills.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import E4M3_MAX_C, to_e4m3
from .sequences import sequence_span


@triton.jit
def chunk_stats(base, s_begin, seqlen, stride_s, stride_d,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
                WANT_SUM: tl.constexpr, WANT_AMAX: tl.constexpr):
    """(sum, max |x|) per channel over tokens ``[s_begin, s_begin + CHUNK)`` of a sequence of
    ``seqlen`` tokens; ``base`` points at token ``s_begin`` of the head."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    total = tl.zeros([BLOCK_D], tl.float32)
    amax = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, CHUNK, BLOCK_S):
        rows = s0 + offs_s
        x = tl.load(base + rows[:, None] * stride_s + offs_d[None, :] * stride_d,
                    mask=(s_begin + rows[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        if WANT_SUM:
            total += tl.sum(x, 0)
        if WANT_AMAX:
            amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
    return total, amax


@triton.jit
def quantize_tile(xb, yb, s0, seqlen, stride_xs, stride_xd, stride_ys, stride_yd, scale_ptr, mean, ch,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  SUBTRACT_MEAN: tl.constexpr, COMPUTE_SCALE: tl.constexpr,
                  CHANNEL_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """Quantize tokens ``[s0, s0 + BLOCK_S)`` of one head (``xb``/``yb`` point at token s0).

    ``mean``/``ch``: ``[BLOCK_D]`` per-channel mean and descale (used when SUBTRACT_MEAN /
    CHANNEL_SCALE). Otherwise the block is divided by the scale at ``scale_ptr``: computed
    here as amax / 448 and stored when COMPUTE_SCALE, else read.
    """
    offs_d = tl.arange(0, BLOCK_D)
    local = tl.arange(0, BLOCK_S)  # 32-bit offsets inside the block (the base is 64-bit)
    mask = (s0 + local[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(xb + local[:, None] * stride_xs + offs_d[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if SUBTRACT_MEAN:
        x = tl.where(mask, x - mean[None, :], 0.0)
    if CHANNEL_SCALE:
        x = x / ch[None, :]
    else:
        if COMPUTE_SCALE:
            amax = tl.max(tl.max(tl.abs(x), 1), 0)
            descale = tl.where(amax > 0.0, amax / E4M3_MAX_C, 1.0)
            tl.store(scale_ptr, descale)
        else:
            descale = tl.load(scale_ptr)
        x = x / descale
    tl.store(yb + local[:, None] * stride_ys + offs_d[None, :] * stride_yd,
             # clamp keeping NaN (a plain clamp maps NaN to +-448 on the GPU: a silent wrong
             # answer); the e4m3 conversion keeps NaN, so a NaN input stays NaN
             to_e4m3(tl.clamp(x, -E4M3_MAX_C, E4M3_MAX_C, propagate_nan=tl.PropagateNan.ALL), False, EXACT_ROUND),
             mask=mask)


@triton.jit
def _sequence_head(i, CU, seqlen_dense, num_heads, VARLEN: tl.constexpr):
    """(batch, head, first token, length) of flat head index ``i = b * num_heads + h``."""
    b = i // num_heads
    h = i % num_heads
    start, seqlen = sequence_span(CU, b, seqlen_dense, VARLEN)
    return b, h, start, seqlen


@triton.jit
def _head_base(X, b, h, token, stride_b, stride_s, stride_h):
    """Pointer to ``token`` of head ``h`` of sequence ``b`` (64-bit offsets)."""
    return X + b.to(tl.int64) * stride_b + token.to(tl.int64) * stride_s + h.to(tl.int64) * stride_h


# ----------------------------------------------------------------------------- general kernels


@triton.jit(do_not_specialize=["seqlen_dense", "num_heads"])
def channel_stats(
    X, CU, SUM, AMAX, seqlen_dense, num_heads,
    stride_xb, stride_xs, stride_xh, stride_xd,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    VARLEN: tl.constexpr, WANT_SUM: tl.constexpr, WANT_AMAX: tl.constexpr,
):
    """Per (batch, head, chunk of CHUNK tokens): the sum of each channel and/or its max |x|.

    Partial results go to SUM/AMAX[(b*H + h), chunk, :]; the host reduces over chunks, so a
    long sequence is read by many programs at once instead of one.
    """
    chunk = tl.program_id(0)
    pid = tl.program_id(1)
    b, h, start, seqlen = _sequence_head(pid, CU, seqlen_dense, num_heads, VARLEN)
    s_begin = chunk * CHUNK
    base = _head_base(X, b, h, start + s_begin, stride_xb, stride_xs, stride_xh)
    total, amax = chunk_stats(base, s_begin, seqlen, stride_xs, stride_xd,
                              HEAD_DIM, BLOCK_D, BLOCK_S, CHUNK, WANT_SUM, WANT_AMAX)
    offs_d = tl.arange(0, BLOCK_D)
    out = (pid * tl.num_programs(0) + chunk) * HEAD_DIM + offs_d
    if WANT_SUM:
        tl.store(SUM + out, total, mask=offs_d < HEAD_DIM)
    if WANT_AMAX:
        tl.store(AMAX + out, amax, mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["seqlen_dense", "num_heads"])
def quantize_blocks(
    X, Y, CU, MEAN, SCALE, CH_SCALE, seqlen_dense, num_heads,
    stride_xb, stride_xs, stride_xh, stride_xd,
    stride_yb, stride_ys, stride_yh, stride_yd,
    stride_sb, stride_sh, stride_sn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    VARLEN: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, COMPUTE_SCALE: tl.constexpr,
    CHANNEL_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr,
):
    """Quantize one block of BLOCK_S tokens of one head to e4m3 (see :func:`quantize_tile`);
    MEAN and CH_SCALE are ``(B*H, D)`` tables, SCALE a ``(B, H, nblk)`` one (stride 0 for a
    per-head/per-tensor scale)."""
    blk = tl.program_id(0)
    pid = tl.program_id(1)
    b, h, start, seqlen = _sequence_head(pid, CU, seqlen_dense, num_heads, VARLEN)
    s0 = blk * BLOCK_S
    if s0 >= seqlen:
        return
    offs_d = tl.arange(0, BLOCK_D)
    mean = tl.zeros([BLOCK_D], tl.float32)
    ch = tl.full([BLOCK_D], 1.0, tl.float32)
    if SUBTRACT_MEAN:
        mean = tl.load(MEAN + pid * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
    if CHANNEL_SCALE:
        ch = tl.load(CH_SCALE + pid * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=1.0)
    quantize_tile(_head_base(X, b, h, start + s0, stride_xb, stride_xs, stride_xh),
                  _head_base(Y, b, h, start + s0, stride_yb, stride_ys, stride_yh),
                  s0, seqlen, stride_xs, stride_xd, stride_ys, stride_yd,
                  SCALE + b * stride_sb + h * stride_sh + blk * stride_sn, mean, ch,
                  HEAD_DIM, BLOCK_D, BLOCK_S, SUBTRACT_MEAN, COMPUTE_SCALE, CHANNEL_SCALE, EXACT_ROUND)


# ------------------------------------------------------------ fused kernels (granularity="block")


@triton.jit(do_not_specialize=["seqlen_dense", "num_heads"])
def kv_stats(
    K, V, CU, KSUM, VAMAX, seqlen_dense, num_heads,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, VARLEN: tl.constexpr, WANT_KSUM: tl.constexpr,
):
    """One pass over K and V per (batch, KV head, chunk): K's channel sums (for the mean, when
    WANT_KSUM) and V's channel max |v|, as partials KSUM[pid, chunk, :] / VAMAX[pid, chunk, :]
    that :func:`quantize_qkv` finishes. Every slot is written (zeros past a sequence's end)."""
    chunk = tl.program_id(0)
    pid = tl.program_id(1)
    b, h, start, seqlen = _sequence_head(pid, CU, seqlen_dense, num_heads, VARLEN)
    s_begin = chunk * CHUNK
    slot = pid * tl.num_programs(0) + chunk
    if WANT_KSUM:
        ksum, _ = chunk_stats(_head_base(K, b, h, start + s_begin, stride_kb, stride_ks, stride_kh), s_begin, seqlen,
                              stride_ks, stride_kd, DQK, BLOCK_DQK, BLOCK_S, CHUNK, True, False)
        offs_k = tl.arange(0, BLOCK_DQK)
        tl.store(KSUM + slot * DQK + offs_k, ksum, mask=offs_k < DQK)
    _, vamax = chunk_stats(_head_base(V, b, h, start + s_begin, stride_vb, stride_vs, stride_vh), s_begin, seqlen,
                           stride_vs, stride_vd, DV, BLOCK_DV, BLOCK_S, CHUNK, False, True)
    offs_v = tl.arange(0, BLOCK_DV)
    tl.store(VAMAX + slot * DV + offs_v, vamax, mask=offs_v < DV)


@triton.jit(do_not_specialize=["seqlen_q_dense", "seqlen_k_dense", "batch", "heads_q", "heads_kv", "nchunks",
                               "nblk_q", "nblk_k"])
def quantize_qkv(
    Q, K, V, Q8, K8, V8, CU_Q, CU_K, KSUM, VAMAX, QS, KS, KMEAN, VS,
    seqlen_q_dense, seqlen_k_dense, batch, heads_q, heads_kv, nchunks, nblk_q, nblk_k,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_q8b, stride_q8s, stride_q8h, stride_q8d,
    stride_k8b, stride_k8s, stride_k8h, stride_k8d,
    stride_v8b, stride_v8s, stride_v8h, stride_v8d,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, VARLEN: tl.constexpr, SMOOTH_K: tl.constexpr, EXACT_ROUND: tl.constexpr,
):
    """Q, K and V in one launch, ``granularity="block"``. Programs ``(blk, pid)``: pid in
    ``[0, B*Hq)`` quantize Q (block scales to QS, contiguous ``(B, Hq, nblk_q)``), the next ``B*Hkv`` K
    (the mean, finished from KSUM and written to KMEAN ``(B, Hkv, Dqk)`` by block 0, is
    subtracted; block scales to KS), the last ``B*Hkv`` V (per-channel descale amax / 448 from
    VAMAX, written to VS ``(B, Hkv, Dv)`` by block 0; V8 is the transposed storage's view)."""
    # (the Q, K and V branches name their values apart: Triton requires a name assigned in
    # both arms of an `if` to have one type, and the head dims differ)
    blk = tl.program_id(0)
    pid = tl.program_id(1)
    nq = batch * heads_q
    nk = batch * heads_kv
    s0 = blk * BLOCK_S
    if pid < nq:
        b, h, start, seqlen = _sequence_head(pid, CU_Q, seqlen_q_dense, heads_q, VARLEN)
        if s0 < seqlen:
            quantize_tile(_head_base(Q, b, h, start + s0, stride_qb, stride_qs, stride_qh),
                          _head_base(Q8, b, h, start + s0, stride_q8b, stride_q8s, stride_q8h),
                          s0, seqlen, stride_qs, stride_qd, stride_q8s, stride_q8d,
                          QS + (pid * nblk_q + blk), tl.zeros([BLOCK_DQK], tl.float32),
                          tl.full([BLOCK_DQK], 1.0, tl.float32),
                          DQK, BLOCK_DQK, BLOCK_S, False, True, False, EXACT_ROUND)
    else:
        kv = pid - nq if pid < nq + nk else pid - nq - nk
        b, h, start, seqlen = _sequence_head(kv, CU_K, seqlen_k_dense, heads_kv, VARLEN)
        if pid < nq + nk:  # K
            offs_dk = tl.arange(0, BLOCK_DQK)
            mean = tl.zeros([BLOCK_DQK], tl.float32)
            if SMOOTH_K:
                for c in range(0, nchunks):
                    mean += tl.load(KSUM + (kv * nchunks + c) * DQK + offs_dk, mask=offs_dk < DQK, other=0.0)
                mean = mean / tl.maximum(seqlen, 1).to(tl.float32)
                if blk == 0:
                    tl.store(KMEAN + kv * DQK + offs_dk, mean, mask=offs_dk < DQK)
            if s0 < seqlen:
                quantize_tile(_head_base(K, b, h, start + s0, stride_kb, stride_ks, stride_kh),
                              _head_base(K8, b, h, start + s0, stride_k8b, stride_k8s, stride_k8h),
                              s0, seqlen, stride_ks, stride_kd, stride_k8s, stride_k8d,
                              KS + (kv * nblk_k + blk), mean, tl.full([BLOCK_DQK], 1.0, tl.float32),
                              DQK, BLOCK_DQK, BLOCK_S, SMOOTH_K, True, False, EXACT_ROUND)
        else:  # V
            offs_dv = tl.arange(0, BLOCK_DV)
            amax = tl.zeros([BLOCK_DV], tl.float32)
            for c in range(0, nchunks):
                amax = tl.maximum(amax, tl.load(VAMAX + (kv * nchunks + c) * DV + offs_dv, mask=offs_dv < DV, other=0.0))
            ch = tl.where(amax > 0.0, amax / E4M3_MAX_C, 1.0)
            if blk == 0:
                tl.store(VS + kv * DV + offs_dv, ch, mask=offs_dv < DV)
            if s0 < seqlen:
                quantize_tile(_head_base(V, b, h, start + s0, stride_vb, stride_vs, stride_vh),
                              _head_base(V8, b, h, start + s0, stride_v8b, stride_v8s, stride_v8h),
                              s0, seqlen, stride_vs, stride_vd, stride_v8s, stride_v8d,
                              VS, tl.zeros([BLOCK_DV], tl.float32), ch,
                              DV, BLOCK_DV, BLOCK_S, False, False, True, EXACT_ROUND)
