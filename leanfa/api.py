"""Public entry points: argument checks, layouts and dispatch to a kernel backend.

Everything a user can get wrong is checked here (the checks the quantizer shares live in
:mod:`leanfa.checks`), before any kernel launch, and raises a
``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, device, value) that names
the argument. Checks look only at shapes, dtypes and devices, never at tensor values, so a
call never synchronizes the GPU and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch

from . import scales
from .checks import check_cu_seqlens as _check_cu_seqlens
from .checks import check_page_ids as _check_page_ids
from .checks import check_page_table as _check_page_table
from .checks import check_device, check_fp8_device, interpreter_enabled  # noqa: F401 (re-exported)
from .checks import check_attention_chunk as _check_attention_chunk
from .checks import check_qv as _check_qv
from .checks import check_seqused as _check_seqused
from .checks import check_window_softcap as _check_window_softcap
from .checks import resolve_softmax_scale as _resolve_scale
from .kernels.varlen_v import repacked_tokens
from .problem import FP8_DTYPE, Problem  # Problem's home is leanfa.problem; leanfa.api.Problem stays importable
from .quant import FP8QKV, quantize_fp8

HALF_DTYPES = (torch.bfloat16, torch.float16)
INPUT_DTYPES = HALF_DTYPES + (FP8_DTYPE,)
#: (head_dim_qk, head_dim_v) pairs the kernels support
#: head dims (Dqk, Dv) the Hopper kernel runs (also :data:`leanfa.kernels.hopper.HEAD_DIMS`); any other pair that
#: :func:`head_dims_problem` accepts runs on the portable kernel
HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
#: every head dim is a multiple of this, up to :data:`MAX_HEAD_DIM` (FlashAttention-3's rule: 16-byte rows in 16 bits)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
#: FlashAttention-3's MLA form: a V head dim up to this with a Q/K head dim up to :data:`MLA_MAX_HEAD_DIM_QK`
#: (64/512, DeepSeek's absorbed attention with ``qv``; the portable kernel)
MLA_MAX_HEAD_DIM_V = 512
MLA_MAX_HEAD_DIM_QK = 64


def head_dims_problem(dqk: int, dv: int) -> str | None:
    """Why leanfa cannot attend with head dims ``dqk`` (Q/K) and ``dv`` (V), or None."""
    if all(d % HEAD_DIM_MULTIPLE == 0 and 0 < d <= MAX_HEAD_DIM for d in (dqk, dv)):
        return None
    if fa3_mla_head_dims(dqk, dv):
        return None
    return (f"head dims (q/k {dqk}, v {dv}) are not supported: each must be a multiple of {HEAD_DIM_MULTIPLE} "
            f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}, or q/k up to {MLA_MAX_HEAD_DIM_QK} with v up to "
            f"{MLA_MAX_HEAD_DIM_V} (FlashAttention-3's MLA form) (the Hopper kernel runs "
            + ", ".join(f"{a}/{b}" for a, b in HEAD_DIMS) + "; others run on the portable kernel)")


def fa3_mla_head_dims(dqk: int, dv: int) -> bool:
    """FlashAttention-3's MLA head dims: Q/K up to :data:`MLA_MAX_HEAD_DIM_QK` with a V head dim above
    :data:`MAX_HEAD_DIM` up to :data:`MLA_MAX_HEAD_DIM_V` (64/512), multiples of :data:`HEAD_DIM_MULTIPLE`; the
    portable kernel runs them."""
    return (0 < dqk <= MLA_MAX_HEAD_DIM_QK and MAX_HEAD_DIM < dv <= MLA_MAX_HEAD_DIM_V
            and dqk % HEAD_DIM_MULTIPLE == 0 and dv % HEAD_DIM_MULTIPLE == 0)


BACKENDS = ("auto", "portable", "hopper")


def _check_inputs(q, k, v, ranks: int, kv_ranks: int | None = None, kv_layout: str = "") -> None:
    """``q`` of rank ``ranks``, ``k``/``v`` of rank ``kv_ranks`` (default ``ranks``; ``kv_layout`` names it)."""
    kv_ranks = ranks if kv_ranks is None else kv_ranks
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        rank = ranks if name == "q" else kv_ranks
        if t.dim() != rank:
            layout = "(batch, seqlen, heads, head_dim)" if rank == 4 else "(total_tokens, heads, head_dim)"
            if name != "q" and kv_layout:
                layout = kv_layout
            raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; expected torch.bfloat16, torch.float16 or torch.float8_e4m3fn"
            )
    mixed = q.dtype == k.dtype == FP8_DTYPE and v.dtype in HALF_DTYPES  # the fp8qk mode: 16-bit V
    if not (q.dtype == k.dtype == v.dtype or mixed):
        raise TypeError(f"q, k, v must share one dtype (or be float8_e4m3fn q and k with a bf16/fp16 v: the "
                        f"mixed mode), got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_device(q)
    if q.dtype == FP8_DTYPE:
        check_fp8_device(q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] == 0 or t.shape[-2] == 0:
            raise ValueError(f"{name} has an empty head or head_dim axis: shape {tuple(t.shape)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hkv:
        raise ValueError(f"k and v must have the same number of heads, got {hkv} and {v.shape[-2]}")
    if hq % hkv != 0:
        raise ValueError(f"the number of q heads ({hq}) must be a multiple of the k/v heads ({hkv})")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    why = head_dims_problem(q.shape[-1], v.shape[-1])
    if why:
        raise ValueError(why)


def _resolve_out_dtype(dtype: torch.dtype, out_dtype) -> torch.dtype:
    """``out_dtype``, or the default for V's ``dtype``: bf16 for FP8, else V's own (the mixed mode's 16-bit V)."""
    if out_dtype is None:
        return torch.bfloat16 if dtype == FP8_DTYPE else dtype
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype}")
    return out_dtype


def _check_half_descales(dtype, q_descale, k_descale, v_descale, v_dtype=None):
    if dtype != FP8_DTYPE:
        for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
            if d is not None:
                raise ValueError(f"{name} is only meaningful for float8_e4m3fn inputs (got {dtype} inputs)")
    elif v_dtype is not None and v_dtype != FP8_DTYPE and v_descale is not None:
        raise ValueError(f"v_descale is only meaningful for a float8_e4m3fn v (got a {v_dtype} v: the mixed mode "
                         "reads V as it is)")


def _check_k_mean(k_mean, batch: int, kv_heads: int, head_dim: int, device) -> None:
    if k_mean is None:
        return
    if not isinstance(k_mean, torch.Tensor) or k_mean.dtype != torch.float32:
        raise TypeError("k_mean must be a float32 tensor (the mean subtracted from K by quantize_fp8)")
    if k_mean.shape != (batch, kv_heads, head_dim):
        raise ValueError(f"k_mean must have shape ({batch}, {kv_heads}, {head_dim}), got {tuple(k_mean.shape)}")
    if k_mean.device != device:
        raise ValueError(f"k_mean is on {k_mean.device} but q is on {device}")


def _unpack_quantized(q, k, v, q_descale, k_descale, v_descale, k_mean, cu_seqlens_v=None):
    """Allow ``flash_attn_func(quantize_fp8(q, k, v), causal=True)``: ``(q, k, v, q_descale, k_descale,
    v_descale, k_mean, cu_seqlens_v)``."""
    if isinstance(q, FP8QKV):
        if (k is not None or v is not None or cu_seqlens_v is not None
                or any(d is not None for d in (q_descale, k_descale, v_descale))):
            raise ValueError("when q is an FP8QKV (from quantize_fp8), pass k=None, v=None and no descales")
        return q.q, q.k, q.v, q.q_descale, q.k_descale, q.v_descale, q.k_mean, q.cu_seqlens_v
    return q, k, v, q_descale, k_descale, v_descale, k_mean, cu_seqlens_v


def _check_v_tokens(q, k, v, batch: int, cu_seqlens_v) -> None:
    """A packed V has K's tokens, or (``cu_seqlens_v`` given: an FP8 V in :func:`quantize_fp8`'s aligned
    layout) :func:`.kernels.varlen_v.repacked_tokens` of them, with ``cu_seqlens_v`` int32 ``(batch + 1)``."""
    room = repacked_tokens(k.shape[0], batch)
    if cu_seqlens_v is None:
        if k.shape[0] != v.shape[0]:
            hint = (" (a V from quantize_fp8 of a packed batch: pass its cu_seqlens_v too, e.g. "
                    "**quantized.descales(), or the FP8QKV itself)") if v.shape[0] == room else ""
            raise ValueError(f"k and v must have the same number of tokens, got {k.shape[0]} and {v.shape[0]}{hint}")
        return
    if q.dtype != FP8_DTYPE:
        raise ValueError("cu_seqlens_v describes quantize_fp8's FP8 V; this call's inputs are not FP8")
    if not isinstance(cu_seqlens_v, torch.Tensor) or cu_seqlens_v.dtype != torch.int32 or cu_seqlens_v.dim() != 1:
        raise TypeError("cu_seqlens_v must be a 1-D int32 tensor")
    if cu_seqlens_v.numel() != batch + 1 or cu_seqlens_v.device != q.device:
        raise ValueError(f"cu_seqlens_v must have batch + 1 = {batch + 1} entries on {q.device}, got "
                         f"{cu_seqlens_v.numel()} on {cu_seqlens_v.device}")
    if v.shape[0] != room or (v.stride(0) != 1 and v.numel() > 0):
        raise ValueError(f"a V with cu_seqlens_v is quantize_fp8's: {room} token columns for {k.shape[0]} keys in "
                         f"{batch} sequences, tokens innermost; got shape {tuple(v.shape)}, strides {v.stride()}")


def _normalize_window(causal: bool, left: int, right: int, max_seqlen_q: int, max_seqlen_k: int):
    """flash-attn's window rules, as :class:`Problem` stores them: ``causal`` is a right side of 0 (kept as
    ``causal``, right -1); a side that reaches past every key of every sequence is unbounded (query ``i`` at
    key position ``i + Sk - Sq`` sees all keys on the left once ``left >= Sk - 1``, on the right once
    ``right >= Sq - 1``); ``(-1, 0)`` is the causal mask. Returns ``(causal, left, right)``."""
    if causal:
        right = -1
    if left >= max_seqlen_k - 1:
        left = -1
    if right >= max_seqlen_q - 1:
        right = -1
    if right == 0 and left == -1:
        causal, right = True, -1
    return causal, left, right


def _build_problem(q, k, v, *, varlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, q_descale, k_descale, v_descale, k_mean,
                   return_lse, out_dtype, seqused_q=None, seqused_k=None, window_size=(-1, -1),
                   softcap=0.0, page_table=None, cu_seqlens_v=None, scheduler_metadata=None, attention_chunk=0,
                   qv=None) -> Problem:
    paged = page_table is not None
    # K/V indexed per sequence: packed queries without cu_seqlens_k (a dense (B, Sk) cache, or pages)
    kv_per_sequence = varlen and cu_seqlens_k is None
    kv_4d = paged or kv_per_sequence or not varlen
    kv_layout = ("(num_pages, page_size, heads, head_dim) (a paged cache)" if paged
                 else "(batch, seqlen, heads, head_dim) (cu_seqlens_k is None)" if kv_per_sequence else "")
    _check_inputs(q, k, v, 3 if varlen else 4, 4 if kv_4d else 3, kv_layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    left, right, softcap = _check_window_softcap(window_size, softcap)
    attention_chunk = _check_attention_chunk(attention_chunk)
    _check_qv(qv, q, v.shape[-1])
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    _check_half_descales(q.dtype, q_descale, k_descale, v_descale, v.dtype)
    heads, kv_heads = q.shape[-2], k.shape[-2]
    dqk, dv = q.shape[-1], v.shape[-1]
    dev = q.device
    if varlen:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q, q.device)
        batch = cu_seqlens_q.numel() - 1
        if cu_seqlens_k is not None:
            _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None if paged else k.shape[0], "max_seqlen_k",
                              max_seqlen_k, q.device)
            if cu_seqlens_q.numel() != cu_seqlens_k.numel():
                raise ValueError(
                    f"cu_seqlens_q and cu_seqlens_k must have the same length (batch+1), got "
                    f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
                )
            if not paged:
                _check_v_tokens(q, k, v, batch, cu_seqlens_v)
        packed_kv = cu_seqlens_k is not None and not paged
        if cu_seqlens_v is not None and not packed_kv:
            raise ValueError("cu_seqlens_v describes a packed FP8 V (quantize_fp8 of a packed batch): not with a page "
                             "table or per-sequence K/V")
        if scheduler_metadata is not None:
            if not packed_kv:
                raise ValueError("scheduler_metadata is for packed K/V (cu_seqlens_k, no page table)")
            _check_schedule(scheduler_metadata, q, batch, max_seqlen_k)
    else:
        if cu_seqlens_v is not None or scheduler_metadata is not None:
            raise ValueError("cu_seqlens_v and scheduler_metadata are for packed (varlen) calls: pass a packed FP8QKV "
                             "to flash_attn_varlen_func")
        batch, max_seqlen_q = q.shape[0], q.shape[1]
    capacity = None  # the key slot of a sequence whose keys are not packed by cu_seqlens_k
    if paged:
        capacity = _check_page_table(page_table, batch, k, v, dev)
    elif not varlen or kv_per_sequence:
        if k.shape[0] != batch or v.shape[0] != batch:
            raise ValueError(f"q, k, v must share the batch size, got {batch}, {k.shape[0]}, {v.shape[0]}")
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"k and v must have the same seqlen, got {k.shape[1]} and {v.shape[1]}")
        capacity = k.shape[1]
    if capacity is not None and (not varlen or kv_per_sequence):
        max_seqlen_k = capacity
    for name, used, cu, slot in (("seqused_q", seqused_q, cu_seqlens_q, max_seqlen_q),
                                 ("seqused_k", seqused_k, cu_seqlens_k, max_seqlen_k)):
        if used is not None and cu is not None and used.device.type == "cpu":
            slot = cu[1:] - cu[:-1]
        _check_seqused(name, used, batch, slot, dev)
    if paged and page_table.device.type == "cpu" and not torch.compiler.is_compiling():
        # the pages each sequence reads (values: CPU tensors only, as cu_seqlens)
        lengths = torch.full((batch,), capacity) if cu_seqlens_k is None else (cu_seqlens_k[1:] - cu_seqlens_k[:-1])
        if seqused_k is not None:
            lengths = torch.minimum(lengths.long(), seqused_k.long())
        _check_page_ids(page_table, k.shape[0], k.shape[1], lengths)
    q_scale = scales.token_scale_table("q_descale", q_descale, batch=batch, heads=heads,
                                       kv_heads=kv_heads, max_seqlen=max_seqlen_q, device=dev)
    k_scale = scales.token_scale_table("k_descale", k_descale, batch=batch, heads=kv_heads,
                                       kv_heads=kv_heads, max_seqlen=max_seqlen_k, device=dev)
    v_scale = scales.channel_scale_table("v_descale", v_descale, batch=batch, kv_heads=kv_heads,
                                         head_dim=dv, device=dev)
    _check_k_mean(k_mean, batch, kv_heads, dqk, dev)
    causal, left, right = _normalize_window(causal, left, right, max_seqlen_q, max_seqlen_k)
    if (attention_chunk >= max_seqlen_k and not varlen and seqused_q is None and seqused_k is None
            and max_seqlen_q <= max_seqlen_k):
        attention_chunk = 0  # every query's chunk holds every key (its position lies in [0, Sk))
    return Problem(
        q=q, k=k, v=v, batch=batch, heads=heads, kv_heads=kv_heads, head_dim_qk=dqk, head_dim_v=dv,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        cu_seqlens_q=cu_seqlens_q if varlen else None, cu_seqlens_k=cu_seqlens_k if varlen else None,
        causal=causal, softmax_scale=_resolve_scale(softmax_scale, dqk + (dv if qv is not None else 0)),
        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, k_mean=k_mean,
        out_dtype=_resolve_out_dtype(v.dtype, out_dtype), return_lse=return_lse,
        seqused_q=seqused_q, seqused_k=seqused_k, window_left=left, window_right=right, softcap=softcap,
        page_table=page_table, cu_seqlens_v=cu_seqlens_v if varlen else None,
        scheduler_metadata=scheduler_metadata if varlen else None, attention_chunk=attention_chunk, qv=qv,
    )


def _run(problem: Problem, backend: str):
    # Validated here; the launch goes through the ``leanfa::fwd``/``leanfa::varlen_fwd`` custom
    # ops (leanfa/ops.py) so torch.compile traces the call without a graph break.
    from . import ops

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    out, lse = ops.call(problem, backend)
    return (out, lse) if problem.return_lse else out


def flash_attn_func(
    q,
    k=None,
    v=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    *,
    k_mean: torch.Tensor | None = None,
    backend: str = "auto",
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    page_table: torch.Tensor | None = None,
    attention_chunk: int = 0,
    qv: torch.Tensor | None = None,
):
    """Attention forward on ``(batch, seqlen, heads, head_dim)`` tensors.

    Args:
        q: ``(B, Sq, Hq, Dqk)`` bf16, fp16 or float8_e4m3fn; or an :class:`FP8QKV` from
            :func:`quantize_fp8` (then ``k`` and ``v`` are ``None``).
        k: ``(B, Sk, Hkv, Dqk)``, same dtype; ``Hq % Hkv == 0`` (GQA/MQA).
        v: ``(B, Sk, Hkv, Dv)``, same dtype; or bf16/fp16 with float8_e4m3fn ``q``/``k`` (the mixed mode of
            ``attention(precision="fp8qk")``: FP8 Q·K, P·V in V's dtype, no ``v_descale``). ``Dqk`` and ``Dv`` are
            multiples of 8 up to 256 (or ``Dqk <= 64`` with ``Dv <= 512``: FA3's MLA form); the Hopper kernel runs 64/64, 128/128, 192/128 (MLA) and 256/256, other
            head dims run on the portable kernel (one warning on an H200).
        softmax_scale: defaults to ``1/sqrt(Dqk)``.
        causal: mask keys after the query; with ``Sq != Sk`` the mask is aligned to the
            bottom-right corner (query ``i`` sees keys ``j <= i + Sk - Sq``), as in flash-attn.
            Query rows that see no key get output 0 and LSE ``-inf``.
        q_descale, k_descale, v_descale: float32 dequantization scales for FP8 inputs; see
            :mod:`leanfa.scales` for the accepted shapes (per tensor, per head ``(B, Hkv)``,
            per 128-token block, per V channel).
        return_lse: also return the log-sum-exp ``(B, Hq, Sq)`` float32, natural log.
        out_dtype: output dtype; default bf16 for an FP8 ``v``, else ``v``'s dtype.
        k_mean: the per-channel mean that was subtracted from K before quantizing (K smoothing);
            only needed to make the returned LSE exact. Set automatically for an FP8QKV.
        backend: ``"auto"`` (Hopper kernel where it applies, else portable: decided by
            :func:`leanfa.kernels.dispatch.choose`), ``"portable"`` or ``"hopper"`` (error where it does
            not apply).
        seqused_q, seqused_k: FlashAttention-3's int32 ``(B,)`` tensors: batch entry ``b`` has
            only its first ``seqused_q[b]`` queries and ``seqused_k[b]`` keys (the causal mask is
            aligned to these lengths); output rows past ``seqused_q[b]`` are 0 and their LSE
            ``-inf`` (FA3 leaves them unwritten). On sm90 both run on the Hopper kernel.
        window_size: ``(left, right)``, flash-attn's sliding-window (local) attention: query ``i`` sees
            keys ``j`` with ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (bottom-right aligned, as
            the causal mask); -1 is no limit on that side, ``(-1, -1)`` (default) no window. With
            ``causal=True`` the right side is 0 (flash-attn's rule). Rows whose window holds no key get
            output 0 and LSE ``-inf``. ``left``/``right`` below -1 raise ``ValueError``. Runs on the
            Hopper kernel where the call would (only the key blocks of each query tile's band are read;
            FP8 at head dim 256, and paged calls the Hopper kernel does not read (``page_table``, below), on
            the portable kernel: one warning per process).
        softcap: flash-attn's score capping: with ``softcap > 0`` the scores ``s = softmax_scale * q.k``
            become ``softcap * tanh(s / softcap)`` before the softmax (and in the LSE); 0 (default) is
            off, negative values raise ``ValueError``. Runs on the Hopper kernel where the call would (tanh
            on the SFU, ``tanh.approx.f32``, relative error <= 2^-11, as FA3; with a smoothed K, FP8, the
            ``q . mean`` term inside the capped scores), ``seqused_*`` and ``page_table`` included.
        page_table: paged K/V (FlashAttention-3's ``page_table``, flash-attn 2's/vLLM's ``block_table``): int32
            ``(B, max_pages_per_seq)``; ``k``/``v`` are then caches ``(num_pages, page_size, Hkv, D)`` and key
            position ``n`` of batch entry ``b`` is row ``n % page_size`` of page ``page_table[b, n // page_size]``.
            Each entry has ``max_pages_per_seq * page_size`` keys, or ``seqused_k[b]`` (the cache lengths, FA3's
            ``cache_seqlens``); ``Sq`` may be smaller (chunked prefill: the causal mask is bottom-right aligned, so
            the queries are the last ``Sq`` positions). ``page_size`` divides each key tile of the kernel (32, 64,
            128 keys) or is a multiple of it: 1, 2, 4, 8, 16, 32, 64, or a multiple of 128 (else ``ValueError``;
            :func:`leanfa.problem.page_size_supported`); the page ids a call reads
            must lie in ``[0, num_pages)``, checked on CPU tensors only (a check on GPU values would synchronize).
            Any page order; windows, softcap, FP8 with descales compose with it. On sm90 the Hopper kernel runs it
            for 16-bit and FP8 caches with a power-of-two ``page_size`` from 16 keys, windows and softcap included (an FP8 V cache through a transposed copy of
            each sequence's V pages made per call); it reads the rows of a sequence's last page past its keys
            (masked out of the scores), which must then hold finite values; ``seqused_k`` and packed ``q`` without
            ``cu_seqlens_k`` (vLLM's call) included. Other page sizes run on the portable kernel (one warning where
            the Hopper kernel would have run).
        attention_chunk: FlashAttention-3's chunked local attention (Llama-4): with ``attention_chunk = c > 0``
            query ``i`` at key position ``pos = i + Sk - Sq`` (bottom-right, as the causal mask) sees only keys in
            ``[pos - pos mod c, pos - pos mod c + c)`` (floor modulo), intersected with ``causal`` and
            ``window_size``; only the key blocks of each query tile's chunks are read. 0 (default) is off,
            negative values raise ``ValueError``. Runs on the portable kernel (one warning on sm90).
        qv: FlashAttention-3's ``qv`` (DeepSeek MLA's absorbed form): ``(B, Sq, Hq, Dv)``, ``q``'s dtype; the scores
            become ``softmax_scale * (q.k + qv.v)`` and ``softmax_scale`` defaults to ``1/sqrt(Dqk + Dv)``. An FP8
            ``qv`` is dequantized by ``q_descale`` (as FA3). A wrong shape, dtype or device raises ``ValueError``.
            Runs on the portable kernel (one warning on sm90).

    Any strides are accepted; inputs are never copied. Empty inputs (``B``, ``Sq`` or ``Sk`` 0)
    are allowed: the output is empty, or 0 with LSE ``-inf`` where no key exists.

    Returns:
        ``out`` of shape ``(B, Sq, Hq, Dv)``, or ``(out, lse)`` when ``return_lse``.
    """
    q, k, v, q_descale, k_descale, v_descale, k_mean, cu_seqlens_v = _unpack_quantized(
        q, k, v, q_descale, k_descale, v_descale, k_mean)
    problem = _build_problem(
        q, k, v, varlen=False, cu_seqlens_v=cu_seqlens_v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
        max_seqlen_k=None, softmax_scale=softmax_scale, causal=causal, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, k_mean=k_mean, return_lse=return_lse,
        out_dtype=out_dtype, seqused_q=seqused_q, seqused_k=seqused_k, window_size=window_size, softcap=softcap,
        page_table=page_table, attention_chunk=attention_chunk, qv=qv)
    return _run(problem, backend)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype | None = None,
    *,
    k_mean: torch.Tensor | None = None,
    backend: str = "auto",
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    page_table: torch.Tensor | None = None,
    cu_seqlens_v: torch.Tensor | None = None,
    scheduler_metadata: torch.Tensor | None = None,
    attention_chunk: int = 0,
    qv: torch.Tensor | None = None,
):
    """Attention forward on packed ``(total_tokens, heads, head_dim)`` tensors.

    Sequence ``b`` holds query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key tokens
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (int32, flash-attn convention). Empty sequences
    are allowed, also all of them (``max_seqlen_q``/``max_seqlen_k`` may then be 0). ``seqused_q``/
    ``seqused_k`` (int32 ``(B,)``) as in :func:`flash_attn_func`: only the first that many tokens of
    each sequence are used. ``window_size`` and ``softcap`` as in :func:`flash_attn_func`, per sequence
    (``Sq``/``Sk`` are the sequence's lengths, or its ``seqused`` lengths). Per-block descales are
    ``(B, H, ceil(max_seqlen/128))``, blocks counted from each sequence's start. The LSE is
    ``(Hq, total_q)``. ``attention_chunk`` per sequence, as ``window_size``; ``qv`` packed ``(total_q, Hq, Dv)``.
    Other arguments as
    :func:`flash_attn_func`; ``q`` may be an :class:`FP8QKV` from ``quantize_fp8(...,
    cu_seqlens_q=..., cu_seqlens_k=...)`` (then ``k`` and ``v`` are ``None``). Its FP8 V is in the aligned
    layout the Hopper kernel reads (each sequence from a multiple of 16 tokens: no copy per call); passing its
    tensors one by one, give ``cu_seqlens_v`` too (``**quantized.descales()`` does).

    ``scheduler_metadata``: the batch's schedule from :func:`varlen_schedule` (the same ``q`` token count,
    ``cu_seqlens_q``, ``cu_seqlens_k`` and ``max_seqlen_k``), made once and passed to every layer's call of a
    step, as FlashAttention-3's scheduler metadata is: the call then launches only the attention kernel. A
    table made from other lengths gives wrong results (its size is checked, its contents cannot be without a
    host sync). Calls that run on the portable kernel ignore it.

    K/V indexed per sequence instead of packed: with ``page_table`` (int32 ``(B, max_pages_per_seq)``, as in
    :func:`flash_attn_func`) ``k``/``v`` are paged caches ``(num_pages, page_size, Hkv, D)``; sequence ``b``'s
    keys are its first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` positions (flash-attn 2's ``block_table``
    convention; ``cu_seqlens_k`` then only gives lengths), or with ``cu_seqlens_k=None`` its
    ``max_pages_per_seq * page_size`` positions, cut to ``seqused_k[b]`` (vLLM's FA3 call). Without
    ``page_table``, ``cu_seqlens_k=None`` takes ``k``/``v`` as dense ``(B, Sk, Hkv, D)`` tensors (a KV cache of
    ``Sk`` slots per sequence; ``seqused_k`` its used lengths). ``max_seqlen_k`` is then ignored (may be None).
    Queries of a sequence are its last positions (chunked prefill, ``Sq < Sk``, bottom-right aligned).
    Paged calls, with or without ``cu_seqlens_k``, run on the Hopper kernel on sm90 under :func:`flash_attn_func`'s
    ``page_table`` conditions (power-of-two pages from 16 keys; 16-bit or FP8 caches); a dense per-sequence cache
    under packed queries (no ``page_table``, ``cu_seqlens_k=None``) runs on the portable kernel.

    ``cu_seqlens`` values are validated on CPU tensors only (a check on GPU values would
    synchronize); on the GPU the caller guarantees them.
    """
    q, k, v, q_descale, k_descale, v_descale, k_mean, cu_seqlens_v = _unpack_quantized(
        q, k, v, q_descale, k_descale, v_descale, k_mean, cu_seqlens_v)
    problem = _build_problem(
        q, k, v, varlen=True, cu_seqlens_v=cu_seqlens_v, scheduler_metadata=scheduler_metadata,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        k_mean=k_mean, return_lse=return_lse, out_dtype=out_dtype, seqused_q=seqused_q,
        seqused_k=seqused_k, window_size=window_size, softcap=softcap, page_table=page_table,
        attention_chunk=attention_chunk, qv=qv)
    return _run(problem, backend)


def varlen_schedule(
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
) -> torch.Tensor:
    """The Hopper kernel's tile table for a packed batch, to pass as ``scheduler_metadata=`` to every
    :func:`flash_attn_varlen_func` call on that batch (one per layer of a step): which (sequence, query tile)
    pairs exist, the heaviest first. Arguments as the call's (``q``: its packed queries, or any tensor of
    their token count on their device; ``causal`` only orders the table). One launch, no host sync: a CUDA
    graph may capture it."""
    from .kernels.hopper import launch, varlen_tiles

    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q, q.device)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, None, "max_seqlen_k", max_seqlen_k, q.device)  # (no K here)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch+1)")
    return varlen_tiles.build(cu_seqlens_q, cu_seqlens_k, q.shape[0], max_seqlen_k, bool(causal), launch.BLOCK_M)


def _check_schedule(table, q, batch: int, max_seqlen_k: int) -> None:
    """``scheduler_metadata`` is a :func:`varlen_schedule` table for this batch's shapes."""
    from .kernels.hopper import launch, varlen_tiles

    if not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or table.dim() != 1:
        raise TypeError("scheduler_metadata must be the int32 table from leanfa.varlen_schedule")
    want = varlen_tiles.table_size(q.shape[0], batch, max_seqlen_k, launch.BLOCK_M)
    if table.numel() != want or table.device != q.device:
        raise ValueError(f"scheduler_metadata has {table.numel()} entries on {table.device}; varlen_schedule makes "
                         f"{want} on {q.device} for {q.shape[0]} query tokens in {batch} sequences, "
                         f"max_seqlen_k={max_seqlen_k} (made for another batch?)")


#: ``attention``'s precisions: FP8 Q, K, V and P; "fp8qk" FP8 Q·K with P·V in 16 bits (the mixed mode); 16 bits
PRECISIONS = ("fp8", "fp8qk", "bf16")


def _attention_fp8_in_kernel_sink(q, k, v, sink_keys, causal, softmax_scale, return_lse, granularity,
                                  smooth_k, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """``attention(precision="fp8", bf16_sink_keys=P)`` in one FP8 call on ``backend`` (the one
    :func:`leanfa.kernels.dispatch.sink_route` names) that attends keys ``[0, P)`` (of each sequence) from the
    16-bit inputs (see :mod:`leanfa.sink_split`)."""
    from . import ops

    cu = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k)
    quant = ops.quantize_fp8(q, k, v, granularity=granularity, smooth_k=smooth_k, **cu)
    qq, kk, vv, qd, kd, vd, km, cu_v = _unpack_quantized(quant, None, None, None, None, None, None)
    problem = _build_problem(qq, kk, vv, varlen=cu_seqlens_q is not None, **cu, cu_seqlens_v=cu_v,
                             softmax_scale=softmax_scale,
                             causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, k_mean=km,
                             return_lse=return_lse, out_dtype=q.dtype)
    problem = dataclasses.replace(problem, sink_keys=sink_keys, sink_q=q, sink_k=k, sink_v=v)
    return _run(problem, backend)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    precision: str = "fp8",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    granularity: str = "block",
    smooth_k: bool = True,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    backend: str = "auto",
    bf16_sink_keys: int = 0,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    scheduler_metadata: torch.Tensor | None = None,
    rotate: bool | str = False,
    attention_chunk: int = 0,
):
    """High-level attention for BF16/FP16 callers: BF16/FP16 in, same dtype out.

    ``precision="fp8"`` quantizes Q/K/V with the accurate scheme (per-block Q/K scales,
    K smoothing, per-channel V scales, V stored transposed) and runs the FP8 kernel;
    ``precision="fp8qk"`` (the mixed mode) quantizes Q and K the same way but leaves V in 16 bits: the
    scores come from FP8 Q·K, and P (in V's dtype) times V is a 16-bit product with fp32 accumulation, so the
    e4m3 rounding of P and V (a relative error near 2^-4/sqrt(3) on diffuse attention, whatever the length)
    is gone, at 1.5x the tensor work of full FP8 (docs/accuracy-notes.md);
    ``precision="bf16"`` runs the 16-bit kernel on the inputs as they are. Pass
    ``cu_seqlens_*``/``max_seqlen_*`` for packed varlen inputs.

    ``bf16_sink_keys=P`` (FP8): attend the first ``P`` keys (of each sequence) (the attention-sink
    tokens, where most of the FP8 score error comes from) in 16 bits and the rest in FP8, in one
    softmax (:mod:`leanfa.sink_split`). 128 is a good value: on model-like activations it cuts the
    FP8 error ~2-4x at 1K tokens (docs/accuracy-notes.md) for ``P`` extra 16-bit keys per
    query tile. A multiple of 128 runs inside the
    portable FP8 kernel (``backend="auto"`` picks it for this call), dense or varlen; other
    values, and ``backend="hopper"``, run a 16-bit call and an FP8 call merged through their
    LSEs (dense only; as accurate, slower). 0 (default) keeps every key in FP8.

    ``window_size=(left, right)`` and ``softcap`` as in :func:`flash_attn_func` (flash-attn's sliding
    window and score capping; both run on the Hopper kernel), in either precision; not with
    ``bf16_sink_keys`` (``ValueError``). ``attention_chunk`` as in :func:`flash_attn_func` (chunked local
    attention; the portable kernel), not with ``bf16_sink_keys`` either. ``scheduler_metadata``: packed calls, as in
    :func:`flash_attn_varlen_func` (:func:`varlen_schedule`).

    ``rotate`` (``"fp8"``/``"fp8qk"``): as :func:`quantize_fp8`'s: ``"auto"`` rotates Q and K by a Hadamard
    matrix on the KV heads whose Q and K share high-energy channels (chosen on the device, inside the
    quantizer's kernels; head dims 2^k / 12 * 2^k up to 128, else no rotation), ``True`` on every head,
    ``False`` (default) never. Not with ``bf16_sink_keys`` (``ValueError`` unless False).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    from .quant import ROTATE_CHOICES

    if rotate not in ROTATE_CHOICES:
        raise ValueError(f"rotate must be one of {ROTATE_CHOICES}, got {rotate!r}")
    if rotate and (precision == "bf16" or bf16_sink_keys):
        raise ValueError("rotate applies to precision='fp8'/'fp8qk' without bf16_sink_keys; pass rotate=False")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in HALF_DTYPES:
            raise TypeError(f"attention() takes bf16/fp16 {name}, got {t.dtype}; use flash_attn_func for FP8 inputs")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if not isinstance(bf16_sink_keys, int) or isinstance(bf16_sink_keys, bool) or bf16_sink_keys < 0:
        raise ValueError(f"bf16_sink_keys must be a non-negative int, got {bf16_sink_keys!r}")
    if bf16_sink_keys and precision != "fp8":
        raise ValueError("bf16_sink_keys applies to precision='fp8' only")
    left, right, cap = _check_window_softcap(window_size, softcap)
    chunk = _check_attention_chunk(attention_chunk)
    if bf16_sink_keys and ((left, right) != (-1, -1) or cap > 0 or chunk > 0):
        raise ValueError("bf16_sink_keys cannot be combined with window_size, softcap or attention_chunk (the BF16 "
                         "sink keys are attended without a window, a cap or chunks); pass bf16_sink_keys=0")
    if precision == "fp8" and bf16_sink_keys:
        from .kernels import dispatch
        from .quant import _check as _check_quantize
        from .sink_split import attention_sink_bf16

        # inside one FP8 call on the backend dispatch names, or the split below (dense only)
        in_kernel = dispatch.sink_route(backend, (q.shape[-1], v.shape[-1]), bf16_sink_keys)
        if varlen and in_kernel is None:
            raise ValueError(f"bf16_sink_keys with varlen inputs must be a multiple of {dispatch.SINK_BLOCK} "
                             f"(the in-kernel path, backend 'auto' or 'portable'), got {bf16_sink_keys}")
        _check_quantize(q, k, v, granularity, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if in_kernel is not None:
            return _attention_fp8_in_kernel_sink(q, k, v, bf16_sink_keys, causal, softmax_scale, return_lse,
                                                 granularity, smooth_k, in_kernel, cu_seqlens_q, cu_seqlens_k,
                                                 max_seqlen_q, max_seqlen_k)
        return attention_sink_bf16(q, k, v, prefix=bf16_sink_keys, causal=causal, softmax_scale=softmax_scale,
                                   return_lse=return_lse, backend=backend,
                                   quantize_kwargs=dict(granularity=granularity, smooth_k=smooth_k),
                                   flash_attn_func=flash_attn_func)
    if precision in ("fp8", "fp8qk"):
        from . import ops
        from .quant import _check as _check_quantize

        # checked here, quantized by the leanfa::quantize_fp8 op (traceable by torch.compile); "fp8qk" leaves V
        # as it is (16-bit), and the kernels run P.V in 16 bits
        quantize_v = precision == "fp8"
        _check_quantize(q, k, v, granularity, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, quantize_v)
        quant = ops.quantize_fp8(q, k, v, granularity=granularity, smooth_k=smooth_k,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, quantize_v=quantize_v,
                                 rotate=rotate)
        args = dict(softmax_scale=softmax_scale, causal=causal, return_lse=return_lse,
                    out_dtype=q.dtype, backend=backend, window_size=window_size, softcap=softcap,
                    attention_chunk=chunk)
        if varlen:
            return flash_attn_varlen_func(quant, None, None, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, scheduler_metadata=scheduler_metadata, **args)
        return flash_attn_func(quant, **args)
    args = dict(softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, backend=backend,
                window_size=window_size, softcap=softcap, attention_chunk=chunk)
    if varlen:
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      scheduler_metadata=scheduler_metadata, **args)
    return flash_attn_func(q, k, v, **args)
