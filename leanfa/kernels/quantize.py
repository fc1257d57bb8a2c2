"""Triton kernels of the FP8 quantizer (the host side is :mod:`leanfa.quant`).

Building blocks, each a ``@triton.jit`` helper:

* :func:`chunk_stats` -- per-channel sum and/or max |x| over one chunk of tokens of one head;
* :func:`tile_amax` -- max |x - mean| of a tile (in the input's own dtype when there is no mean);
* :func:`quantize_tile` -- one block of ``BLOCK_S`` tokens of one head to e4m3, divided by its
  own block scale (computed here), a given per-head/tensor scale, or a per-channel scale,
  after an optional per-channel mean is subtracted (and, with ROTATE, an optional Hadamard
  rotation first, :func:`rotate_tile`);
* :func:`rotation_wanted` -- the adaptive rotation's per-KV-head choice from channel energies.

They make up two families of kernels:

* the general ones, one tensor per launch (:func:`channel_stats`, :func:`quantize_blocks`),
  which serve every granularity;
* the fused ones for the default ``granularity="block"``, three launches and no PyTorch ops
  in between (the quantizer's host time bounds short prefills):

  1. :func:`kv_stats` -- one program per 128-token block of each KV head, one pass over K and
     V: per-block K channel sums and V channel max |v|;
  2. :func:`finish_kv_stats` -- those partials reduced once per head, in a fixed order, to the
     K mean ``(B*Hkv, Dqk)`` and the V descales ``(B*Hkv, Dv)``;
  3. :func:`quantize_qkv` -- every 128-token block of Q, K and V, reading the finished mean and
     descales as one row each.

  The passes are memory-bound: the statistics pass launches one program per block (not a
  loop over a long chunk) so many loads are in flight per SM; the quantize pass keeps a Q tile
  in bf16 until its scale is known (fewer registers, so more blocks per SM) and stores V's
  transposed tile 16 bytes at a time along tokens (each sequence's rows start on a multiple of 16 tokens:
  dense rows are padded, packed varlen V takes the aligned layout the Hopper kernel's TMA loads read,
  :mod:`.varlen_v`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import E4M3_MAX_C, to_e4m3
from .sequences import packed_block, sequence_span
from .varlen_v import aligned_start

# Launch parameters of the fused kernels, shared by the host (leanfa.quant) and the AOT
# compile (leanfa.kernels.triton_aot).

#: the fused quantizer's largest head dim (larger ones take the per-tensor kernels). One
#: quantize_qkv program holds a 128-token tile (and three inlined branches); AOT sm90, 8 warps,
#: no spills: d128 80 registers (3 programs per SM), varlen 128 (2), d192/128 244 (1: the tile
#: is padded to 256 channels). With 4 warps d128 varlen spills (688 bytes). d256 would compile
#: without spills now (244 registers, 64 KB shared) but is neither tested nor timed fused.
FUSED_MAX_DIM = 192
FUSED_WARPS = 8
#: kv_stats: one program per 128-token block of K and V (~63 registers, 4 programs per SM)
STATS_WARPS = 8
#: finish_kv_stats: channels per program, and partial rows (blocks) accumulated per step
FINISH_CHANNELS = 32
FINISH_ROWS = 128
#: packed batches: sequences summed per step when a program looks up its block (sequences.packed_block)
PACKED_STEP = tl.constexpr(256)
#: the fused rotation (quantize_fp8(rotate=True / "auto")): head dims whose padded tile is at most this wide and
#: that have a Hadamard matrix (2^k, 12 * 2^k); wider ones (MLA's 192) take the torch-matmul rotation or none
FUSED_ROTATE_MAX_DIM = 128
#: rotate="auto": Q blocks per query head read for Q's channel energies (kv_stats' Q sample)
Q_SAMPLES = 4
#: rotate="auto": rotate a KV head where D * sum(a b) / (sum(a) sum(b)) reaches this (finish_kv_stats,
#: rotation_wanted); 1 for evenly spread energies. Chosen from the CPU study in docs/accuracy-notes.md
#: ("Issue 24 item 2"): heads where rotation helped measured 2.1-3.9, heads where it hurt 1.0-1.6
ROTATE_MIN_CONCENTRATION = 2.0
#: finish_kv_stats with a rotation: one program per head over every channel, this many partial rows per step
ROTATE_FINISH_ROWS = 16


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
def tile_amax(x, mask, mean, SUBTRACT_MEAN: tl.constexpr):
    """``max |x - mean|`` (float32) of a tile, 0 where ``mask`` is false; ``x`` is the tile as
    loaded (zeros where masked), ``mean`` ``[BLOCK_D]`` float32 (used when SUBTRACT_MEAN).

    Without a mean the maximum is taken in ``x``'s own dtype (exact: it is one of the values),
    so a caller converting to float32 after this keeps only the bf16 tile live across the
    reduction (AOT sm90, fused d128 without K smoothing: 68 registers instead of 92). With a
    mean the float32 ``x - mean`` is needed here, and the caller's identical expression reuses
    it. (Reducing each channel's max and min in bf16 instead, then subtracting the mean, is
    exact too but took more registers: the two reductions run across warps.)
    """
    if SUBTRACT_MEAN:
        return tl.max(tl.max(tl.abs(tl.where(mask, x.to(tl.float32) - mean[None, :], 0.0)), 1), 0)
    return tl.max(tl.max(tl.abs(x), 1), 0).to(tl.float32)


@triton.jit
def hadamard_product(x, h, INTERPRETED: tl.constexpr):
    """``x @ h`` in float32 for a ``[BLOCK_D, BLOCK_D]`` ±1 matrix ``h`` of ``x``'s dtype: a 16-bit tile and the
    matrix enter the tensor-core product exactly and the float32 accumulation is the only rounding (on a GPU not
    IEEE's: the tensor cores' sums round differently from a float32 FMA loop); a float32 tile runs as three TF32
    products. INTERPRETED (the CPU interpreter, whose ``tl.dot`` of bf16 operands returns garbage in Triton 3.6):
    both operands in float32, the same exact products. The one place the rotation multiplies, so a test can
    stand in for the GPU's rounding."""
    if INTERPRETED:
        y = tl.dot(x.to(tl.float32), h.to(tl.float32), input_precision="ieee")
    elif x.dtype == tl.float32:
        y = tl.dot(x, h, input_precision="tf32x3")
    else:
        y = tl.dot(x, h)
    return y


@triton.jit
def rotate_tile(x, rot_ptr, inv_sqrt_d, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x @ (rot / sqrt(D))`` in float32 (:func:`hadamard_product`): ``rot_ptr`` points at a ``[BLOCK_D, BLOCK_D]``
    row-major ±1 matrix (zero-padded past the head dim) of ``x``'s dtype; ``inv_sqrt_d`` is float32(1/sqrt(D))
    (the value ``rotation_matrix``'s float32 entries have)."""
    offs_d = tl.arange(0, BLOCK_D)
    h = tl.load(rot_ptr + offs_d[:, None] * BLOCK_D + offs_d[None, :])
    return hadamard_product(x, h, INTERPRETED) * inv_sqrt_d


@triton.jit
def rotate_residual(r, rot_ptr, inv_sqrt_d, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """``r @ (rot / sqrt(D))`` for a float32 tile ``r`` (K minus its mean) and the ±1 matrix of :func:`rotate_tile`
    (any dtype): on the GPU as two bf16 products, ``r``'s bf16 rounding and the bf16 rounding of what that left
    (``r`` to 2^-17 relative, far below e4m3's 2^-4), accumulated in float32; under the interpreter one float32
    product. A zero row stays exactly zero whatever the product's rounding."""
    offs_d = tl.arange(0, BLOCK_D)
    h = tl.load(rot_ptr + offs_d[:, None] * BLOCK_D + offs_d[None, :])
    if INTERPRETED:
        y = hadamard_product(r, h, INTERPRETED)
    else:
        hb = h.to(tl.bfloat16)
        hi = r.to(tl.bfloat16)
        y = hadamard_product(hi, hb, INTERPRETED)
        y += hadamard_product((r - hi.to(tl.float32)).to(tl.bfloat16), hb, INTERPRETED)
    return y * inv_sqrt_d


@triton.jit
def quantize_tile(xb, yb, s0, seqlen, store_len, stride_xs, stride_xd, stride_ys, stride_yd, scale_ptr, mean, ch,
                  rot_ptr, rot_flag, inv_sqrt_d,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  SUBTRACT_MEAN: tl.constexpr, COMPUTE_SCALE: tl.constexpr,
                  CHANNEL_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr, ROTATE: tl.constexpr):
    """Quantize tokens ``[s0, s0 + BLOCK_S)`` of one head (``xb``/``yb`` point at token s0).
    Tokens past ``seqlen`` read as 0; stores stop at ``store_len`` (>= seqlen: a padded
    destination may take zeros past the end).

    ``mean``/``ch``: ``[BLOCK_D]`` per-channel mean and descale (used when SUBTRACT_MEAN /
    CHANNEL_SCALE). Otherwise the block is divided by the scale at ``scale_ptr``: computed
    here as amax / 448 (:func:`tile_amax`) and stored when COMPUTE_SCALE, else read. Without
    a mean the tile is converted to float32 only once the scale is known (fewer live registers).

    ROTATE (with COMPUTE_SCALE, not CHANNEL_SCALE): where ``rot_flag`` is true the tile is rotated: without a
    mean by :func:`rotate_tile`, with one (``mean`` in the inputs' space) after it is subtracted
    (:func:`rotate_residual`), so a token equal to the mean (a 1-token sequence) stays exactly zero. (Rotating first
    and subtracting the rotated mean left such a row the difference of two float32 sums rounded apart, the
    tensor cores' and finish_kv_stats' FMAs, which its own block scale took to full e4m3 range.)
    """
    offs_d = tl.arange(0, BLOCK_D)
    local = tl.arange(0, BLOCK_S)  # 32-bit offsets inside the block (the base is 64-bit)
    mask = (s0 + local[:, None] < seqlen) & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(xb + local[:, None] * stride_xs + offs_d[None, :] * stride_xd, mask=mask, other=0.0)
    if ROTATE:
        if SUBTRACT_MEAN:
            xf = tl.where(mask, x.to(tl.float32) - mean[None, :], 0.0)
            if rot_flag:
                xf = rotate_residual(xf, rot_ptr, inv_sqrt_d, BLOCK_D, EXACT_ROUND)
        elif rot_flag:
            xf = rotate_tile(x, rot_ptr, inv_sqrt_d, BLOCK_D, EXACT_ROUND)
        else:
            xf = x.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(xf), 1), 0)
        descale = tl.where(amax > 0.0, amax / E4M3_MAX_C, 1.0)
        tl.store(scale_ptr, descale)
    else:
        if CHANNEL_SCALE:
            descale = ch[None, :]
        else:
            if COMPUTE_SCALE:
                amax = tile_amax(x, mask, mean, SUBTRACT_MEAN)
                descale = tl.where(amax > 0.0, amax / E4M3_MAX_C, 1.0)
                tl.store(scale_ptr, descale)
            else:
                descale = tl.load(scale_ptr)
        xf = x.to(tl.float32)
        if SUBTRACT_MEAN:
            xf = tl.where(mask, xf - mean[None, :], 0.0)
    tl.store(yb + local[:, None] * stride_ys + offs_d[None, :] * stride_yd,
             # clamp keeping NaN (a plain clamp maps NaN to +-448 on the GPU: a silent wrong
             # answer); the e4m3 conversion keeps NaN, so a NaN input stays NaN
             to_e4m3(tl.clamp(xf / descale, -E4M3_MAX_C, E4M3_MAX_C, propagate_nan=tl.PropagateNan.ALL), False,
                     EXACT_ROUND),
             mask=(s0 + local[:, None] < store_len) & (offs_d[None, :] < HEAD_DIM))


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
                  s0, seqlen, seqlen, stride_xs, stride_xd, stride_ys, stride_yd,
                  SCALE + b * stride_sb + h * stride_sh + blk * stride_sn, mean, ch, X, False, 1.0,
                  HEAD_DIM, BLOCK_D, BLOCK_S, SUBTRACT_MEAN, COMPUTE_SCALE, CHANNEL_SCALE, EXACT_ROUND, False)


# ------------------------------------------------------------ fused kernels (granularity="block")


@triton.jit(do_not_specialize=["seqlen_dense", "num_heads", "batch", "nblk", "seqlen_q_dense", "heads_q"])
def kv_stats(
    K, V, CU, KSUM, VAMAX, seqlen_dense, num_heads, batch, nblk,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    Q, CU_Q, QSQ, KSQ, seqlen_q_dense, heads_q,
    stride_qb, stride_qs, stride_qh, stride_qd,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, VARLEN: tl.constexpr, WANT_KSUM: tl.constexpr, PACKED: tl.constexpr,
    WANT_V: tl.constexpr = True, ADAPTIVE: tl.constexpr = False, Q_SAMPLES: tl.constexpr = 4,
):
    """Per (block of BLOCK_S tokens, batch * KV head): the sum of each K channel over the block
    (when WANT_KSUM) and the max |v| of each V channel (when WANT_V: V is quantized), to ``KSUM[pid, blk, :]`` /
    ``VAMAX[pid, blk, :]``; :func:`finish_kv_stats` reduces them over each sequence.

    One program per block (thousands at prefill sizes, not a loop over a long chunk) with both
    tiles loaded before either is reduced: many independent loads in flight per SM, which is
    what a pass that only reads needs. Blocks past a sequence's end write nothing. Programs
    ``(blk, b * num_heads + h)``; with PACKED (varlen) ``(i, h)``, the ``i``-th block of the batch
    (:func:`packed_block`), so no program is launched for a block past a short sequence's end. Partials of
    head ``pid`` go to slots ``pid * nblk + blk``.

    ADAPTIVE (the adaptive rotation's statistics; the Q arguments are read only then): the K programs also
    write each channel's sum of squares to ``KSQ[pid, blk, :]``, and further programs read a sample of Q:
    ``Q_SAMPLES`` blocks of each query head (evenly spread over its sequence; all of them when it has no more),
    each writing its channels' sums of squares to ``QSQ[(b * heads_q + hq) * Q_SAMPLES + j, :]`` (zeros for a
    sample past a short sequence's blocks). Their programs: dense ``(j, batch * num_heads + b * heads_q + hq)``
    (the grid's first axis at least Q_SAMPLES), packed ``(b * Q_SAMPLES + j, num_heads + hq)`` (the first axis
    at least ``batch * Q_SAMPLES``).
    """
    if ADAPTIVE:  # the Q sample's programs
        if PACKED:
            is_q = tl.program_id(1) >= num_heads
            qb = tl.program_id(0) // Q_SAMPLES
            qj = tl.program_id(0) % Q_SAMPLES
            qh = tl.program_id(1) - num_heads
        else:
            is_q = tl.program_id(1) >= batch * num_heads
            qb = (tl.program_id(1) - batch * num_heads) // heads_q
            qj = tl.program_id(0)
            qh = (tl.program_id(1) - batch * num_heads) % heads_q
        if is_q:
            if (qb < batch) & (qj < Q_SAMPLES):
                q_start, q_len = sequence_span(CU_Q, qb, seqlen_q_dense, VARLEN)
                q_blocks = tl.cdiv(q_len, BLOCK_S)
                q_blk = tl.where(q_blocks > Q_SAMPLES, ((2 * qj + 1) * q_blocks) // (2 * Q_SAMPLES), qj)
                qrow = tl.arange(0, BLOCK_S)[:, None]
                offs_q = tl.arange(0, BLOCK_DQK)
                xq = tl.load(_head_base(Q, qb, qh, q_start + q_blk * BLOCK_S, stride_qb, stride_qs, stride_qh)
                             + qrow * stride_qs + offs_q[None, :] * stride_qd,
                             mask=(q_blk * BLOCK_S + qrow < q_len) & (offs_q[None, :] < DQK), other=0.0)
                xq = xq.to(tl.float32)
                tl.store(QSQ + ((qb * heads_q + qh) * Q_SAMPLES + qj) * DQK + offs_q, tl.sum(xq * xq, 0),
                         mask=offs_q < DQK)
            return
    if PACKED:
        b, blk = packed_block(tl.program_id(0), CU, batch, BLOCK_S, PACKED_STEP)
        if b >= batch:
            return
        pid = b * num_heads + tl.program_id(1)
    else:
        blk = tl.program_id(0)
        pid = tl.program_id(1)
    b, h, start, seqlen = _sequence_head(pid, CU, seqlen_dense, num_heads, VARLEN)
    s0 = blk * BLOCK_S
    if s0 >= seqlen:
        return
    slot = pid * nblk + blk
    local = tl.arange(0, BLOCK_S)[:, None]  # 32-bit offsets inside the block (the base is 64-bit)
    inside = s0 + local < seqlen
    offs_k = tl.arange(0, BLOCK_DQK)
    offs_v = tl.arange(0, BLOCK_DV)
    if WANT_V:
        v = tl.load(_head_base(V, b, h, start + s0, stride_vb, stride_vs, stride_vh)
                    + local * stride_vs + offs_v[None, :] * stride_vd, mask=inside & (offs_v[None, :] < DV), other=0.0)
    if WANT_KSUM or ADAPTIVE:
        k = tl.load(_head_base(K, b, h, start + s0, stride_kb, stride_ks, stride_kh)
                    + local * stride_ks + offs_k[None, :] * stride_kd, mask=inside & (offs_k[None, :] < DQK), other=0.0)
        kf = k.to(tl.float32)
        if WANT_KSUM:
            tl.store(KSUM + slot * DQK + offs_k, tl.sum(kf, 0), mask=offs_k < DQK)
        if ADAPTIVE:
            tl.store(KSQ + slot * DQK + offs_k, tl.sum(kf * kf, 0), mask=offs_k < DQK)
    if WANT_V:
        tl.store(VAMAX + slot * DV + offs_v, tl.max(tl.abs(v.to(tl.float32)), 0), mask=offs_v < DV)


@triton.jit
def rotation_wanted(q_energy, k_energy, D: tl.constexpr, MIN_CONCENTRATION: tl.constexpr):
    """The adaptive rotation's choice for one KV head: whether ``D * sum(a * b) >= MIN_CONCENTRATION *
    sum(a) * sum(b)``, ``a``/``b`` the per-channel energies (any common scale) of Q (its query heads) and of the
    K that is quantized (about its mean when smoothed). The ratio is 1 when either spreads its energy evenly and
    ``D`` when both sit in one channel: the mean square of a score's e4m3 rounding error is proportional to
    ``sum_d E[q_d^2] E[k_d^2]``, which a Hadamard rotation brings to about ``sum(a) sum(b) / D``."""
    sab = tl.sum(q_energy * k_energy, 0)
    return (sab > 0.0) & (D * sab >= MIN_CONCENTRATION * tl.sum(q_energy, 0) * tl.sum(k_energy, 0))


@triton.jit(do_not_specialize=["seqlen_dense", "num_heads", "nblk", "batch", "room", "group"])
def finish_kv_stats(
    KSUM, VAMAX, CU, KMEAN, VS, CU_V, V8, seqlen_dense, num_heads, nblk, batch, room, stride_v8h, stride_v8d,
    KSQ, QSQ, FLAGS, KMEAN_INPUT, ROT, group, inv_sqrt_d,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
    VARLEN: tl.constexpr, WANT_KSUM: tl.constexpr, ALIGN_V: tl.constexpr, TAIL: tl.constexpr,
    WANT_V: tl.constexpr = True, ROTATE: tl.constexpr = 0, Q_SAMPLES: tl.constexpr = 4,
    BLOCK_R: tl.constexpr = 16, MIN_CONCENTRATION: tl.constexpr = 2.0,
):
    """Per (batch * KV head, group of BLOCK_C channels): reduce :func:`kv_stats`' partials over
    the sequence's own ``ceil(seqlen / BLOCK_S)`` blocks (``nblk`` slots per head) into
    KMEAN ``(B*Hkv, DQK)`` = sum / max(seqlen, 1) (when WANT_KSUM) and (when WANT_V) the V descale
    VS ``(B*Hkv, DV)`` = amax / 448 (1 for an all-zero channel).

    The K sum runs in a fixed order (ROWS slots accumulated elementwise per step, then one tree
    sum), so it is deterministic; no atomics.

    ``ALIGN_V`` (packed varlen; 0 otherwise): V8 is the aligned layout (:mod:`.varlen_v`), rows ``(Hkv, DV)`` of
    ``room`` tokens where sequence ``b`` starts at ``CU_V[b]``, the lengths before it each rounded up to ALIGN_V.
    Head 0's first channel group writes ``CU_V[b]`` (the last sequence's also ``CU_V[batch]``), and the last
    sequence's programs zero their rows' ``TAIL`` tokens after ``CU_V[batch]``: the most any 128-key box of the
    kernel reads past the last sequence (its rows' other entries are written by :func:`quantize_qkv`).

    ROTATE (1: every head, 2: the adaptive choice; the launch then has one program per head, BLOCK_C covering
    every channel): writes ``FLAGS[pid]`` (int8), 1 where the head's Q and K are to be rotated by the ±1 matrix
    ``ROT`` (``[BLOCK_R, BLOCK_R]``, zero-padded) times ``inv_sqrt_d``, and then writes the K mean in the
    rotated space (``mean @ ROT * inv_sqrt_d``: the mean of the rotated K) to KMEAN and the mean itself, which
    :func:`quantize_qkv` subtracts before it rotates, to ``KMEAN_INPUT`` ``(B*Hkv, DQK)``. ROTATE=2 rotates where
    Q and K concentrate their energy in the same channels (:func:`rotation_wanted`), from the K programs'
    per-block sums of squares ``KSQ`` (like KSUM) and the Q sample's ``QSQ`` rows (``group`` query heads of
    ``Q_SAMPLES`` rows per KV head, in order, from :func:`kv_stats`).
    """
    pid = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    _, seqlen = sequence_span(CU, pid // num_heads, seqlen_dense, VARLEN)
    nb = tl.cdiv(seqlen, BLOCK_S)
    rows = tl.arange(0, ROWS)
    ksum = tl.zeros([ROWS, BLOCK_C], tl.float32)
    ksq = tl.zeros([ROWS, BLOCK_C], tl.float32)
    vamax = tl.zeros([ROWS, BLOCK_C], tl.float32)
    for r0 in range(0, nb, ROWS):
        slot = (pid * nblk + r0 + rows)[:, None]
        valid = (r0 + rows < nb)[:, None]
        if WANT_KSUM:
            ksum += tl.load(KSUM + slot * DQK + offs_c[None, :], mask=valid & (offs_c[None, :] < DQK), other=0.0)
        if ROTATE == 2:
            ksq += tl.load(KSQ + slot * DQK + offs_c[None, :], mask=valid & (offs_c[None, :] < DQK), other=0.0)
        if WANT_V:
            vamax = tl.maximum(vamax, tl.load(VAMAX + slot * DV + offs_c[None, :],
                                              mask=valid & (offs_c[None, :] < DV), other=0.0))
    n_k = tl.maximum(seqlen, 1).to(tl.float32)
    mean = tl.sum(ksum, 0) / n_k
    if ROTATE:
        if ROTATE == 2:
            qsq = tl.zeros([ROWS, BLOCK_C], tl.float32)
            for r0 in range(0, group * Q_SAMPLES, ROWS):
                qrow = (pid * group * Q_SAMPLES + r0 + rows)[:, None]
                qsq += tl.load(QSQ + qrow * DQK + offs_c[None, :],
                               mask=(r0 + rows < group * Q_SAMPLES)[:, None] & (offs_c[None, :] < DQK), other=0.0)
            k_energy = tl.sum(ksq, 0) / n_k
            if WANT_KSUM:  # the quantized K is smoothed: its energy about the mean
                k_energy = k_energy - mean * mean
            flag = rotation_wanted(tl.sum(qsq, 0), tl.maximum(k_energy, 0.0), DQK, MIN_CONCENTRATION)
        else:
            flag = pid >= 0  # (a true scalar tensor)
        if tl.program_id(1) == 0:
            tl.store(FLAGS + pid, flag.to(tl.int8))
        if WANT_KSUM:
            tl.store(KMEAN_INPUT + pid * DQK + offs_c, mean, mask=offs_c < DQK)
            rot = tl.load(ROT + offs_c[:, None] * BLOCK_R + offs_c[None, :],
                          mask=(offs_c[:, None] < BLOCK_R) & (offs_c[None, :] < BLOCK_R), other=0.0)
            rotated = tl.sum(mean[:, None] * rot.to(tl.float32), 0) * inv_sqrt_d
            mean = tl.where(flag, rotated, mean)
    if WANT_KSUM:
        tl.store(KMEAN + pid * DQK + offs_c, mean, mask=offs_c < DQK)
    if WANT_V:
        amax = tl.max(vamax, 0)
        tl.store(VS + pid * DV + offs_c, tl.where(amax > 0.0, amax / E4M3_MAX_C, 1.0), mask=offs_c < DV)
    if ALIGN_V:
        b = pid // num_heads
        h = pid % num_heads
        first = (h == 0) & (tl.program_id(1) == 0)
        last = b == batch - 1
        if first | last:
            dest = tl.multiple_of(aligned_start(CU, b, ALIGN_V, PACKED_STEP), ALIGN_V)
            end = dest + tl.cdiv(seqlen, ALIGN_V) * ALIGN_V
            if first:
                tl.store(CU_V + b, dest)
                if last:
                    tl.store(CU_V + batch, end)
            if last:
                t = end + tl.arange(0, TAIL)
                row = V8 + h.to(tl.int64) * stride_v8h + offs_c.to(tl.int64)[:, None] * stride_v8d
                tl.store(row + t[None, :], tl.zeros([BLOCK_C, TAIL], tl.uint8),
                         mask=(offs_c[:, None] < DV) & (t[None, :] < room))


@triton.jit(do_not_specialize=["seqlen_q_dense", "seqlen_k_dense", "batch", "heads_q", "heads_kv", "nblk_q", "nblk_k"])
def quantize_qkv(
    Q, K, V, Q8, K8, V8, CU_Q, CU_K, CU_V, QS, KS, KMEAN, VS,
    seqlen_q_dense, seqlen_k_dense, batch, heads_q, heads_kv, nblk_q, nblk_k,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_q8b, stride_q8s, stride_q8h, stride_q8d,
    stride_k8b, stride_k8s, stride_k8h, stride_k8d,
    stride_v8b, stride_v8s, stride_v8h, stride_v8d,
    FLAGS, KMEAN_INPUT, ROT, inv_sqrt_d,
    DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr, V_PAD: tl.constexpr, VARLEN: tl.constexpr, SMOOTH_K: tl.constexpr,
    EXACT_ROUND: tl.constexpr, PACKED: tl.constexpr, ROTATE: tl.constexpr = 0,
):
    """Q, K and V in one launch, ``granularity="block"``. Programs ``(blk, pid)``: pid in
    ``[0, B*Hq)`` quantize Q (block scales to QS, contiguous ``(B, Hq, nblk_q)``), the next
    ``B*Hkv`` K (the finished mean KMEAN ``(B*Hkv, Dqk)`` is subtracted; block scales to KS),
    the last ``B*Hkv`` V (divided by the finished per-channel descale VS ``(B*Hkv, Dv)``; V8
    is the transposed storage's view). A grid without the V programs quantizes Q and K only (the mixed
    mode: V stays in 16 bits). With PACKED (varlen), programs ``(i, head)``: head ``[0, Hq)`` of Q,
    then ``Hkv`` of K and ``Hkv`` of V, each on the ``i``-th block of its batch (:func:`packed_block`), so no
    program is launched for a block past a short sequence's end (their scale entries are left as the
    caller made them: ones).

    V8's rows give each sequence a multiple of V_PAD tokens (dense: the padded rows; packed varlen: the aligned
    layout of :mod:`.varlen_v`, sequence ``b`` from token ``CU_V[b]``): a V block's store may run into that
    padding (zeros), which makes its predicate constant over V_PAD tokens, so the transposed store is
    vectorized (16-byte stores along tokens, not one byte per thread).

    ROTATE (1: every head, 2: per KV head): the Q and K blocks of KV head ``kv`` (Q: its query heads) are
    rotated before they are quantized where ``FLAGS[kv]`` (from :func:`finish_kv_stats`, which also gave KMEAN
    in the rotated space there) is nonzero; ROTATE=1 rotates all without reading FLAGS. K subtracts the mean in
    the inputs' space, ``KMEAN_INPUT``, before it rotates (:func:`quantize_tile`). ``ROT``: the
    ``[BLOCK_DQK, BLOCK_DQK]`` ±1 matrix in the inputs' dtype, ``inv_sqrt_d`` its scale (:func:`rotate_tile`).
    V is never rotated.
    """
    # (the Q, K and V branches name their values apart: Triton requires a name assigned in
    # both arms of an `if` to have one type, and the head dims differ)
    nq = batch * heads_q
    nk = batch * heads_kv
    if PACKED:  # programs (i, head of Q, K or V): the i-th block of the batch (packed_block)
        hh = tl.program_id(1)
        if hh < heads_q:
            b_blk, blk = packed_block(tl.program_id(0), CU_Q, batch, BLOCK_S, PACKED_STEP)
            pid = b_blk * heads_q + hh
        else:
            b_blk, blk = packed_block(tl.program_id(0), CU_K, batch, BLOCK_S, PACKED_STEP)
            hk = hh - heads_q
            pid = nq + b_blk * heads_kv + hk % heads_kv + (hk // heads_kv) * nk
        if b_blk >= batch:
            return
    else:
        blk = tl.program_id(0)
        pid = tl.program_id(1)
    s0 = blk * BLOCK_S
    if pid < nq:
        b, h, start, seqlen = _sequence_head(pid, CU_Q, seqlen_q_dense, heads_q, VARLEN)
        if s0 < seqlen:
            if ROTATE == 2:
                q_flag = tl.load(FLAGS + b * heads_kv + h // (heads_q // heads_kv)) != 0
            else:
                q_flag = ROTATE == 1
            quantize_tile(_head_base(Q, b, h, start + s0, stride_qb, stride_qs, stride_qh),
                          _head_base(Q8, b, h, start + s0, stride_q8b, stride_q8s, stride_q8h),
                          s0, seqlen, seqlen, stride_qs, stride_qd, stride_q8s, stride_q8d,
                          QS + (pid * nblk_q + blk), tl.zeros([BLOCK_DQK], tl.float32),
                          tl.full([BLOCK_DQK], 1.0, tl.float32), ROT, q_flag, inv_sqrt_d,
                          DQK, BLOCK_DQK, BLOCK_S, False, True, False, EXACT_ROUND, ROTATE != 0)
        elif blk < nblk_q:  # a block past a shorter sequence's end: descale 1, not what the allocator left
            tl.store(QS + (pid * nblk_q + blk), 1.0)
    else:
        kv = pid - nq if pid < nq + nk else pid - nq - nk
        b, h, start, seqlen = _sequence_head(kv, CU_K, seqlen_k_dense, heads_kv, VARLEN)
        if pid < nq + nk:  # K
            offs_dk = tl.arange(0, BLOCK_DQK)
            mean = tl.zeros([BLOCK_DQK], tl.float32)
            if SMOOTH_K:
                if ROTATE:  # subtracted before the rotation
                    mean = tl.load(KMEAN_INPUT + kv * DQK + offs_dk, mask=offs_dk < DQK, other=0.0)
                else:
                    mean = tl.load(KMEAN + kv * DQK + offs_dk, mask=offs_dk < DQK, other=0.0)
            if s0 < seqlen:
                if ROTATE == 2:
                    k_flag = tl.load(FLAGS + kv) != 0
                else:
                    k_flag = ROTATE == 1
                quantize_tile(_head_base(K, b, h, start + s0, stride_kb, stride_ks, stride_kh),
                              _head_base(K8, b, h, start + s0, stride_k8b, stride_k8s, stride_k8h),
                              s0, seqlen, seqlen, stride_ks, stride_kd, stride_k8s, stride_k8d,
                              KS + (kv * nblk_k + blk), mean, tl.full([BLOCK_DQK], 1.0, tl.float32),
                              ROT, k_flag, inv_sqrt_d,
                              DQK, BLOCK_DQK, BLOCK_S, SMOOTH_K, True, False, EXACT_ROUND, ROTATE != 0)
            elif blk < nblk_k:
                tl.store(KS + (kv * nblk_k + blk), 1.0)
        else:  # V
            offs_dv = tl.arange(0, BLOCK_DV)
            ch = tl.load(VS + kv * DV + offs_dv, mask=offs_dv < DV, other=1.0)
            store_len = tl.cdiv(seqlen, V_PAD) * V_PAD
            if VARLEN:  # sequence b's V8 rows start at CU_V[b] (finish_kv_stats), a multiple of V_PAD
                dest = tl.multiple_of(tl.load(CU_V + b), V_PAD)
            else:
                dest = start
            if s0 < seqlen:
                quantize_tile(_head_base(V, b, h, start + s0, stride_vb, stride_vs, stride_vh),
                              _head_base(V8, b, h, dest + s0, stride_v8b, stride_v8s, stride_v8h),
                              s0, seqlen, store_len, stride_vs, stride_vd, stride_v8s, stride_v8d,
                              VS, tl.zeros([BLOCK_DV], tl.float32), ch, ROT, False, inv_sqrt_d,
                              DV, BLOCK_DV, BLOCK_S, False, False, True, EXACT_ROUND, False)
