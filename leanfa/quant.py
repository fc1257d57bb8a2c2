"""FP8 (e4m3) quantization of Q, K, V built for attention accuracy.

* Q and K: one scale per block of 128 tokens of each head (``granularity="block"``), per head
  (``"head"``) or per tensor (``"tensor"``); ``descale = amax / 448``.
* K smoothing (``smooth_k=True``): the per-channel mean of K over each sequence is subtracted
  before quantizing. Every score of a query row shifts by the same ``q·mean``, so softmax is
  unchanged; the outliers that live in the mean stop eating the e4m3 range. The mean is kept
  (``FP8QKV.k_mean``) so the kernels can still return the exact LSE.
* V: one scale per channel of each head (``"block"``/``"head"``) or per tensor, and V is
  written *transposed* (``(B, Hkv, Dv, S)`` storage, returned as a ``(B, S, Hkv, Dv)`` view with
  ``stride(1) == 1``) — the K-major operand FP8 matrix instructions need for P·V. A packed
  batch's V is written in the layout the Hopper kernel's TMA loads read (every sequence from a
  multiple of 16 tokens, ``FP8QKV.cu_seqlens_v``), so a varlen FP8 call copies nothing.
* Conversion saturates: values beyond ±448 clamp, never become NaN.
* ``quantize_v=False`` (the mixed mode, ``attention(precision="fp8qk")``): Q and K exactly as above, V
  left as given (16-bit, token-major, no descale): the kernels then compute P·V in 16 bits.
* Rotation (``rotate=True``, opt-in, off by default): Q and K are multiplied by the same
  random-sign Hadamard matrix ``R`` (``D x D``, orthogonal) on the head dim before quantizing,
  so ``(QR)(KR)ᵀ = QKᵀ`` and the kernels need no change. It helps only where Q *and* K
  concentrate a score on the same few channels; on the model presets the dominant FP8 error
  is the attention sink's score (a key ~4x the typical norm met by *dense* query noise), which
  a rotation cannot shrink, and the measured effect is 0.85-1.73x (docs/accuracy-notes.md),
  so it is not the default. ``q``/``k`` and ``k_mean`` of the result live in the rotated space
  (``FP8QKV.rotation`` is ``R``): ``k_mean`` is the mean of ``KR`` (= ``mean(K) R``), so the
  LSE correction ``softmax_scale * (dequantized q)·k_mean`` stays exact. With the fused quantizer
  and a head dim that has a Hadamard matrix and a tile of at most 128 channels the rotation runs
  inside its quantize programs (a ``[128, D] x [D, D]`` product per block); otherwise as a separate
  float32 matmul pass.
* ``rotate="auto"`` (fused quantizer only; elsewhere nothing is rotated): the statistics pass also
  takes K's channel sums of squares and reads a sample of Q (4 blocks per query head); the reduction
  rotates a KV head (per sequence) where Q's and the quantized K's channel energies ``a``, ``b`` give
  ``D * sum(a b) >= 2 * sum(a) * sum(b)`` (:func:`leanfa.kernels.quantize.rotation_wanted`), on the device,
  and ``FP8QKV.rotated`` (bool ``(B, Hkv)``) says where; ``k_mean`` is in the rotated space on those
  heads only.

All passes are Triton kernels (:mod:`leanfa.kernels.quantize`): a per-channel statistics pass
(K mean, V amax) and a quantize pass per 128-token block that also computes the block's scale
when ``granularity="block"``. For that default granularity (head dims up to FUSED_MAX_DIM)
Q, K and V share three launches: per-block K/V statistics, their reduction to the K mean and
V scales (once per head, in a fixed order: deterministic), and one quantize pass over all
three. Per-head and per-tensor scales need global maxima in between and use one launch per
tensor and pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .checks import check_cu_seqlens, check_device, check_fp8_device
from .hadamard import random_hadamard, random_hadamard_pm1
from .kernels.fp8 import E4M3_MAX
from .kernels.launcher import DirectLaunch
from .kernels.quantize import (FINISH_CHANNELS, FINISH_ROWS, FUSED_MAX_DIM, FUSED_ROTATE_MAX_DIM, FUSED_WARPS,
                               Q_SAMPLES, ROTATE_FINISH_ROWS, ROTATE_MIN_CONCENTRATION, STATS_WARPS, channel_stats,
                               finish_kv_stats, kv_stats, quantize_blocks, quantize_qkv)
from .kernels.sequences import block_slots
from .kernels.varlen_v import ALIGNED_V_TAIL, align_varlen_v, repacked_tokens
from .problem import FP8_DTYPE, V_TOKEN_ALIGN
from .scales import SCALE_BLOCK, broadcast_strides, num_scale_blocks

GRANULARITIES = ("block", "head", "tensor")


@dataclass(frozen=True)
class FP8QKV:
    """Quantized Q/K/V and their float32 descales; pass it straight to ``flash_attn_func``.

    ``q``/``k``: ``(B, S, H, D)`` (or packed ``(total, H, D)``) float8_e4m3fn. ``v``: dense, the same
    logical shape, stored transposed. Packed: ``(room, Hkv, Dv)``, stored transposed (tokens innermost), in
    the layout the Hopper kernel's TMA loads read: sequence ``b`` from token ``cu_seqlens_v[b]`` (a multiple of
    16), zeros up to the next multiple of 16 and after the last sequence (``packed_v()`` gives the
    ``(total, Hkv, Dv)`` tensor without the gaps); or, from ``quantize_fp8(..., quantize_v=False)``, the
    caller's 16-bit V itself (then ``v_descale`` and ``cu_seqlens_v`` are None). Descales: per-block ``(B, H, ceil(S/128))``, per-head
    ``(B, H)`` or a 0-d tensor (in a packed batch, the blocks past a shorter sequence's end hold 1);
    ``v_descale`` ``(B, Hkv, Dv)`` or 0-d. ``k_mean``:
    ``(B, Hkv, Dqk)`` float32 mean subtracted from K (in the rotated space when ``rotation``
    is set), or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor | None
    k_mean: torch.Tensor | None
    granularity: str
    #: ``(D, D)`` float32 orthogonal matrix applied to Q and K (and so to ``k_mean``) before
    #: quantizing, or None. Scores are unchanged; dequantized ``q``/``k`` are ``Q R``/``K R``.
    rotation: torch.Tensor | None = None
    #: packed batches: int32 ``(B + 1)``, where each sequence starts in ``v`` (multiples of 16); dense: None
    cu_seqlens_v: torch.Tensor | None = None
    #: with ``rotation``: bool ``(B, Hkv)`` on the device, True where KV head ``h`` of sequence ``b`` (its K, its
    #: query heads' Q, and its ``k_mean``) is in the rotated space; ``rotate="auto"`` chooses it per head. None
    #: without a rotation.
    rotated: torch.Tensor | None = None

    def descales(self) -> dict:
        """Keyword arguments for ``flash_attn_func(q, k, v, **quantized.descales())`` (packed:
        ``flash_attn_varlen_func``, which also takes ``cu_seqlens_v``)."""
        kw = dict(q_descale=self.q_descale, k_descale=self.k_descale, v_descale=self.v_descale, k_mean=self.k_mean)
        if self.cu_seqlens_v is not None:
            kw["cu_seqlens_v"] = self.cu_seqlens_v
        return kw

    def packed_v(self, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
        """The quantized V as ``(total, Hkv, Dv)`` token-major, without the aligned layout's gaps (a copy; dense:
        ``v`` itself). ``cu_seqlens_k``: the batch's key offsets, as given to :func:`quantize_fp8`."""
        if self.cu_seqlens_v is None:
            return self.v
        return unaligned_v(self.v, cu_seqlens_k, self.cu_seqlens_v, self.k.shape[0])


def _strides(t: torch.Tensor, varlen: bool):
    return (0, *t.stride()) if varlen else t.stride()


class _Seqs:
    """Batch/sequence geometry of one tensor (dense or packed varlen)."""

    def __init__(self, x: torch.Tensor, cu: torch.Tensor | None, max_seqlen: int | None):
        self.varlen = cu is not None
        self.cu = cu
        if self.varlen:
            self.batch = cu.numel() - 1
            self.max_seqlen = int(max_seqlen)
            self.seqlen_dense = 0
        else:
            self.batch = x.shape[0]
            self.max_seqlen = self.seqlen_dense = x.shape[1]
        self.heads, self.dim = x.shape[-2], x.shape[-1]

    def cu_arg(self, fallback: torch.Tensor) -> torch.Tensor:
        return self.cu if self.varlen else fallback


#: tokens per program of the channel-statistics pass
STATS_CHUNK = 512


def _stats_chunks(max_seqlen: int) -> int:
    """Programs per head of a statistics pass (one per STATS_CHUNK tokens, at least one)."""
    return max(1, -(-max_seqlen // STATS_CHUNK))


def _stats_rows(head_dim: int) -> int:
    """Tokens per loop step of a statistics pass (BLOCK_S): fewer for wide heads."""
    return 64 if head_dim <= 128 else 32


def _channel_stats_launch(x, seqs: _Seqs, want_sum: bool, want_amax: bool):
    """Per-channel mean (over each sequence) and/or max |x|, as (B, H, D) float32."""
    n = seqs.batch * seqs.heads
    nchunks = _stats_chunks(seqs.max_seqlen)
    part_sum = torch.zeros((seqs.batch, seqs.heads, nchunks, seqs.dim), dtype=torch.float32, device=x.device)
    part_amax = torch.zeros_like(part_sum) if want_amax else part_sum
    if n:
        channel_stats[(nchunks, n)](
            x, seqs.cu_arg(part_sum), part_sum, part_amax, seqs.seqlen_dense, seqs.heads,
            *_strides(x, seqs.varlen), HEAD_DIM=seqs.dim, BLOCK_D=triton.next_power_of_2(seqs.dim),
            BLOCK_S=_stats_rows(seqs.dim), CHUNK=STATS_CHUNK,
            VARLEN=seqs.varlen, WANT_SUM=want_sum, WANT_AMAX=want_amax)
    mean = amax = None
    if want_sum:
        if seqs.varlen:  # lengths as a device tensor: no host sync
            lengths = (seqs.cu[1:] - seqs.cu[:-1]).clamp(min=1).to(torch.float32)
        else:
            lengths = torch.full((seqs.batch,), float(max(seqs.seqlen_dense, 1)), device=x.device)
        mean = part_sum.sum(dim=2) / lengths[:, None, None]
    if want_amax:
        amax = part_amax.amax(dim=2)
    return mean, amax


def _quantize_launch(x, y, seqs: _Seqs, *, mean=None, scale=None, compute_scale=False, ch_scale=None):
    n = seqs.batch * seqs.heads
    if n == 0:
        return
    nblk = num_scale_blocks(seqs.max_seqlen)
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    s_strides = broadcast_strides(scale) if scale is not None else (0, 0, 0)
    quantize_blocks[(nblk, n)](
        x, y, seqs.cu_arg(dummy), mean if mean is not None else dummy,
        scale if scale is not None else dummy, ch_scale if ch_scale is not None else dummy,
        seqs.seqlen_dense, seqs.heads, *_strides(x, seqs.varlen), *_strides(y, seqs.varlen), *s_strides,
        HEAD_DIM=seqs.dim, BLOCK_D=triton.next_power_of_2(seqs.dim), BLOCK_S=SCALE_BLOCK,
        VARLEN=seqs.varlen, SUBTRACT_MEAN=mean is not None, COMPUTE_SCALE=compute_scale,
        CHANNEL_SCALE=ch_scale is not None, EXACT_ROUND=x.device.type == "cpu",
        num_warps=8 if seqs.dim > 128 else 4)


def _quantize_qk(x: torch.Tensor, seqs: _Seqs, granularity: str, mean):
    y = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    nblk = num_scale_blocks(seqs.max_seqlen)
    table = torch.empty((seqs.batch, seqs.heads, nblk), dtype=torch.float32, device=x.device)
    if granularity == "block":
        if seqs.varlen:  # blocks past a shorter sequence's end: descale 1 (the fused path's value), not garbage
            table.fill_(1.0)
        _quantize_launch(x, y, seqs, mean=mean, scale=table, compute_scale=True)
        return y, table
    # head / tensor: block amax first (descales written to `table`), then reduce and apply
    scratch = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    table.fill_(0.0)  # blocks past a short sequence's end stay 0 and do not affect the max
    _quantize_launch(x, scratch, seqs, mean=mean, scale=table, compute_scale=True)
    if granularity == "head":
        descale = table.amax(dim=2)  # (B, H)
        apply = descale.unsqueeze(-1)
    else:
        descale = table.amax()
        apply = descale.reshape(1, 1, 1).expand(seqs.batch, seqs.heads, 1)
    descale = torch.where(descale > 0, descale, torch.ones_like(descale))
    apply = torch.where(apply > 0, apply, torch.ones_like(apply))
    _quantize_launch(x, y, seqs, mean=mean, scale=apply)
    return y, descale


def _transposed_fp8_like(v: torch.Tensor, seqs: _Seqs) -> torch.Tensor:
    """An e4m3 tensor shaped like ``v`` whose storage is transposed, token axis padded to
    V_TOKEN_ALIGN: ``(B, Hkv, Dv, S)`` viewed as ``(B, S, Hkv, Dv)`` (varlen: ``(Hkv, Dv, total)``)."""
    tokens = v.shape[0] if seqs.varlen else v.shape[1]
    padded = -(-max(tokens, 1) // V_TOKEN_ALIGN) * V_TOKEN_ALIGN
    if seqs.varlen:
        store = torch.empty((seqs.heads, v.shape[-1], padded), dtype=FP8_DTYPE, device=v.device)
        return store.permute(2, 0, 1)[:tokens]
    store = torch.empty((seqs.batch, seqs.heads, v.shape[-1], padded), dtype=FP8_DTYPE, device=v.device)
    return store.permute(0, 3, 1, 2)[:, :tokens]


def _aligned_fp8_like(v: torch.Tensor, seqs: _Seqs) -> tuple[torch.Tensor, torch.Tensor]:
    """For a packed ``v`` (total, Hkv, Dv): an e4m3 ``(room, Hkv, Dv)`` view of ``(Hkv, Dv, room)`` storage, the
    aligned layout (:mod:`.kernels.varlen_v`), and the int32 ``cu_seqlens_v`` it will hold; the fused quantizer
    fills both (an empty batch: the starts are zeros here)."""
    room = repacked_tokens(v.shape[0], seqs.batch)
    store = torch.empty((seqs.heads, v.shape[-1], room), dtype=FP8_DTYPE, device=v.device)
    make = torch.empty if seqs.batch else torch.zeros
    return store.permute(2, 0, 1), make(seqs.batch + 1, dtype=torch.int32, device=v.device)


def unaligned_v(v: torch.Tensor, cu_seqlens_k: torch.Tensor, cu_seqlens_v: torch.Tensor, total: int) -> torch.Tensor:
    """A packed V in the aligned layout (sequence ``b`` from token ``cu_seqlens_v[b]``) as ``(total, H, Dv)``
    without the gaps, token-major (``total``: the batch's key tokens): one gather on the device, no host sync."""
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    shift = (cu_seqlens_v[:-1] - cu_seqlens_k[:-1]).to(torch.int64)
    pos = torch.arange(total, device=v.device) + torch.repeat_interleave(shift, lengths, output_size=total)
    return v.view(torch.uint8)[pos].view(v.dtype)


def _quantize_v(v: torch.Tensor, seqs: _Seqs, granularity: str):
    """V with per-channel (or per-tensor) scales, written transposed."""
    _, amax = _channel_stats_launch(v, seqs, want_sum=False, want_amax=True)
    if granularity == "tensor":
        descale = amax.amax() / E4M3_MAX
        descale = torch.where(descale > 0, descale, torch.ones_like(descale))
        ch = descale.reshape(1, 1, 1).expand_as(amax).contiguous()
    else:
        descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        ch = descale
    y = _transposed_fp8_like(v, seqs)
    _quantize_launch(v, y, seqs, ch_scale=ch)
    if not seqs.varlen:
        return y, descale, None
    y, cu_v = align_varlen_v(y, seqs.cu, seqs.max_seqlen)  # (this path is not fused: one more pass)
    return y, descale, cu_v


def packed_grid(longest_blocks: int, batch: int, slots: int) -> bool:
    """Whether the fused quantizer runs a packed batch one program per block slot (``sequences.packed_block``)
    rather than one per (sequence, block of the longest sequence): when more than half of the latter would
    have no block. A packed program first sums the block counts of the sequences before it: on one 12K
    prompt among 40 short ones the packed grid took the FP8 end-to-end call from 2.18 to 1.97 ms, on 64
    sequences of 300 tokens it made quantize_qkv 131 -> 160 us (H200 run 83, docs/perf-notes.md)."""
    return longest_blocks * batch > 2 * slots


#: the fused quantizer's three launches, directly on their compiled kernels on repeat calls (kernels/launcher.py)
_DIRECT_KV_STATS = DirectLaunch(kv_stats)
_DIRECT_FINISH_KV_STATS = DirectLaunch(finish_kv_stats)
_DIRECT_QUANTIZE_QKV = DirectLaunch(quantize_qkv)


def _quantize_block_fused(q, k, v, sq: _Seqs, sk: _Seqs, smooth_k: bool, quantize_v: bool = True,
                          rotate_mode: int = 0):
    """``granularity="block"`` in three launches: per-block K/V statistics, their reduction to
    the K mean and V descales, then Q, K, V together. Without ``quantize_v`` (V stays 16-bit: ``v8`` and
    ``v_descale`` are None) the statistics pass reads K alone (and is skipped without ``smooth_k``) and the
    quantize pass launches no V programs.

    ``rotate_mode`` (the fused rotation, :func:`fused_rotation_available`): 1 rotates Q and K of every head,
    2 (``rotate="auto"``) of the KV heads :func:`leanfa.kernels.quantize.rotation_wanted` picks from the K
    statistics (now with sums of squares) and a sample of Q that the statistics pass also reads; the reduction
    then runs one program per KV head and writes the per-head flags (returned last, int8 ``(B, Hkv)``; None
    when 0) and the K mean in the rotated space where a head is rotated."""
    dev = q.device
    n_kv = sk.batch * sk.heads
    dqk, dv = q.shape[-1], v.shape[-1]
    f32 = dict(dtype=torch.float32, device=dev)
    nblk_q, nblk_k = num_scale_blocks(sq.max_seqlen), num_scale_blocks(sk.max_seqlen)
    # per-block partials; kv_stats writes only the blocks inside each sequence, the only ones
    # finish_kv_stats reads
    ksum = torch.empty((n_kv, nblk_k, dqk) if smooth_k else (1,), **f32)
    vamax = torch.empty((n_kv, nblk_k, dv) if quantize_v else (1,), **f32)
    q8 = torch.empty(q.shape, dtype=FP8_DTYPE, device=dev)
    k8 = torch.empty(k.shape, dtype=FP8_DTYPE, device=dev)
    if not quantize_v:
        v8, cu_v = k8, None  # (k8: an unused stand-in for the launches)
    elif sk.varlen:
        v8, cu_v = _aligned_fp8_like(v, sk)
    else:
        v8, cu_v = _transposed_fp8_like(v, sk), None
    slots_q, slots_k = (block_slots(t.shape[0], s.batch, SCALE_BLOCK) if s.varlen else 0
                        for t, s in ((q, sq), (k, sk)))
    packed = sq.varlen and packed_grid(max(nblk_q, nblk_k), sq.batch, max(slots_q, slots_k))
    # the packed grid launches no program for the blocks past a short sequence's end: their entries stay 1 (the
    # other grid's programs write them)
    scales = torch.ones if packed else torch.empty
    q_descale = scales((sq.batch, sq.heads, nblk_q), **f32)
    k_descale = scales((sk.batch, sk.heads, nblk_k), **f32)
    k_mean = torch.empty((sk.batch, sk.heads, dqk), **f32) if smooth_k else None
    # a rotated K has its mean subtracted before the rotation: the mean in the inputs' space (k_mean is the rotated)
    k_mean_input = torch.empty((n_kv, dqk), **f32) if smooth_k and rotate_mode else None
    v_descale = torch.empty((sk.batch, sk.heads, dv) if quantize_v else (1,), **f32)
    bd_qk, bd_v = triton.next_power_of_2(dqk), triton.next_power_of_2(dv)
    cu_k = sk.cu_arg(vamax)
    adaptive = rotate_mode == 2
    flags = torch.empty((sk.batch, sk.heads), dtype=torch.int8, device=dev) if rotate_mode else None
    ksq = torch.empty((n_kv, nblk_k, dqk), **f32) if adaptive else vamax
    qsq = torch.empty((sq.batch * sq.heads * Q_SAMPLES, dqk), **f32) if adaptive else vamax
    rot = _kernel_rotation(dqk, dev, q.dtype) if rotate_mode else vamax
    inv_sqrt_d = _inv_sqrt(dqk)
    if n_kv and (smooth_k or quantize_v or adaptive):
        if packed:
            grid = (max(slots_k, sk.batch * Q_SAMPLES) if adaptive else slots_k,
                    sk.heads + (sq.heads if adaptive else 0))
        else:
            grid = (max(nblk_k, Q_SAMPLES) if adaptive else nblk_k, n_kv + (sq.batch * sq.heads if adaptive else 0))
        _DIRECT_KV_STATS[grid](
            k, v, cu_k, ksum, vamax, sk.seqlen_dense, sk.heads, sk.batch, nblk_k,
            *_strides(k, sk.varlen), *_strides(v, sk.varlen),
            q, sq.cu_arg(vamax), qsq, ksq, sq.seqlen_dense, sq.heads, *_strides(q, sq.varlen),
            DQK=dqk, BLOCK_DQK=bd_qk, DV=dv, BLOCK_DV=bd_v, BLOCK_S=SCALE_BLOCK, VARLEN=sk.varlen,
            WANT_KSUM=smooth_k, PACKED=packed, WANT_V=quantize_v, ADAPTIVE=adaptive, Q_SAMPLES=Q_SAMPLES,
            num_warps=STATS_WARPS)
    if n_kv and (smooth_k or quantize_v or rotate_mode):
        v8_bytes = v8.view(torch.uint8)
        if rotate_mode:  # one program per head over every channel (the rotated mean needs them all)
            finish_grid, block_c, rows = (n_kv, 1), max(bd_qk, bd_v), ROTATE_FINISH_ROWS
        else:
            finish_grid, block_c, rows = (n_kv, triton.cdiv(max(dqk, dv), FINISH_CHANNELS)), FINISH_CHANNELS, FINISH_ROWS
        _DIRECT_FINISH_KV_STATS[finish_grid](
            ksum, vamax, cu_k, k_mean if k_mean is not None else v_descale, v_descale,
            cu_v if cu_v is not None else cu_k, v8_bytes, sk.seqlen_dense, sk.heads, nblk_k, sk.batch,
            v8.shape[0], v8_bytes.stride(1), v8_bytes.stride(2),
            ksq, qsq, flags if flags is not None else v8_bytes,
            k_mean_input if k_mean_input is not None else v_descale, rot, sq.heads // sk.heads, inv_sqrt_d,
            DQK=dqk, DV=dv, BLOCK_C=block_c, ROWS=rows, BLOCK_S=SCALE_BLOCK, VARLEN=sk.varlen,
            WANT_KSUM=smooth_k, WANT_V=quantize_v, ALIGN_V=V_TOKEN_ALIGN if cu_v is not None else 0,
            TAIL=ALIGNED_V_TAIL, ROTATE=rotate_mode, Q_SAMPLES=Q_SAMPLES, BLOCK_R=bd_qk,
            MIN_CONCENTRATION=ROTATE_MIN_CONCENTRATION, num_warps=8 if rotate_mode else 4)
    tensors = 2 if quantize_v else 1  # K and V, or K alone: the V programs come last
    programs = sq.batch * sq.heads + tensors * n_kv
    if programs:
        _DIRECT_QUANTIZE_QKV[(max(slots_q, slots_k), sq.heads + tensors * sk.heads) if packed
                             else (max(nblk_q, nblk_k), programs)](
            q, k, v, q8, k8, v8, sq.cu_arg(vamax), cu_k, cu_v if cu_v is not None else cu_k, q_descale, k_descale,
            k_mean if k_mean is not None else v_descale, v_descale,
            sq.seqlen_dense, sk.seqlen_dense, sq.batch, sq.heads, sk.heads, nblk_q, nblk_k,
            *_strides(q, sq.varlen), *_strides(k, sk.varlen), *_strides(v, sk.varlen),
            *_strides(q8, sq.varlen), *_strides(k8, sk.varlen), *_strides(v8, sk.varlen),
            flags if flags is not None else vamax, k_mean_input if k_mean_input is not None else vamax, rot,
            inv_sqrt_d,
            DQK=dqk, BLOCK_DQK=bd_qk, DV=dv, BLOCK_DV=bd_v, BLOCK_S=SCALE_BLOCK, V_PAD=V_TOKEN_ALIGN,
            VARLEN=sq.varlen, SMOOTH_K=smooth_k, EXACT_ROUND=dev.type == "cpu", PACKED=packed, ROTATE=rotate_mode,
            num_warps=FUSED_WARPS)
    if not quantize_v:
        return q8, q_descale, k8, k_descale, k_mean, None, None, None, flags
    return q8, q_descale, k8, k_descale, k_mean, v8, v_descale, cu_v, flags


def _check(q, k, v, granularity, cu_q, cu_k, max_q, max_k, quantize_v=True):
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if isinstance(q, torch.Tensor):
        check_device(q)
        check_fp8_device(q.device)  # the quantizer writes float8_e4m3fn
    varlen = cu_q is not None or cu_k is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"quantize_fp8 takes bf16/fp16/fp32 {name}, got {t.dtype}")
        if t.dim() != (3 if varlen else 4):
            raise ValueError(f"{name} must have rank {3 if varlen else 4}, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not quantize_v and v.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_fp8(quantize_v=False) leaves V as the kernels read it: a bf16/fp16 v, got "
                        f"{v.dtype}")
    if varlen:
        if cu_q is None or cu_k is None or max_q is None or max_k is None:
            raise ValueError("varlen quantization needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and max_seqlen_k")
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
                raise TypeError(f"{name} must be a 1-D int32 tensor")
        if cu_q.numel() != cu_k.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
        # the same checks as the attention call (values on CPU tensors only): a max_seqlen below
        # the longest sequence would leave blocks unquantized (uninitialized FP8), a wrong total
        # would read out of bounds
        check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], "max_seqlen_q", max_q, q.device)
        check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], "max_seqlen_k", max_k, q.device)
    if k.shape[-2] != v.shape[-2] or k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"k and v must agree on tokens and heads, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")


_ROTATIONS: dict = {}


def rotation_matrix(dim: int, device, seed: int = 0) -> torch.Tensor:
    """The ``(dim, dim)`` float32 orthogonal matrix ``rotate=True`` uses: ``diag(±1) H / sqrt(dim)``
    with ``H`` a Hadamard matrix (orders ``2^k`` and ``12·2^k``, e.g. 64/128/256/192), else a
    seeded random orthogonal matrix. Deterministic in (dim, seed); cached per device."""
    key = (dim, str(device), seed)
    r = _ROTATIONS.get(key)
    if r is None:
        try:
            r = random_hadamard(dim, seed)
        except ValueError:
            g = torch.Generator().manual_seed(seed)
            r, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
        r = r.to(torch.float32).to(device)
        _ROTATIONS[key] = r
    return r


_KERNEL_ROTATIONS: dict = {}


def fused_rotation_available(dim: int) -> bool:
    """Whether the fused quantizer can rotate head dim ``dim`` itself (``quantize_fp8(rotate=True/"auto")``):
    a Hadamard matrix of that order (2^k, 12 * 2^k) and a tile of at most FUSED_ROTATE_MAX_DIM channels."""
    if triton.next_power_of_2(dim) > FUSED_ROTATE_MAX_DIM or dim < 16:
        return False
    return dim & (dim - 1) == 0 or (dim % 12 == 0 and (dim // 12) & (dim // 12 - 1) == 0)


def _kernel_rotation(dim: int, device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`rotation_matrix` times sqrt(dim) (entries exactly ±1) in ``dtype``, zero-padded to the kernel's
    ``[next_pow2(dim)]^2`` tile; cached per (dim, device, dtype)."""
    key = (dim, str(device), dtype)
    r = _KERNEL_ROTATIONS.get(key)
    if r is None:
        pad = triton.next_power_of_2(dim)
        r = torch.zeros((pad, pad), dtype=torch.float64)
        r[:dim, :dim] = random_hadamard_pm1(dim, 0)
        r = r.to(dtype).to(device).contiguous()
        _KERNEL_ROTATIONS[key] = r
    return r


def _inv_sqrt(dim: int) -> float:
    """float32(1 / sqrt(dim)) as a Python float: the magnitude of :func:`rotation_matrix`'s entries."""
    return float(torch.tensor(dim ** -0.5, dtype=torch.float64).to(torch.float32))


#: ``quantize_fp8``'s ``rotate`` values: never, always, per KV head from the statistics
ROTATE_CHOICES = (False, True, "auto")


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x @ r`` over the head dim in float32 (the quantize passes accept float32 input)."""
    return torch.matmul(x.to(torch.float32), r)


def quantize_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    granularity: str = "block",
    smooth_k: bool = True,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    rotate: bool | str = False,
    quantize_v: bool = True,
) -> FP8QKV:
    """Quantize BF16/FP16/FP32 Q, K, V to float8_e4m3fn for :func:`leanfa.flash_attn_func`.

    Dense inputs are ``(B, S, H, D)``; packed varlen inputs ``(total, H, D)`` with
    ``cu_seqlens_*``/``max_seqlen_*`` (scales and means are then per sequence).
    ``rotate``: ``True`` rotates Q and K's head dim by :func:`rotation_matrix` first (scores unchanged;
    see the module docstring for when it helps); ``"auto"`` rotates the KV heads (per sequence) whose Q and K
    concentrate their energy in the same few channels, chosen on the device (``FP8QKV.rotated`` says which);
    ``False`` (default) never.
    ``quantize_v=False``: Q and K only; the result's ``v`` is the given bf16/fp16 ``v`` (no copy, no
    descale), for the mixed mode (FP8 Q·K, 16-bit P·V; ``attention(precision="fp8qk")``).
    """
    _check(q, k, v, granularity, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, quantize_v)
    return quantize_checked(q, k, v, granularity, smooth_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            rotate, quantize_v)


def quantize_checked(q, k, v, granularity, smooth_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     rotate=False, quantize_v=True) -> FP8QKV:
    """:func:`quantize_fp8` on arguments its checks already passed (``leanfa.attention`` checks
    once, then quantizes through :mod:`leanfa.ops`: a second check costs ~3% of the end-to-end
    call's host time under cProfile; docs/perf-notes.md, "host time of the FP8 end-to-end call")."""
    if rotate not in ROTATE_CHOICES:  # (1 == True and 0 == False are accepted)
        raise ValueError(f"rotate must be one of {ROTATE_CHOICES}, got {rotate!r}")
    rotation = rotated = None
    fused = granularity == "block" and max(q.shape[-1], v.shape[-1]) <= FUSED_MAX_DIM
    rotate_mode = 0
    if rotate and q.shape[-1] > 1:
        rotation = rotation_matrix(q.shape[-1], q.device)
        if fused and fused_rotation_available(q.shape[-1]) and q.dtype == k.dtype:
            rotate_mode = 2 if rotate == "auto" else 1
        elif rotate == "auto":  # the adaptive choice runs in the fused quantizer only: no rotation
            rotation = None
        else:  # a separate float32 matmul pass
            q, k = _rotate(q, rotation), _rotate(k, rotation)
            rotated = torch.ones((q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1, k.shape[-2]),
                                 dtype=torch.bool, device=q.device)
    sq = _Seqs(q, cu_seqlens_q, max_seqlen_q)
    sk = _Seqs(k, cu_seqlens_k, max_seqlen_k)
    sv = _Seqs(v, cu_seqlens_k, max_seqlen_k)
    if fused:
        q8, q_descale, k8, k_descale, k_mean, v8, v_descale, cu_v, flags = _quantize_block_fused(
            q, k, v, sq, sk, smooth_k, quantize_v, rotate_mode)
        if flags is not None:
            rotated = flags.view(torch.bool)
    else:
        k_mean = _channel_stats_launch(k, sk, want_sum=True, want_amax=False)[0] if smooth_k else None
        q8, q_descale = _quantize_qk(q, sq, granularity, None)
        k8, k_descale = _quantize_qk(k, sk, granularity, k_mean)
        v8, v_descale, cu_v = _quantize_v(v, sv, granularity) if quantize_v else (None, None, None)
    if not quantize_v:
        v8 = v
    return FP8QKV(q=q8, k=k8, v=v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                  k_mean=k_mean, granularity=granularity, rotation=rotation, cu_seqlens_v=cu_v, rotated=rotated)
