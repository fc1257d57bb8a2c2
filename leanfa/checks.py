"""Argument checks shared by the public functions (:mod:`leanfa.api`) and the quantizer
(:mod:`leanfa.quant`): the device, the ``cu_seqlens`` of a packed batch, ``seqused_q/k``,
a paged K/V cache's page table, ``window_size`` and ``softcap``, ``attention_chunk``, ``qv``, ``softmax_scale``.

They raise ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, device, value)
naming the argument, and read tensor values only on CPU tensors (never synchronize the GPU).
"""

from __future__ import annotations

import math
import operator
import os

import torch

from .kernels.device import capability
from .problem import KEY_TILES, page_size_supported


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_fp8_device(device: torch.device) -> None:
    """float8_e4m3fn kernels need an sm89+ GPU (Ada, Hopper, ...): Triton rejects the type on
    older GPUs, so say so before any launch instead of failing inside the compiler."""
    if device.type == "cuda" and torch.version.hip is None:
        cap = capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"FP8 (float8_e4m3fn) attention needs an NVIDIA GPU of compute capability 8.9 or "
                f"newer; {device} is sm{cap[0]}{cap[1]}. Use precision='bf16' (or bf16/fp16 inputs)."
            )


def check_device(q: torch.Tensor) -> None:
    """leanfa's kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    if q.device.type == "cpu":
        if not interpreter_enabled():
            raise ValueError(
                "q is a CPU tensor; leanfa runs on CUDA tensors (or on the CPU under "
                "TRITON_INTERPRET=1, for tests)"
            )
    elif q.device.type != "cuda":
        raise ValueError(f"q is on {q.device}; leanfa needs CUDA tensors")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int | None, max_name: str, max_seqlen: int, device):
    """flash-attn's ``cu_seqlens``: int32 ``(batch + 1,)`` on ``device``, starting at 0, non-decreasing, ending at
    ``total`` tokens (not checked with ``total`` None: the keys of a paged cache), no length above ``max_seqlen``
    (values checked on CPU tensors only)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (flash-attn convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch+1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    # 0 is allowed (a batch whose sequences are all empty, as FlashAttention-3 accepts)
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise ValueError(f"{max_name} must be a non-negative int, got {max_seqlen!r}")
    # Values are checked only on the CPU path (a GPU check would synchronize), and not while
    # torch.compile traces (reading values would break the graph).
    if cu.device.type == "cpu" and not torch.compiler.is_compiling():
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0:
            raise ValueError(f"{name}[0] must be 0, got {int(cu[0])}")
        if bool((lengths < 0).any()):
            raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
        if total is not None and int(cu[-1]) != total:
            raise ValueError(f"{name}[-1] = {int(cu[-1])} must equal the number of tokens ({total})")
        if lengths.numel() and int(lengths.max()) > max_seqlen:
            raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence ({int(lengths.max())})")


def check_seqused(name: str, used, batch: int, slot_lengths, device) -> None:
    """FA3's ``seqused_q``/``seqused_k``: None, or an int32 ``(batch,)`` tensor on ``device`` whose
    entries lie in ``[0, slot length]`` (``slot_lengths``: the sequences' lengths, a tensor, or an int
    for dense inputs). Values are checked on CPU tensors only (as ``cu_seqlens``)."""
    if used is None:
        return
    if not isinstance(used, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(used).__name__}")
    if used.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (FlashAttention-3 convention), got {used.dtype}")
    if used.dim() != 1 or used.numel() != batch:
        raise ValueError(f"{name} must be 1-D with one entry per sequence ({batch}), got shape {tuple(used.shape)}")
    if used.device != device:
        raise ValueError(f"{name} is on {used.device} but q is on {device}")
    if used.device.type == "cpu" and not torch.compiler.is_compiling() and batch:
        if bool((used < 0).any()) or bool((used > slot_lengths).any()):
            raise ValueError(f"{name} must lie in [0, the sequence's length], got {used.tolist()}")


def check_page_table(page_table, batch: int, k: torch.Tensor, v: torch.Tensor, device) -> int:
    """A paged K/V cache: ``k``/``v`` ``(num_pages, page_size, Hkv, D)`` with ``page_size`` in
    :func:`leanfa.problem.page_size_supported` (1, 2, 4, 8, 16, 32, 64 or a multiple of 128), ``page_table`` int32 ``(batch, max_pages_per_seq)`` on ``device``. Returns the
    capacity of a sequence, ``max_pages_per_seq * page_size`` keys. Page ids are checked to lie in
    ``[0, num_pages)`` on CPU tensors only: on the GPU that check would synchronize, so the caller guarantees them
    (an id out of range reads outside the cache)."""
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"page_table must be a torch.Tensor or None, got {type(page_table).__name__}")
    if page_table.dtype != torch.int32:
        raise TypeError(f"page_table (block_table) must be int32 (flash-attn convention), got {page_table.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table (block_table) must have shape (batch, max_pages_per_seq) with batch {batch}, "
                         f"got {tuple(page_table.shape)}")
    if page_table.device != device:
        raise ValueError(f"page_table (block_table) is on {page_table.device} but q is on {device}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"with a page_table, {name} must be a paged cache (num_pages, page_size, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"the paged k and v caches must have the same (num_pages, page_size), got "
                         f"{tuple(k.shape[:2])} and {tuple(v.shape[:2])}")
    page_size = k.shape[1]
    if not page_size_supported(page_size):
        raise ValueError(f"page size {page_size} (k.shape[1] of a paged cache) is not supported: a page size must "
                         f"divide each key tile of the kernel ({', '.join(map(str, KEY_TILES))} keys) or be a multiple "
                         f"of it (1, 2, 4, 8, 16, 32, 64, or a multiple of 128)")
    return page_table.shape[1] * page_size


def check_page_ids(page_table: torch.Tensor, num_pages: int, page_size: int, key_lengths) -> None:
    """The pages a paged call reads: sequence ``b``'s first ``ceil(key_lengths[b] / page_size)`` entries of
    ``page_table`` lie in ``[0, num_pages)`` and its keys fit its row of the table (entries past a sequence's keys
    are not read and may hold anything). ``key_lengths``: a CPU tensor ``(batch,)``, or an int for every sequence.
    Values are read on CPU tensors only (as ``cu_seqlens``): on the GPU the caller guarantees them."""
    if page_table.device.type != "cpu" or torch.compiler.is_compiling() or not page_table.numel():
        return
    batch, width = page_table.shape
    lengths = torch.as_tensor(key_lengths, dtype=torch.int64).expand(batch)
    if bool((lengths > width * page_size).any()):
        raise ValueError(f"a sequence has more keys ({int(lengths.max())}) than its page_table row holds "
                         f"({width} pages of {page_size})")
    used = torch.arange(width)[None, :] < ((lengths + page_size - 1) // page_size)[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bool(bad.any()):
        raise ValueError(f"page_table (block_table) entries a sequence reads must lie in [0, num_pages = {num_pages}), "
                         f"got {page_table[bad].tolist()[:8]}")


def check_window_softcap(window_size, softcap) -> tuple[int, int, float]:
    """flash-attn's ``window_size=(left, right)`` (each side a non-negative int, or -1 for unbounded; a CPU integer
    tensor of two elements too, as FA3 takes it) and ``softcap`` (a finite float >= 0; 0 is off): returns
    ``(left, right, softcap)`` as Python numbers."""
    if isinstance(window_size, torch.Tensor):
        if window_size.device.type != "cpu":  # (its values would need a host synchronization)
            raise TypeError(f"window_size must be ints or a CPU tensor, got a tensor on {window_size.device}")
        if window_size.dtype.is_floating_point or window_size.dtype == torch.bool or window_size.shape != (2,):
            raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
        window_size = tuple(window_size.tolist())
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    sides = []
    for side, w in zip(("left", "right"), window_size):
        w = _as_int(w, f"window_size {side}")
        if w < -1:
            raise ValueError(f"window_size must be (left, right) with each side >= 0, or -1 for no limit on that "
                             f"side; got {tuple(window_size)} ({side} {w} < -1)")
        sides.append(w)
    if isinstance(softcap, (bool, torch.Tensor)) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a Python float, got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 turns it off), got {softcap}")
    return sides[0], sides[1], float(softcap)


def _as_int(value, what: str) -> int:
    """``value`` as a Python int (any integer type, a 0-d integer tensor included), else ``TypeError`` naming
    ``what``; a bool is refused."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


def check_attention_chunk(attention_chunk) -> int:
    """FA3's ``attention_chunk``: an int >= 0 (0 is off); returns it as a Python int."""
    chunk = _as_int(attention_chunk, "attention_chunk")
    if chunk < 0:
        raise ValueError(f"attention_chunk must be >= 0 (0 turns chunked attention off), got {chunk}")
    return chunk


def check_qv(qv, q: torch.Tensor, head_dim_v: int) -> None:
    """FA3's ``qv``: None, or a tensor of ``q``'s shape with the last axis ``head_dim_v`` (``(B, Sq, Hq, Dv)``, packed
    ``(total_q, Hq, Dv)``), ``q``'s dtype (FP8 with an FP8 ``q``: it shares q's descale) and device; else
    ``ValueError``."""
    if qv is None:
        return
    if not isinstance(qv, torch.Tensor):
        raise ValueError(f"qv must be a torch.Tensor or None, got {type(qv).__name__}")
    want = (*q.shape[:-1], head_dim_v)
    if tuple(qv.shape) != want:
        raise ValueError(f"qv must have q's shape with v's head dim, {want}, got {tuple(qv.shape)}")
    if qv.dtype != q.dtype:
        raise ValueError(f"qv must have q's dtype ({q.dtype}; an FP8 qv shares q_descale), got {qv.dtype}")
    if qv.device != q.device:
        raise ValueError(f"qv is on {qv.device} but q is on {q.device}")


def resolve_softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (torch.Tensor, bool)) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a Python float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive float, got {softmax_scale}")
    return float(softmax_scale)
