"""PyTorch custom operators: ``torch.ops.leanfa.fwd`` and ``torch.ops.leanfa.varlen_fwd``.

:func:`leanfa.flash_attn_func`, :func:`leanfa.flash_attn_varlen_func` and
:func:`leanfa.attention` validate their arguments in Python and then call one of these ops, so

* ``torch.compile(fullgraph=True)`` traces a model that calls leanfa without a graph break:
  the op is opaque to Dynamo/Inductor and its fake (meta) implementation gives output shapes;
* a call can be captured in a CUDA graph: the op reads no tensor values on the host, allocates
  only through PyTorch's caching allocator, and descales are device tensors.

The ops take the *validated* layout of :class:`leanfa.problem.Problem`: descales already expanded
into float32 scale tables (see :mod:`leanfa.scales`), ``softmax_scale`` resolved to a float,
``out_dtype`` resolved. They return ``(out, lse)``; ``lse`` has zero elements when
``return_lse`` is False. Call the public functions rather than the ops: the ops do not check
their arguments.

**Eager calls skip the dispatcher.** Outside tracing, with plain tensors and nothing for
autograd to record, :func:`call` and :func:`quantize_fp8` run the implementation directly: the
op's dispatch costs ~80 us of host time per call (measured on the CPU), which bounds short
prefills. Everything else (``torch.compile``, ``torch.export``, fake/functional tensors,
dispatch modes, inputs that require grad) goes through the op, unchanged.

**Warm-up before capture.** On a GPU the portable kernel autotunes large shapes
(``max_seqlen_q * max_seqlen_k >= 2**20``) on its first call for each shape class: that call
benchmarks several configurations and synchronizes, so it cannot run inside
``torch.cuda.graph(...)``. Like FlashAttention-3/Triton kernels in general, run each shape once
outside capture (the usual warm-up iteration), then capture and replay.
"""

from __future__ import annotations

from typing import Optional

import torch

from .problem import FP8_DTYPE, V_TOKEN_ALIGN, Problem

__all__ = ["fwd", "varlen_fwd"]


def _plain_eager(*tensors) -> bool:
    """True when a call may bypass the custom op: no tracing, no dispatch or function mode,
    only plain ``torch.Tensor`` arguments, and no autograd graph to record (through the op a
    backward raises "no autograd formula"; leanfa is forward-only)."""
    if torch.compiler.is_compiling() or _dispatch_mode() is not None or torch._C._is_torch_function_mode_enabled():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return False
    return True


def _dispatch_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def _problem(q, k, v, cu_q, cu_k, max_q, max_k, q_scale, k_scale, v_scale, k_mean,
             softmax_scale, causal, return_lse, out_dtype, sink_q=None, sink_k=None, sink_v=None, sink_keys=0,
             seqused_q=None, seqused_k=None, window_left=-1, window_right=-1, softcap=0.0, page_table=None,
             cu_v=None, scheduler_metadata=None, attention_chunk=0, qv=None):
    varlen = cu_q is not None
    if varlen:
        batch = cu_q.numel() - 1
    else:
        batch, max_q, max_k = q.shape[0], q.shape[1], k.shape[1]
        if page_table is not None:  # a paged cache: each entry's capacity
            max_k = page_table.shape[1] * k.shape[1]
    return Problem(
        q=q, k=k, v=v, batch=batch, heads=q.shape[-2], kv_heads=k.shape[-2],
        head_dim_qk=q.shape[-1], head_dim_v=v.shape[-1], max_seqlen_q=max_q, max_seqlen_k=max_k,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, softmax_scale=softmax_scale,
        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, k_mean=k_mean, out_dtype=out_dtype,
        return_lse=return_lse, sink_keys=sink_keys, sink_q=sink_q, sink_k=sink_k, sink_v=sink_v,
        seqused_q=seqused_q, seqused_k=seqused_k, window_left=window_left, window_right=window_right,
        softcap=softcap, page_table=page_table, cu_seqlens_v=cu_v, scheduler_metadata=scheduler_metadata,
        attention_chunk=attention_chunk, qv=qv)


def _execute(problem, backend: str):
    from .kernels import dispatch

    out, lse = dispatch.run(problem, backend)
    if lse is None:
        lse = problem.q.new_empty((0,), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("leanfa::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_mean: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    return_lse: bool,
    out_dtype: torch.dtype,
    backend: str,
    sink_q: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None,
    sink_v: Optional[torch.Tensor] = None,
    sink_keys: int = 0,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    page_table: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
    qv: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense forward on ``(B, S, H, D)`` tensors; returns ``(out, lse)`` (``lse`` empty unless
    ``return_lse``). FP8 calls may attend keys ``[0, sink_keys)`` in 16 bits from
    ``sink_q``/``sink_k``/``sink_v`` (the unquantized inputs). ``seqused_q``/``seqused_k``
    (int32 ``(B,)``): only the first that many queries/keys of each batch entry are used.
    ``window_left``/``window_right``/``softcap``: the sliding window and score cap, as
    :class:`leanfa.problem.Problem` holds them (-1, -1, 0: none). ``page_table``: ``k``/``v`` are paged caches
    ``(num_pages, page_size, Hkv, D)`` read through it (None: dense). ``attention_chunk``, ``qv``: FA3's chunked
    attention and MLA term, as :class:`leanfa.problem.Problem` holds them (0, None: none)."""
    problem = _problem(q, k, v, None, None, None, None, q_scale, k_scale, v_scale, k_mean,
                       softmax_scale, causal, return_lse, out_dtype, sink_q, sink_k, sink_v, sink_keys,
                       seqused_q, seqused_k, window_left, window_right, softcap, page_table,
                       attention_chunk=attention_chunk, qv=qv)
    return _execute(problem, backend)


@fwd.register_fake
def _fwd_fake(q, k, v, q_scale, k_scale, v_scale, k_mean, softmax_scale, causal, return_lse,
              out_dtype, backend, sink_q=None, sink_k=None, sink_v=None, sink_keys=0, seqused_q=None,
              seqused_k=None, window_left=-1, window_right=-1, softcap=0.0, page_table=None, attention_chunk=0,
              qv=None):
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[-1]), dtype=out_dtype)
    lse = q.new_empty((b, hq, sq) if return_lse else (0,), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("leanfa::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_mean: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    return_lse: bool,
    out_dtype: torch.dtype,
    backend: str,
    sink_q: Optional[torch.Tensor] = None,
    sink_k: Optional[torch.Tensor] = None,
    sink_v: Optional[torch.Tensor] = None,
    sink_keys: int = 0,
    seqused_q: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    page_table: Optional[torch.Tensor] = None,
    cu_seqlens_v: Optional[torch.Tensor] = None,
    scheduler_metadata: Optional[torch.Tensor] = None,
    attention_chunk: int = 0,
    qv: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen forward on ``(total, H, D)`` tensors; returns ``(out, lse)`` with ``lse``
    ``(Hq, total_q)`` (empty unless ``return_lse``). Sink, seqused, window, softcap and page table arguments as
    in :func:`fwd` (the first ``sink_keys`` keys of each sequence). ``cu_seqlens_k`` None: K/V are indexed per
    sequence (dense ``(B, Sk, Hkv, D)``, or pages), ``max_seqlen_k`` their slot. ``cu_seqlens_v``: an FP8 V in
    :func:`leanfa.quantize_fp8`'s aligned layout, sequence ``b`` from token ``cu_seqlens_v[b]``.
    ``scheduler_metadata``: the batch's tile table from :func:`leanfa.varlen_schedule`."""
    problem = _problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       q_scale, k_scale, v_scale, k_mean, softmax_scale, causal, return_lse, out_dtype,
                       sink_q, sink_k, sink_v, sink_keys, seqused_q, seqused_k, window_left, window_right, softcap,
                       page_table, cu_seqlens_v, scheduler_metadata, attention_chunk, qv)
    return _execute(problem, backend)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_scale,
                     k_scale, v_scale, k_mean, softmax_scale, causal, return_lse, out_dtype, backend,
                     sink_q=None, sink_k=None, sink_v=None, sink_keys=0, seqused_q=None, seqused_k=None,
                     window_left=-1, window_right=-1, softcap=0.0, page_table=None, cu_seqlens_v=None,
                     scheduler_metadata=None, attention_chunk=0, qv=None):
    total, hq, _ = q.shape
    out = q.new_empty((total, hq, v.shape[-1]), dtype=out_dtype)
    lse = q.new_empty((hq, total) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def call(problem, backend: str):
    """Run a validated :class:`leanfa.api.Problem` through the custom op; ``(out, lse or None)``."""
    p = problem
    if _plain_eager(p.q, p.k, p.v, p.q_scale, p.k_scale, p.v_scale, p.k_mean, p.cu_seqlens_q, p.cu_seqlens_k,
                    p.sink_q, p.sink_k, p.sink_v, p.seqused_q, p.seqused_k, p.page_table, p.cu_seqlens_v,
                    p.scheduler_metadata, p.qv):
        out, lse = _execute(p, backend)
        return out, (lse if p.return_lse else None)
    scalars = (p.softmax_scale, p.causal, p.return_lse, p.out_dtype, backend,
               p.sink_q, p.sink_k, p.sink_v, p.sink_keys, p.seqused_q, p.seqused_k, p.window_left, p.window_right,
               p.softcap, p.page_table)
    if p.varlen:
        out, lse = torch.ops.leanfa.varlen_fwd(
            p.q, p.k, p.v, p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k,
            p.q_scale, p.k_scale, p.v_scale, p.k_mean, *scalars, p.cu_seqlens_v, p.scheduler_metadata,
            p.attention_chunk, p.qv)
    else:
        out, lse = torch.ops.leanfa.fwd(p.q, p.k, p.v, p.q_scale, p.k_scale, p.v_scale, p.k_mean, *scalars,
                                        p.attention_chunk, p.qv)
    return out, (lse if p.return_lse else None)


@torch.library.custom_op("leanfa::quantize_fp8", mutates_args=())
def quantize_fp8_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    granularity: str,
    smooth_k: bool,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    quantize_v: bool = True,
    rotate: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """:func:`leanfa.quantize_fp8` as an op: ``(q8, k8, v8, q_descale, k_descale, v_descale,
    k_mean, cu_seqlens_v, rotated)``; ``k_mean`` has zero elements when ``smooth_k`` is False, ``cu_seqlens_v``
    when the inputs are dense or ``quantize_v`` is False, and so do ``v8`` and ``v_descale`` when ``quantize_v``
    is False (V stays the caller's: an op's output may not alias its input). ``rotate``: 0, 1 or 2 for
    ``quantize_fp8``'s ``rotate=False``, ``True``, ``"auto"``; ``rotated`` is ``FP8QKV.rotated`` (bool
    ``(B, Hkv)``), zero elements when nothing may be rotated."""
    return _quantize_fp8_impl(q, k, v, granularity, smooth_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              quantize_v, rotate)


#: the op's ``rotate`` codes, in quantize_fp8's terms
_ROTATE_CODES = (False, True, "auto")


def _quantize_fp8_impl(q, k, v, granularity, smooth_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       quantize_v=True, rotate=0):
    from .quant import quantize_checked

    # every caller checked the arguments (quant._check) before this op
    r = quantize_checked(q, k, v, granularity, smooth_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         quantize_v=quantize_v, rotate=_ROTATE_CODES[rotate])
    k_mean = r.k_mean if r.k_mean is not None else q.new_empty((0,), dtype=torch.float32)
    cu_v = r.cu_seqlens_v if r.cu_seqlens_v is not None else q.new_empty((0,), dtype=torch.int32)
    rotated = r.rotated if r.rotated is not None else q.new_empty((0,), dtype=torch.bool)
    if not quantize_v:
        none = q.new_empty((0,), dtype=torch.float32)
        return r.q, r.k, none, r.q_descale, r.k_descale, none.clone(), k_mean, cu_v, rotated
    # outputs must not alias each other: a 0-d "tensor" descale is a fresh tensor already
    return r.q, r.k, r.v, r.q_descale, r.k_descale, r.v_descale, k_mean, cu_v, rotated


@quantize_fp8_op.register_fake
def _quantize_fp8_fake(q, k, v, granularity, smooth_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       quantize_v=True, rotate=0):
    from .kernels.varlen_v import repacked_tokens
    from .scales import num_scale_blocks

    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    hq, hkv, dqk, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    sq = max_seqlen_q if varlen else q.shape[1]
    sk = max_seqlen_k if varlen else k.shape[1]
    f32 = dict(dtype=torch.float32)
    q8 = torch.empty_like(q, dtype=FP8_DTYPE, memory_format=torch.contiguous_format)
    k8 = torch.empty_like(k, dtype=FP8_DTYPE, memory_format=torch.contiguous_format)
    cu_v = q.new_empty((0,), dtype=torch.int32)
    if varlen:
        v8 = v.new_empty((hkv, dv, repacked_tokens(v.shape[0], batch)), dtype=FP8_DTYPE).permute(2, 0, 1)
        if quantize_v:
            cu_v = q.new_empty((batch + 1,), dtype=torch.int32)
    else:
        tokens = v.shape[1]
        padded = (tokens + V_TOKEN_ALIGN - 1) // V_TOKEN_ALIGN * V_TOKEN_ALIGN
        v8 = v.new_empty((batch, hkv, dv, padded), dtype=FP8_DTYPE).permute(0, 3, 1, 2)[:, :tokens]
    if granularity == "block":
        qd = q.new_empty((batch, hq, num_scale_blocks(sq)), **f32)
        kd = q.new_empty((batch, hkv, num_scale_blocks(sk)), **f32)
    elif granularity == "head":
        qd, kd = q.new_empty((batch, hq), **f32), q.new_empty((batch, hkv), **f32)
    else:
        qd, kd = q.new_empty((), **f32), q.new_empty((), **f32)
    vd = q.new_empty((), **f32) if granularity == "tensor" else q.new_empty((batch, hkv, dv), **f32)
    k_mean = q.new_empty((batch, hkv, dqk) if smooth_k else (0,), **f32)
    if not quantize_v:
        v8, vd = q.new_empty((0,), **f32), q.new_empty((0,), **f32)
    from .kernels.quantize import FUSED_MAX_DIM
    from .quant import fused_rotation_available

    rotatable = rotate == 1 or (rotate == 2 and granularity == "block" and fused_rotation_available(dqk)
                                and max(dqk, dv) <= FUSED_MAX_DIM and q.dtype == k.dtype)
    rotated = q.new_empty((batch, hkv) if rotatable else (0,), dtype=torch.bool)
    return q8, k8, v8, qd, kd, vd, k_mean, cu_v, rotated


def quantize_fp8(q, k, v, granularity="block", smooth_k=True, *, cu_seqlens_q=None, cu_seqlens_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, quantize_v=True, rotate=False):
    """:func:`leanfa.quantize_fp8` through the ``leanfa::quantize_fp8`` op (arguments already
    checked by the caller); returns an :class:`leanfa.FP8QKV` (with ``quantize_v=False``: Q and K in FP8,
    ``v`` the given 16-bit one)."""
    from .quant import FP8QKV, ROTATE_CHOICES, rotation_matrix

    if rotate not in ROTATE_CHOICES:
        raise ValueError(f"rotate must be one of {ROTATE_CHOICES}, got {rotate!r}")
    code = 2 if rotate == "auto" else int(bool(rotate))
    args = (q, k, v, granularity, smooth_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    # (the op's defaults stay out of the call: its traced signature is unchanged)
    if not quantize_v or code:
        args += (quantize_v,)
    if code:
        args += (code,)
    if _plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k):
        q8, k8, v8, qd, kd, vd, k_mean, cu_v, rotated = _quantize_fp8_impl(*args)
    else:
        q8, k8, v8, qd, kd, vd, k_mean, cu_v, rotated = torch.ops.leanfa.quantize_fp8(*args)
    if not quantize_v:
        v8, vd = v, None
    has_rotation = rotated.dim() == 2
    return FP8QKV(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd,
                  k_mean=k_mean if smooth_k else None, granularity=granularity,
                  rotation=rotation_matrix(q.shape[-1], q.device) if has_rotation else None,
                  rotated=rotated if has_rotation else None,
                  cu_seqlens_v=cu_v if cu_seqlens_q is not None and quantize_v else None)
