"""Host side: TMA descriptors over the caller's tensors, launch parameters, and the checks
that decide whether a layout can be expressed as TMA descriptors at all.

Every descriptor is rank 4 over the tensor *as stored*, so any batch/head/token strides work
without a copy: Q/K and token-major V as ``[batch, head, seq, dim]``; V stored transposed
(``v.stride(1) == 1``, what :func:`leanfa.quantize_fp8` writes) as ``[batch, head, dim, seq]``.
TMA needs: the innermost stride 1, every other stride a multiple of 16 bytes, a 16-byte aligned
base. Out-of-range boxes are zero-filled, so sequence tails and batch edges are safe.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch

from ...problem import V_TOKEN_ALIGN  # 16 FP8 tokens = 16 bytes: where a TMA box may start
from ...scales import SCALE_BLOCK, broadcast_strides
from .ablation import ABLATE_BITS
from .gluon_compat import TensorDescriptor, gl
from .kernel_pingpong import attn_fwd_pingpong_kernel
from .trace import TRACE_BLOCKS, TRACE_EVENTS
from . import varlen_tiles
from ..paged_v import gather_paged_v
from ..varlen_v import align_varlen_v

BLOCK_M = 128  # two consumer warpgroups, 64 query rows each
BLOCK_N = 128
WG_WARPS = 4  # warps per consumer warpgroup (the kernel's num_warps: its default partition is one warpgroup)
LOG2E = 1.4426950408889634
SMEM_LIMIT = 227 * 1024

_GL_DTYPES = {
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float8_e4m3fn: gl.float8e4nv,
}


def v_is_kmajor(v: torch.Tensor) -> bool:
    """V stored transposed ((B, Hkv, Dv, S) storage viewed as (B, S, Hkv, Dv))."""
    return v.stride(1) == 1 and v.stride(3) != 1


def transpose_fp8_v(v: torch.Tensor) -> torch.Tensor:
    """A transposed-storage copy ``(B, H, Dv, S)`` (token rows padded to ``V_TOKEN_ALIGN``, zeros), viewed
    as ``(B, S, H, Dv)``, of an FP8 V in any other layout (e.g. token-major, as FA3's FP8 API takes it):
    the FP8 wgmma reads V K-major, which is the layout :func:`leanfa.quantize_fp8` writes. One pass over
    V per call, in place of the portable kernel."""
    B, S, H, Dv = v.shape
    room = -(-max(S, 1) // V_TOKEN_ALIGN) * V_TOKEN_ALIGN
    out = torch.empty((B, H, Dv, room), dtype=torch.uint8, device=v.device)
    out[..., S:].zero_()
    out[..., :S].copy_(v.permute(0, 2, 3, 1).view(torch.uint8))
    return out.view(v.dtype).permute(0, 3, 1, 2)[:, :S]


def _bshd_as_bhsd(t: torch.Tensor):
    """Shape and strides of a (B, S, H, D) tensor as stored [B, H, S, D] (D innermost)."""
    B, S, H, D = t.shape
    return [B, H, S, D], [t.stride(0), t.stride(2), t.stride(1), t.stride(3)]


def _v_kmajor_dims(v: torch.Tensor):
    """Shape and strides of a transposed-storage V as [B, H, D, S] (S innermost)."""
    B, S, H, D = v.shape
    return [B, H, D, S], [v.stride(0), v.stride(2), v.stride(3), v.stride(1)]


def tma_layout_problem(name: str, t: torch.Tensor, shape, strides) -> str | None:
    """Why ``t`` viewed as ``shape``/``strides`` cannot be a TMA descriptor (None if it can)."""
    elt = t.element_size()
    if strides[-1] != 1:
        return f"{name}: the head_dim axis must be contiguous (stride 1) for TMA, got strides {tuple(t.stride())}"
    if t.data_ptr() % 16:
        return f"{name}: the data pointer is not 16-byte aligned (TMA)"
    for s, st in zip(shape[:-1], strides[:-1]):
        if s > 1 and (st * elt) % 16:
            return f"{name}: stride {st} x {elt} bytes is not a multiple of 16 (TMA), strides {tuple(t.stride())}"
        if st < 0 or st * elt >= 2**40:
            return f"{name}: stride {st} out of TMA range"
    if any(s >= 2**31 for s in shape):
        return f"{name}: a dimension is too large for TMA"
    return None


def qk_chunk(dqk: int) -> int:
    """TMA box width along the Q/K head dim: boxes must be powers of two (192 -> 3 x 64)."""
    return dqk if dqk & (dqk - 1) == 0 else 64


def stages_for(dqk: int, dv: int, elt: int, block_n: int = BLOCK_N, block_m: int = BLOCK_M, extra: int = 0,
               v_elt: int | None = None) -> int:
    """Deepest K/V ring that fits shared memory (with room for layout-conversion scratch) next to Q and
    ``extra`` bytes (the BF16 sink keys' buffers); ``v_elt``: V's element size where it differs from Q/K's
    ``elt`` (the mixed mode's 16-bit V)."""
    stages = 4
    while stages > 2 and _smem_bytes(dqk, dv, elt, stages, block_n, block_m, extra, v_elt) > SMEM_LIMIT:
        stages -= 1
    return stages


def _smem_bytes(dqk: int, dv: int, elt: int, stages: int, block_n: int = BLOCK_N, block_m: int = BLOCK_M,
                extra: int = 0, v_elt: int | None = None) -> int:
    """Shared memory of Q, ``stages`` K/V slots, ``extra`` bytes and 8 KB for layout-conversion scratch."""
    v_elt = elt if v_elt is None else v_elt
    return block_m * dqk * elt + extra + stages * block_n * (dqk * elt + dv * v_elt) + 8 * 1024


def wide_head(dv: int) -> bool:
    """Head dim 256: O alone takes 128 registers per thread (64 x 256 fp32 over a warpgroup),
    so FP8 PV accumulates in O itself (``PV_IN_MMA``: no second 128-register fp32 PV tile) and BF16
    runs 64-key blocks (S in 32 registers; at 128 keys ptxas serializes its wgmmas, C7512). FP8 keeps
    128-key blocks (S 64 + O 128 + P 16 registers; AOT sm90: 52-80 B of spills): run 42 timed them
    1.07x (4K) and 1.12-1.24x (16K) its 64-key blocks, 1016 TFLOP/s = 1.05x cuDNN FP8 at 16K."""
    return dv > 128


def _block_n(is_fp8: bool, dv: int = 128) -> int:
    """Keys per block: 128; BF16 at head dim 256 64 (:func:`wide_head`)."""
    return 64 if wide_head(dv) and not is_fp8 else BLOCK_N


def _stages(dqk: int, dv: int, elt: int, block_n: int = BLOCK_N, block_m: int = BLOCK_M, extra: int = 0,
            v_elt: int | None = None) -> int:
    """``stages_for``, or ``LEANFA_HOPPER_STAGES`` (2-4) to measure other ring depths on the GPU.
    bf16 d128 gets 2 by default, but 3 fits (229,448 B of 232,448 B: no layout-conversion scratch is
    allocated; see scripts/hopper_compile_check.py)."""
    env = int(os.environ.get("LEANFA_HOPPER_STAGES", "0") or 0)
    return env if env in (2, 3, 4) else stages_for(dqk, dv, elt, block_n, block_m, extra, v_elt)


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, "1" if default else "0").strip() not in ("0", "", "false", "no")


#: Knobs (env, read at plan time): LEANFA_HOPPER_PERSISTENT (one program per SM looping over the tiles
#: heaviest first, see schedule.py; default: persistent_default), LEANFA_HOPPER_STORE_TMA (the output through
#: shared memory: dense by TMA, see store_tma; varlen by 16-byte stores, see store_staged; =0 neither), LEANFA_HOPPER_STAGES (ring depth, see _stages), LEANFA_HOPPER_TRACE=1
#: (each consumer warpgroup records SM clocks at the phases of its key loop into ``Plan.trace``, see trace.py
#: and scripts/hopper_trace.py; off: without it the PTX is unchanged), LEANFA_HOPPER_ABLATE (timing
#: ablations, see _ablation). Options measured not to pay were deleted (docs/perf-notes.md).


def _ablation() -> int:
    """``LEANFA_HOPPER_ABLATE`` (e.g. ``exp,max``): parts of the kernel left out to time what they
    cost (``exp``, ``max``: of the softmax; ``onewg``: every consumer warpgroup but 0), passed to
    the kernel as the sum of their bits, ``ABLATE`` (:data:`.ablation.ABLATE_BITS`). The answers are
    wrong: a warning says so on every plan."""
    names = [n.strip() for n in os.environ.get("LEANFA_HOPPER_ABLATE", "").split(",") if n.strip()]
    if not names:
        return 0
    unknown = sorted(set(names) - set(ABLATE_BITS))
    if unknown:
        raise ValueError(f"LEANFA_HOPPER_ABLATE: unknown parts {unknown} (known: {sorted(ABLATE_BITS)})")
    warnings.warn(f"LEANFA_HOPPER_ABLATE={','.join(names)}: a timing ablation, the results are wrong",
                  stacklevel=3)
    return sum({ABLATE_BITS[n] for n in names})


@dataclass
class Plan:
    args: tuple
    constexprs: dict
    grid: tuple
    trace: torch.Tensor | None = None  # the clock-trace buffer the launch fills (LEANFA_HOPPER_TRACE=1)
    template: object = None  # the plan_cache.Template this plan was bound from (None: built by make_plan)

    @property
    def kernel(self):
        return attn_fwd_pingpong_kernel


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, dtype: torch.dtype):
    """The shared-memory (TMA and wgmma) layout of a ``block`` box of ``dtype`` (computed once: it was
    ~5% of a call's host time, run 32)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _desc(t: torch.Tensor, shape, strides, block, layout_block=None):
    """A TMA descriptor of ``block`` boxes over ``t`` viewed as ``shape``/``strides``; its shared layout is that of
    ``layout_block`` boxes where given (a paged cache's page boxes land in the rows of a whole key block's slot)."""
    layout = _smem_layout(tuple(block if layout_block is None else layout_block), t.dtype)
    # a size-1 dim's stride is never used, but TMA wants every stride 16-byte aligned: give it the
    # tensor's span (a multiple of an aligned stride)
    span = max(st * n for st, n in zip(strides, shape))
    strides = [span if n == 1 else st for st, n in zip(strides[:-1], shape[:-1])] + [strides[-1]]
    return TensorDescriptor(t, shape, strides, block, layout)


#: paged K/V (``page_table``): page sizes the kernel reads, powers of two from 16 keys. A page of fewer keys than a
#: key block is one TMA box per page (a block of 128 keys spans 128 / page_size of them); a larger page holds whole
#: blocks (one box each). Other page sizes run on the portable kernel. An FP8 V cache is read from a dense transposed
#: copy of its pages made per call (:func:`prepare_v`, :func:`..paged_v.gather_paged_v`): the FP8 wgmma reads V
#: K-major; K and a 16-bit V are read from the caches.
MIN_PAGE_SIZE = 16


def paged_problem(page_size: int, v: torch.Tensor | None) -> str | None:
    """Why the kernel cannot read paged K/V caches of ``page_size`` keys per page with this V cache, or None
    (``v`` None: the page size alone, for a V the plan already prepared)."""
    if v is not None and v_is_kmajor(v):
        return "paged K/V: the Hopper kernel reads a V cache stored token-major (head dim contiguous)"
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
        return (f"paged K/V with page_size {page_size}: the Hopper kernel reads pages of a power of two from "
                f"{MIN_PAGE_SIZE} keys")
    return None


def as_bshd(t: torch.Tensor) -> torch.Tensor:
    """A packed varlen ``(total, H, D)`` tensor as a batch of one ``(1, total, H, D)``; dense as is."""
    return t.unsqueeze(0) if t.dim() == 3 else t


#: BF16 sink keys the kernel attends in 16 bits (:mod:`.sink`): exactly key block 0
SINK_KEYS = BLOCK_N
SINK_HEAD_DIMS = ((64, 64), (128, 128))  # one Q box per warpgroup; room for the sink's buffers


def _default_tile(sink_mode: int, dv: int) -> bool:
    """The tile the persistent grid and the TMA-store epilogue were built and measured for: no sink, head dim
    <= 128 (128-key blocks)."""
    return sink_mode == 0 and dv <= 128


#: 16-bit inputs through the TMA-store epilogue: the kernel code is the FP8 path's (dtype-generic); H200 run 53
#: checked it (``gpu_session.sh bf16_tma``: the full case set on the one-tile grid, the small one persistent,
#: d64/d128/MLA, memcheck and synccheck clean), and run 54 timed it (``short_time.py --dtype bf16``, d128
#: kernel alone, persistent + TMA store against the one-tile grid: 1.25x at S = 1K, 1.10x at 2K, 1.04x at 4K,
#: 1.01x at 16K). On by default where it was timed: BF16/FP16 head dim 128/128, persistent
#: (:func:`bf16_tma_default`); ``LEANFA_HOPPER_STORE_TMA=2`` extends it to head dim 64.
BF16_STORE_TMA_VALIDATED = True


def bf16_tma_default(dqk: int, dv: int) -> bool:
    """Whether a 16-bit call of these head dims takes the TMA-store epilogue and the persistent grid by default
    (where :data:`BF16_STORE_TMA_VALIDATED`'s timing was made)."""
    return BF16_STORE_TMA_VALIDATED and dqk == dv == 128


def store_tma(is_fp8: bool, varlen: bool, out: torch.Tensor, sink_mode: int, dqk: int = 128,
              mixed: bool = False) -> bool:
    """Whether the epilogue writes O through shared memory and TMA (:func:`.epilogue.stage_and_store`):
    dense FP8 calls with a 16-bit output of head dim <= 128 whose (B, H, S, D) view TMA can address, no sink
    (its buffers take that shared memory). ``LEANFA_HOPPER_STORE_TMA=0``: the register stores (128
    ``STG.E.U16`` per thread, ~2100-2900 cycles per tile against ~800; validated on the H200 in runs 46-48).
    BF16/FP16 calls at head dim 128 (:func:`bf16_tma_default`); ``=2``: at every head dim where the 64 x Dv output
    boxes fit next to Q and the two-slot ring (d64 too; not MLA's 192-wide Q). The mixed mode (FP8 Q/K, 16-bit V)
    as FP8, where the output boxes leave room for a ring of three K/V slots (d64, d128; MLA 192/128 keeps its
    third slot and the register stores). The mixed mode's choice is a prediction, not yet timed."""
    if not _flag("LEANFA_HOPPER_STORE_TMA", True):
        return False
    dv = out.shape[-1]
    if varlen or not _default_tile(sink_mode, dv):
        return False
    if mixed and _smem_bytes(dqk, dv, 1, 3, BLOCK_N, BLOCK_M, BLOCK_M * dv * 2, 2) > SMEM_LIMIT:
        return False  # Q, the output boxes and three K/V slots
    if not is_fp8:
        if not (bf16_tma_default(dqk, dv) or os.environ.get("LEANFA_HOPPER_STORE_TMA", "").strip() == "2"):
            return False
        if _smem_bytes(dqk, dv, 2, 2, BLOCK_N, BLOCK_M, BLOCK_M * dv * 2) > SMEM_LIMIT:
            return False  # Q, the output boxes and two K/V slots
    if out.dtype not in (torch.bfloat16, torch.float16):
        return False
    return tma_layout_problem("out", out, *_bshd_as_bhsd(out)) is None


def store_staged(varlen: bool, out: torch.Tensor, sink_mode: int, dqk: int, q_elt: int, v_elt: int) -> bool:
    """Whether a varlen call's epilogue stages O in shared memory and copies it out 16 bytes per thread with the row
    mask (:func:`.epilogue.stage_and_copy`; a TMA box would cross into the next sequence's rows): head dim <= 128, no
    sink, where the two 64 x Dv buffers fit next to Q and a two-slot ring. ``LEANFA_HOPPER_STORE_TMA=0`` keeps
    the register stores here too."""
    dv = out.shape[-1]
    if not varlen or not _flag("LEANFA_HOPPER_STORE_TMA", True) or not _default_tile(sink_mode, dv):
        return False
    return _smem_bytes(dqk, dv, q_elt, 2, BLOCK_N, BLOCK_M, BLOCK_M * dv * out.element_size(), v_elt) <= SMEM_LIMIT


def persistent_default(is_fp8: bool, sink_mode: int, dv: int, has_kmean: bool = False,
                       dqk: int = 128, fp8_softcap: bool = False) -> bool:
    """Whether the kernel runs one program per SM by default (``LEANFA_HOPPER_PERSISTENT`` overrides): FP8 of head dim
    <= 128 without the sink (dense, where the TMA-store epilogue applies, and varlen). With it and the Q box
    handed back after the last QK, a tile's fill + epilogue + turnover fell from ~9,000 to ~1,800-2,400
    cycles at S = 1K-4K (run 46's trace), and the kernel alone (run 48, ``scripts/short_time.py``) ran
    1.38x / 1.35x the one-tile grid at S = 1K (d128 / MLA), 1.25x / 1.20x at 2K, 1.08x / 1.03x at 4K and
    1.01x / 0.98x at 16K. BF16 at head dim 128/128 too, dense with its TMA-store epilogue
    (:func:`bf16_tma_default`). Varlen too, with register stores (a 64-row output box can cross into the next
    sequence's rows), walking the tile table (:mod:`.varlen_tiles`): H200 run 76, five serving batches on Llama-3-8B
    heads, BF16 kernel alone 1.01-1.28x the table's one-program-per-slot grid (FP8 1.00-1.34x). The sink, head
    dim 256, MLA and d64 BF16, the LSE with a smoothed K (its K-mean term reads Q in the epilogue, so Q is handed
    back late, and AOT spills grow to 440-700 B) keep the one-tile grid. The mixed mode (``is_fp8``: FP8 Q/K with
    a 16-bit V) takes the FP8 choice (a prediction, not yet timed). ``fp8_softcap`` (softcap with FP8 P.V) keeps the
    one-tile grid too: its persistent sm90 build spills 512-1028 B around the key loop (none inside it), the one-tile
    build 0-16 B (docs/perf-notes.md, "softcap on the Hopper kernel")."""
    case = is_fp8 or bf16_tma_default(dqk, dv)
    return case and _default_tile(sink_mode, dv) and not has_kmean and not fp8_softcap


def sink_problem(is_fp8: bool, dims: tuple, sink_keys: int, tensors=()) -> str | None:
    """Why the kernel cannot attend these BF16 sink keys itself, or None (``tensors``: the 16-bit
    ``(name, tensor)`` pairs it would read through TMA)."""
    if not is_fp8:
        return "BF16 sink keys run in the Hopper kernel's FP8 calls only"
    if sink_keys != SINK_KEYS:
        return f"the Hopper kernel attends exactly {SINK_KEYS} BF16 sink keys (got {sink_keys})"
    if dims not in SINK_HEAD_DIMS:
        return f"BF16 sink keys in the Hopper kernel: head dims 64/64 and 128/128 only (got {dims[0]}/{dims[1]})"
    for name, t in tensors:
        t = as_bshd(t)
        if t.dtype not in (torch.bfloat16, torch.float16):
            return f"sink {name} must be bf16/fp16, got {t.dtype}"
        why = tma_layout_problem(f"sink {name}", t, *_bshd_as_bhsd(t))
        if why:
            return why
    return None


def _sink_descs(sink, q_rows: int, block_n: int):
    """``(descriptors, shared-memory bytes)`` of the BF16 sink keys' Q, K and V (token-major) boxes."""
    sq, sk, sv = (as_bshd(t) for t in sink[1:])
    dqk, dv = sq.shape[3], sv.shape[3]
    descs = (_desc(sq, *_bshd_as_bhsd(sq), [1, 1, q_rows, dqk]), _desc(sk, *_bshd_as_bhsd(sk), [1, 1, block_n, dqk]),
             _desc(sv, *_bshd_as_bhsd(sv), [1, 1, block_n, dv]))
    return descs, (2 * q_rows * dqk + block_n * (dqk + dv)) * sq.element_size()


def prepare_v(q: torch.Tensor, v: torch.Tensor, cu_seqlens_k=None, max_seqlen_k=None, cu_seqlens_v=None,
              page_table=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The V the kernel reads, and the varlen FP8 sequence starts ``cu_seqlens_v`` (else None): the FP8 wgmma
    reads V K-major (tokens innermost), 16-byte aligned. A packed FP8 V in :func:`leanfa.quantize_fp8`'s
    aligned layout (``cu_seqlens_v`` given) is read as it is; any other FP8 varlen V is re-packed into that
    layout (:func:`align_varlen_v`), a dense token-major one transposed (:func:`transpose_fp8_v`) and a paged FP8 V
    cache (``page_table``) gathered into a dense transposed ``(B, Hkv, Dv, max_pages * page_size)`` copy
    (:func:`gather_paged_v`; ``cu_seqlens_k``: the key lengths, varlen), one copy per call. A 16-bit V (16-bit
    calls, and the mixed mode's FP8 Q/K with a 16-bit V) is read as it is, a paged one from its cache."""
    if v.dtype != torch.float8_e4m3fn:
        return v, None
    if page_table is not None:
        return gather_paged_v(v, page_table, cu_seqlens_k), None
    if cu_seqlens_v is not None:
        return v, cu_seqlens_v
    if cu_seqlens_k is not None:
        return align_varlen_v(v, cu_seqlens_k, max_seqlen_k)
    return (v, None) if v_is_kmajor(v) else (transpose_fp8_v(v), None)


def paged_key_offsets(page_table: torch.Tensor, page_size: int, cu_seqlens_k=None, seqused_k=None) -> torch.Tensor:
    """Int32 ``(batch + 1)`` prefix sums of a paged call's key lengths: each sequence's table-row capacity
    (``max_pages * page_size``), or its ``cu_seqlens_k`` length, cut by FA3's ``seqused_k``. Made on the device (no
    host sync on the lengths). A paged call reads only lengths from ``cu_seqlens_k`` (its keys come through the page
    table: the starts are unused), so these offsets stand in for it in the kernel, the tile table and the FP8 V
    gather."""
    batch, max_pages = page_table.shape
    if cu_seqlens_k is not None:
        lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    else:
        lengths = torch.full((batch,), max_pages * page_size, dtype=torch.int32, device=page_table.device)
    if seqused_k is not None:
        lengths = torch.minimum(lengths, seqused_k)
    offsets = torch.zeros(batch + 1, dtype=torch.int32, device=page_table.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def paged_keys(page_table, page_size: int, varlen: bool, cu_seqlens_k=None, seqused_k=None):
    """``(cu_seqlens_k, seqused_k)`` as a paged call's kernel reads them: where ``seqused_k`` is given, or packed
    queries come without ``cu_seqlens_k`` (vLLM's call), the lengths as :func:`paged_key_offsets` (varlen: in place of
    both; dense: for the FP8 V gather, the kernel keeps ``seqused_k``); else as given."""
    if page_table is None or not (seqused_k is not None or (varlen and cu_seqlens_k is None)):
        return cu_seqlens_k, seqused_k
    offsets = paged_key_offsets(page_table, page_size, cu_seqlens_k, seqused_k)
    return offsets, None if varlen else seqused_k


def window_bounds(causal: bool, window: tuple[int, int], max_seqlen_q: int, max_seqlen_k: int
                  ) -> tuple[int, int] | None:
    """The kernel's ``(window_left, window_right)`` for flash-attn's ``window_size`` as :class:`leanfa.problem.Problem`
    stores it (``-1``: unbounded; ``causal`` is a right side of 0), or None without a window: both sides >= 0, an
    unbounded one as a bound past every key of every sequence (left ``max_seqlen_k``, right ``max_seqlen_q``: query
    ``i`` sits at key ``i + Sk - Sq``), so the kernel's band needs no case for it (:mod:`.masking`)."""
    left, right = window
    if left < 0 and right < 0:
        return None
    if causal:
        right = 0
    return (left if left >= 0 else max(int(max_seqlen_k), 1), right if right >= 0 else max(int(max_seqlen_q), 1))


def make_plan(q, k, v, out, lse, q_scale, k_scale, v_scale, k_mean, *, causal: bool,
              softmax_scale: float, return_lse: bool, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, sink=None,
              prepared_v=None, tile_table=None, cu_seqlens_v=None, page_table=None, window=(-1, -1),
              softcap: float = 0.0, seqused_k=None, seqused_q=None) -> Plan:
    """Kernel arguments for dense (B, S, H, D) tensors (``out`` (B, Sq, Hq, Dv)), or packed varlen
    (total, H, D) ones with ``cu_seqlens_*`` / ``max_seqlen_*`` (``out`` (total_q, Hq, Dv)).
    ``sink``: ``(sink_keys, q16, k16, v16)``, FP8 with the first keys attended from the 16-bit inputs
    (:mod:`.sink`; :func:`sink_problem` says what is supported). ``prepared_v``: :func:`prepare_v`'s result
    when the caller made it (``v`` is then unused); else it is made here (``cu_seqlens_v``: a packed FP8 V in
    :func:`leanfa.quantize_fp8`'s aligned layout). ``tile_table``: varlen, the call's
    :func:`.varlen_tiles.build` (made here when not given). ``page_table``: paged K/V, ``k``/``v`` the caches
    ``(num_pages, page_size, Hkv, D)`` and ``page_table`` int32 ``(B, max_pages)`` (:func:`paged_problem` says which
    caches; an FP8 V cache is read from :func:`prepare_v`'s transposed copy of its pages); varlen, ``cu_seqlens_k``
    gives the key lengths; dense, every sequence has ``max_pages * page_size``.
    ``window``: flash-attn's ``window_size`` as :class:`leanfa.problem.Problem` normalizes it (:func:`window_bounds`;
    not with ``sink``). ``softcap > 0``: flash-attn's score capping (the kernel's ``SOFTCAP``: 2 with ``k_mean``, whose
    ``q . mean`` goes inside tanh's argument instead of the LSE; not with ``sink``).
    ``seqused_k``: FA3's int32 ``(batch,)``, sequence ``b``'s first ``seqused_k[b]`` keys only (the kernel's
    ``seqused_k``; a paged call's key lengths read as :func:`paged_keys` makes them). Paged with packed queries and no
    ``cu_seqlens_k`` (vLLM's call): each sequence has the table's capacity, cut by ``seqused_k``. ``seqused_q``: FA3's
    int32 ``(batch,)``, sequence ``b``'s first ``seqused_q[b]`` query rows only attend (causal alignment on that
    count); the kernel writes the rows past it as 0 with LSE ``-inf``."""
    varlen = cu_seqlens_q is not None
    if page_table is not None:
        why = paged_problem(k.shape[1], v if prepared_v is None else None)
        if why:
            raise ValueError(why)
        if prepared_v is None or varlen:  # (a dense call's offsets serve the FP8 V gather alone)
            cu_seqlens_k, seqused_k = paged_keys(page_table, k.shape[1], varlen, cu_seqlens_k, seqused_k)
    v, cu_seqlens_v = (prepared_v if prepared_v is not None
                       else prepare_v(q, v, cu_seqlens_k, max_seqlen_k, cu_seqlens_v, page_table))
    q, k, v = as_bshd(q), as_bshd(k), as_bshd(v)
    B, Sq, Hq, Dqk = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    total_q = q.shape[1]  # (varlen: the packed tokens, viewed as a batch of one)
    if varlen:
        B, Sq, Sk = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), int(max_seqlen_k)
    elif page_table is not None:  # dense: every sequence has the table's capacity
        Sk = page_table.shape[1] * k.shape[1]
    bounds = window_bounds(causal, window, Sq, Sk)  # (None: no window)
    if bounds is not None and sink is not None:
        raise ValueError("window_size: the Hopper kernel does not combine sliding windows with BF16 sink keys")
    if softcap > 0 and sink is not None:
        raise ValueError("softcap: the Hopper kernel does not combine softcap with BF16 sink keys")
    is_fp8 = q.dtype == torch.float8_e4m3fn  # the QK side ...
    pv_fp8 = v.dtype == torch.float8_e4m3fn  # ... and the PV side: the mixed mode has FP8 Q/K and a 16-bit V
    mixed = is_fp8 and not pv_fp8
    kmajor = v_is_kmajor(v)
    dchunk = qk_chunk(Dqk)
    block_n = _block_n(pv_fp8, Dv)  # (the PV side's registers decide the key block at head dim 256)
    block_m = BLOCK_M  # query rows per tile
    q_rows = 64  # one 64-row Q box per consumer warpgroup
    q_desc = _desc(q, *_bshd_as_bhsd(q), [1, 1, q_rows, dchunk])
    kv_boxes = 1
    if page_table is not None:  # over the caches as [page, head, row, dim], in boxes of at most a page
        page_box = min(k.shape[1], block_n)
        kv_boxes = block_n // page_box
        k_desc = _desc(k, *_bshd_as_bhsd(k), [1, 1, page_box, dchunk], [1, 1, block_n, dchunk])
        if kmajor:  # FP8 V: its pages' dense transposed copy (prepare_v), one box per block
            v_desc = _desc(v, *_v_kmajor_dims(v), [1, 1, Dv, block_n])
        else:
            v_desc = _desc(v, *_bshd_as_bhsd(v), [1, 1, page_box, Dv], [1, 1, block_n, Dv])
    else:
        k_desc = _desc(k, *_bshd_as_bhsd(k), [1, 1, block_n, dchunk])
        if kmajor:
            v_desc = _desc(v, *_v_kmajor_dims(v), [1, 1, Dv, block_n])
        else:
            v_desc = _desc(v, *_bshd_as_bhsd(v), [1, 1, block_n, Dv])
    num_m_tiles = triton_cdiv(Sq, block_m)
    # the kernel reads table[b, h, token // 128] for every Q tile / key block: a table must have one
    # entry per 128-token block, or a single broadcast one (stride 0, see scales.broadcast_strides)
    for name, t, n in (("q_scale", q_scale, triton_cdiv(Sq, SCALE_BLOCK)), ("k_scale", k_scale, triton_cdiv(Sk, SCALE_BLOCK))):
        if t.shape[2] not in (1, n):
            raise ValueError(f"{name} table has {t.shape[2]} blocks, expected 1 or {n}")
    sink_mode, sink_descs, sink_bytes = 0, (None, None, None), 0
    if sink is not None:
        why = sink_problem(pv_fp8, (Dqk, Dv), sink[0],
                           (("q", sink[1]), ("k", sink[2]), ("v", sink[3])))
        if why:
            raise ValueError(why)
        sink_descs, sink_bytes = _sink_descs(sink, q_rows, block_n)
        sink_mode = 2 if k_mean is not None else 1  # 2: K was smoothed, the sink's scores shift by q . mean
    has_kmean = k_mean is not None and return_lse and not softcap > 0  # (softcap: inside the scores)
    cap_mode = (2 if k_mean is not None else 1) if softcap > 0 else 0  # (the kernel's SOFTCAP)
    o_tma = store_tma(is_fp8, varlen, out, sink_mode, Dqk, mixed)
    out_desc = _desc(out, *_bshd_as_bhsd(out), [1, 1, 64, Dv]) if o_tma else None
    o_staged = not o_tma and store_staged(varlen, out, sink_mode, Dqk, q.element_size(), v.element_size())
    out_bytes = block_m * Dv * out.element_size() if o_tma or o_staged else 0
    km = k_mean if has_kmean or sink_mode == 2 or cap_mode == 2 else v_scale  # any float32 pointer; unused
    if varlen:  # out (total_q, Hq, Dv): sequence b's rows start at token cu_seqlens_q[b]
        out_strides = (0, out.stride(0), out.stride(1))
    else:
        out_strides = (out.stride(0), out.stride(1), out.stride(2))
    args = (
        q_desc, k_desc, v_desc,
        out, *out_strides,
        lse if lse is not None else v_scale,
        q_scale, *broadcast_strides(q_scale),
        k_scale, *broadcast_strides(k_scale),
        v_scale, *broadcast_strides(v_scale),
        km, *broadcast_strides(km),
        Sq, Sk, Hq, Hq // Hkv, num_m_tiles,
        float(softmax_scale / softcap if cap_mode else softmax_scale * LOG2E), float(softmax_scale),
        *(bounds or (0, 0)),
    )
    args += (B * Hq, )
    tiles = B * Hq * num_m_tiles
    if varlen:  # lse (Hq, total_q)
        lse_strides = (0, lse.stride(0)) if lse is not None else (0, 0)
        if tile_table is None:
            tile_table = varlen_tiles.build(cu_seqlens_q, cu_seqlens_k, total_q, Sk, causal, block_m, window,
                                            seqused_k)
        tiles = varlen_tiles.capacity(total_q, B, block_m) * Hq  # (from the shapes alone: CUDA-graph safe)
        args += (cu_seqlens_q, cu_seqlens_k, tile_table, *lse_strides)
    else:  # lse (B, Hq, Sq); the cu_seqlens and tile-table pointers are unused
        args += (v_scale, v_scale, v_scale, Hq * Sq, Sq)
    trace = trace_buffer(B * Hq * num_m_tiles, q.device) if _flag("LEANFA_HOPPER_TRACE", False) else None
    pages = (page_table, *page_table.stride()) if page_table is not None else (None, None, None)
    args += (trace, cu_seqlens_v, *pages, *sink_descs, out_desc, float(softcap), seqused_k, seqused_q)
    persistent = _flag("LEANFA_HOPPER_PERSISTENT", persistent_default(is_fp8, sink_mode, Dv, has_kmean, Dqk,
                                                                       cap_mode > 0 and pv_fp8))
    constexprs = dict(
        HEAD_DQK=Dqk, HEAD_DV=Dv, CAUSAL=bool(causal) and bounds is None, IS_FP8=is_fp8, V_KMAJOR=kmajor,
        RETURN_LSE=bool(return_lse), HAS_KMEAN=has_kmean,
        STAGES=_stages(Dqk, Dv, q.element_size(), block_n, block_m, sink_bytes + out_bytes, v.element_size()),
        num_warps=WG_WARPS,
        ABLATE=_ablation(), PV_IN_MMA=wide_head(Dv),
        PERSISTENT=persistent, VARLEN=varlen, SINK=sink_mode, STORE_TMA=o_tma, MIXED=mixed, STORE_STAGED=o_staged,
        PAGE_SIZE=k.shape[1] if page_table is not None else 0, KV_BOXES=kv_boxes,
        WINDOW=bounds is not None,  # (a window's band holds the causal side too: CAUSAL is off)
        SOFTCAP=cap_mode,
    )
    if persistent:  # one program per SM (one CTA fits an SM: > 114 KB of shared memory)
        grid = (max(min(tiles, _num_sms(q.device)), 1), )
    elif varlen:  # one program per table slot (schedule.program_tiles: 1-D, the table's order)
        grid = (max(tiles, 1), )
    else:
        grid = (B * Hq, num_m_tiles)
    return Plan(args, constexprs, grid, trace)


def trace_buffer(tiles: int, device, wgs: int = BLOCK_M // 64) -> torch.Tensor:
    """The int32 clock-trace buffer of ``LEANFA_HOPPER_TRACE=1`` (:mod:`.trace`): one record per tile and
    consumer warpgroup, poisoned with -1 (a block or tile never written reads as -1)."""
    return torch.full((tiles, wgs, 1 + TRACE_BLOCKS.value, TRACE_EVENTS.value), -1, dtype=torch.int32, device=device)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; on the CPU (the emulator) 3, so that its programs
    each run several tiles."""
    if device.type != "cuda":
        return 3
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch(plan: Plan) -> None:
    """Launch through Triton; a plan bound from a :class:`.plan_cache.Template` launches the template's
    compiled kernel directly once one launch has compiled it."""
    t = plan.template
    if t is not None and t.launch(plan):
        return
    c = dict(plan.constexprs)
    num_warps = c.pop("num_warps")
    compiled = plan.kernel[plan.grid](*plan.args, **c, num_warps=num_warps)
    if t is not None and compiled is not None:
        t.keep(compiled, plan.kernel, plan.constexprs)
