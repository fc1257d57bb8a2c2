"""Hand-scheduled Hopper (sm90) attention forward in Gluon (``triton.experimental.gluon``).

One concern per module: :mod:`.layouts` (register/shared layouts), :mod:`.pipeline` (TMA +
mbarrier K/V ring), :mod:`.schedule` (which query tiles a program computes), :mod:`.masking`
(which key blocks a tile visits, diagonal/tail masks, sliding windows' bands), :mod:`.softmax`
(Lean-P online softmax), :mod:`.ablation` (timing ablations),
:mod:`.epilogue` (output rows: register stores, or for dense calls a shared-memory box and one TMA
store per warpgroup; the LSE's K-mean term), :mod:`.sink` (BF16 sink keys),
:mod:`.trace` (SM-clock trace of the key loop); the kernel :mod:`.kernel_pingpong` (a producer
warp and two consumer warpgroups in their own partitions); :mod:`.launch`
(host: descriptors, knobs, launch), :mod:`.plan_cache` (a dense call's plan kept per call signature, and
the compiled kernel launched directly on later calls), :mod:`.aot` (compile for sm90 without a GPU) and
:mod:`.emulate` (run a kernel's own source on the CPU, checking the mbarrier/TMA protocol).

:func:`supports` says whether a validated :class:`leanfa.problem.Problem` can run here, and why
not; anything it rejects runs on the portable kernel instead -- never a wrong answer. Whether a call
that can run here does is decided by :mod:`leanfa.kernels.dispatch`.
"""

from __future__ import annotations

import threading
import weakref

import torch
import triton

from ... import _versions
from ..device import capability
from ..outputs import allocate_outputs
from . import launch as _launch
from . import plan_cache, varlen_tiles

#: 64/64 passes the 130-case H200 check (scripts/hopper_gpu_check.py: the 90 cases plus 40 at 64/64, BF16 and
#: FP8, causal and not, odd lengths, GQA) and memcheck on its 24 small cases with 0 errors.
#: 256/256 (Gemma-class heads): FP8 with PV in the wgmma accumulator, BF16 with 64-key blocks
#: (launch.wide_head); 48/48 H200 cases, memcheck/synccheck 0 errors. The records: docs/perf-notes.md.
HEAD_DIMS = ((64, 64), (128, 128), (192, 128), (256, 256))
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def head_dims_reason(dims) -> str:
    """Why the kernel does not run head dims ``dims`` (Dqk, Dv) (not one of :data:`HEAD_DIMS`)."""
    return (f"head dims {dims[0]}/{dims[1]} are not implemented in the Hopper kernel "
            f"({', '.join(f'{a}/{b}' for a, b in HEAD_DIMS)}): these calls run on the portable kernel")


def sink_problem(dims, sink_keys) -> str | None:
    """Why the kernel cannot attend ``sink_keys`` BF16 sink keys in an FP8 call of head dims ``dims`` (Dqk, Dv),
    or None (:func:`.launch.sink_problem`)."""
    return _launch.sink_problem(True, dims, sink_keys)


def paged_problem(page_size: int, v) -> str | None:
    """Why the kernel cannot read paged K/V caches of ``page_size`` keys per page with this V cache, or None
    (:func:`.launch.paged_problem`)."""
    return _launch.paged_problem(page_size, _launch.as_bshd(v))


def supports(problem) -> tuple[bool, str]:
    """Whether the Hopper kernel can run ``problem``; if not, the reason (the verdict of a signature seen
    before is reused: it depends on nothing else)."""
    key = _signature(problem)
    if key is None:
        return _supports(problem)
    verdict = VERDICTS.get(key)
    if verdict is None:
        verdict = _supports(problem)
        VERDICTS.put(key, verdict)
    return verdict


def device_problem(problem) -> str:
    """Why the Hopper kernel cannot run anything here (Triton, device), or ``""``: what the call's shape, dtypes
    and options decide comes after."""
    if _versions.unsupported({"triton": triton.__version__}):
        supported = ", ".join(f"{v}.x" for v in _versions.SUPPORTED["triton"])
        return f"the Hopper kernel builds with triton {supported} only (found {triton.__version__})"
    if problem.q.device.type != "cuda":
        return f"the Hopper kernel needs CUDA tensors (got {problem.q.device})"
    if torch.version.hip is not None:
        return "the Hopper kernel needs an NVIDIA GPU"
    cap = capability(problem.q.device)
    if cap != (9, 0):
        return f"the Hopper kernel needs an sm90 GPU (found sm{cap[0]}{cap[1]})"
    return ""


def _supports(problem) -> tuple[bool, str]:
    why = device_problem(problem)
    if why:
        return False, why
    q, k, v = (_launch.as_bshd(t) for t in (problem.q, problem.k, problem.v))
    if q.numel() == 0 or k.numel() == 0:  # a TMA descriptor cannot have a zero-sized dim
        return False, "empty inputs (no query or no key token): nothing for TMA to load"
    dims = (problem.head_dim_qk, problem.head_dim_v)
    if dims not in HEAD_DIMS:
        return False, head_dims_reason(dims)
    if q.dtype not in IN_DTYPES or v.dtype not in IN_DTYPES:
        return False, f"dtype {q.dtype} (v {v.dtype}) is not supported by the Hopper kernel"
    if problem.out_dtype not in OUT_DTYPES:
        return False, f"out_dtype {problem.out_dtype} is not supported by the Hopper kernel"
    kmajor = _launch.v_is_kmajor(v) and not problem.paged  # (a paged V cache is stored token-major)
    # FP8 V in any layout but the transposed one quantize_fp8 writes (e.g. token-major, FA3 style; a packed FP8 V
    # without quantize_fp8's aligned starts, cu_seqlens_v; a paged FP8 V cache) is copied by the plan into that
    # layout, 16-byte aligned (launch.transpose_fp8_v, align_varlen_v, gather_paged_v): only the copy reaches TMA
    repacked = problem.pv_fp8 and ((problem.varlen and problem.cu_seqlens_v is None) or not kmajor)
    views = [("q", q, *_launch._bshd_as_bhsd(q)), ("k", k, *_launch._bshd_as_bhsd(k))]
    if not repacked:
        views.append(("v", v, *(_launch._v_kmajor_dims(v) if kmajor else _launch._bshd_as_bhsd(v))))
    for name, t, shape, strides in views:
        why = _launch.tma_layout_problem(name, t, shape, strides)
        if why:
            return False, why
    if problem.max_seqlen_q >= 2**31 or problem.max_seqlen_k >= 2**31:
        return False, "sequence too long"
    if problem.paged:
        why = _launch.paged_problem(problem.page_size, v)
        if why:
            return False, why
    if problem.varlen:
        why = varlen_tiles.table_problem(q.shape[1], problem.cu_seqlens_q.numel() - 1, _launch.BLOCK_M)
        if why:
            return False, why
    if problem.kv_per_sequence and not problem.paged:
        return False, "packed queries over a per-sequence (batch, seqlen) K/V cache are not implemented in the Hopper kernel"
    if problem.sink_keys and problem.seqused_q is not None:
        return False, "the Hopper kernel does not combine seqused_q with BF16 sink keys"
    if problem.sink_keys and problem.has_window:  # (the API refuses the pair before it gets here)
        return False, "the Hopper kernel does not combine sliding windows (window_size) with BF16 sink keys"
    if problem.sink_keys:
        why = _launch.sink_problem(problem.pv_fp8, dims, problem.sink_keys,
                                   (("q", problem.sink_q), ("k", problem.sink_k), ("v", problem.sink_v)))
        if why:
            return False, why
    return True, ""


def plan_kwargs(problem) -> dict:
    """``make_plan``'s keywords for ``problem``: the varlen ones (none when dense; a packed FP8 V's aligned
    starts among them), the BF16 sink keys' ``sink`` tuple (none without), paged K/V's ``page_table``, the sliding
    window's ``window``, ``softcap`` and FA3's ``seqused_k`` and ``seqused_q`` (none without any)."""
    kw = {}
    if problem.paged:
        kw.update(page_table=problem.page_table)
    if problem.seqused_k is not None:
        kw.update(seqused_k=problem.seqused_k)
    if problem.seqused_q is not None:
        kw.update(seqused_q=problem.seqused_q)
    if problem.has_window:
        kw.update(window=(problem.window_left, problem.window_right))
    if problem.softcap > 0:
        kw.update(softcap=problem.softcap)
    if problem.varlen:
        kw.update(cu_seqlens_q=problem.cu_seqlens_q, cu_seqlens_k=problem.cu_seqlens_k,
                  max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k,
                  cu_seqlens_v=problem.cu_seqlens_v)
    if problem.sink_keys:
        kw.update(sink=(problem.sink_keys, problem.sink_q, problem.sink_k, problem.sink_v))
    return kw


#: plans by call signature (:mod:`.plan_cache`), and :func:`supports`' verdicts by the inputs' part of it
PLANS = plan_cache.Cache()
VERDICTS = plan_cache.Cache()
_memo = threading.local()  # the last problem's key: supports() and plan() of one call compute it once


def _inputs(problem) -> tuple:
    return (problem.q, problem.k, problem.v, problem.q_scale, problem.k_scale, problem.v_scale, problem.k_mean,
            problem.sink_q, problem.sink_k, problem.sink_v, problem.cu_seqlens_q, problem.cu_seqlens_k,
            problem.cu_seqlens_v, problem.page_table, problem.seqused_k, problem.seqused_q)


def _signature(problem):
    """The cache key of a call's inputs, scalars, knobs and device, or None when its plan is rebuilt every call
    (``LEANFA_HOPPER_PLAN_CACHE=0``, a timing ablation; and with ``=1``, or without
    :data:`.plan_cache.PREPARED_VALIDATED`, a call whose plan works on prepared inputs: varlen, or FP8 with a V
    the plan copies)."""
    last = getattr(_memo, "last", None)
    if last is not None and last[0]() is problem:
        return last[1]
    key = None
    knobs = plan_cache.knob_values()
    prepared = problem.varlen or problem.pv_fp8 and not _launch.v_is_kmajor(problem.v)
    if plan_cache.enabled(knobs) and (not prepared or plan_cache.prepared_enabled(knobs)):
        scalars = (problem.causal, problem.softmax_scale, problem.return_lse, problem.sink_keys, problem.out_dtype,
                   problem.max_seqlen_q, problem.max_seqlen_k, problem.window_left, problem.window_right,
                   problem.softcap)
        key = plan_cache.signature(_inputs(problem), scalars, knobs)
    _memo.last = (weakref.ref(problem), key)
    return key


def plan(problem):
    """The launch plan of a problem :func:`supports` accepted, with its ``(out, lse or None)``
    (any per-call copy of an input, e.g. a permuted V, is made here: timing ``launch(plan)``
    alone times the kernel alone). A signature seen before reuses its plan (:mod:`.plan_cache`): the plan's
    tensors are then this call's inputs as the kernel reads them (packed varlen tensors as a batch of one,
    V as :func:`.launch.prepare_v` makes it), bound into the template."""
    out, lse = allocate_outputs(problem)
    key = _signature(problem)
    _memo.last = None  # (a later call on this problem object reads the knobs again)
    # a paged call's key lengths (seqused_k, or no cu_seqlens_k: vLLM's call) as cu_seqlens_k (made every call)
    cu_k, used_k = _launch.paged_keys(problem.page_table, problem.page_size, problem.varlen, problem.cu_seqlens_k,
                                      problem.seqused_k)
    v, cu_v = _launch.prepare_v(problem.q, problem.v, cu_k, problem.max_seqlen_k, problem.cu_seqlens_v,
                                problem.page_table)
    q, k, v, sq, sk, sv = (t if t is None else _launch.as_bshd(t)
                           for t in (problem.q, problem.k, v, problem.sink_q, problem.sink_k, problem.sink_v))
    tiles = problem.scheduler_metadata
    if problem.varlen and tiles is None:  # the call's tile table (made every call unless the caller made it)
        tiles = varlen_tiles.build(problem.cu_seqlens_q, cu_k, q.shape[1], problem.max_seqlen_k,
                                   problem.causal, _launch.BLOCK_M, (problem.window_left, problem.window_right), used_k)
    inputs = (q, k, v, problem.q_scale, problem.k_scale, problem.v_scale, problem.k_mean, sq, sk, sv,
              problem.cu_seqlens_q, cu_k, cu_v, tiles, out, lse, problem.page_table, used_k, problem.seqused_q)
    if key is not None:
        key = plan_cache.extend(key, (v, cu_v, tiles, out, lse, cu_k, used_k), inputs)
        template = PLANS.get(key)
        if template is not None:
            return template.bind(inputs), out, lse
    kw = plan_kwargs(problem)
    if problem.varlen:
        kw.update(cu_seqlens_k=cu_k)
    if problem.seqused_k is not None:
        kw.update(seqused_k=used_k)
    if problem.sink_keys:
        kw["sink"] = (problem.sink_keys, sq, sk, sv)
    p = _launch.make_plan(q, k, None, out, lse, problem.q_scale, problem.k_scale, problem.v_scale,
                          problem.k_mean, causal=problem.causal, softmax_scale=problem.softmax_scale,
                          return_lse=problem.return_lse, prepared_v=(v, cu_v), tile_table=tiles, **kw)
    template = plan_cache.Template.of(p, inputs) if key is not None else None
    if template is not None:
        PLANS.put(key, template)
        p = template.bind(inputs)  # its first launch keeps the compiled kernel
    return p, out, lse


def run(problem):
    """Run a problem :func:`supports` accepted; return ``(out, lse or None)``."""
    p, out, lse = plan(problem)
    with torch.cuda.device(problem.q.device):
        _launch.launch(p)
    return out, lse
