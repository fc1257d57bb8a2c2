"""Descale arguments: parse the user's forms into one table layout the kernels index.

A Q or K descale multiplies the stored FP8 value back to its real value. leanfa accepts
(``S`` is the sequence length, ``max_seqlen`` for varlen):

* ``None``                      -> 1.0 (plain FP8 values, or a BF16/FP16 input)
* a tensor with one element      -> one scale for the whole tensor
* ``(B, Hkv)``                   -> one scale per batch and KV head (the flash-attn 3 convention,
                                    also for ``q_descale``: the query heads of a group share it)
* ``(B, H, ceil(S / 128))``      -> one scale per block of ``SCALE_BLOCK`` tokens of each head,
                                    counted from the start of each sequence (what
                                    :func:`leanfa.quantize_fp8` writes); ``H`` is Hq for Q and
                                    Hkv for K. ``(B, Hq)`` is also accepted for ``q_descale``.

A V descale is ``None``, one element, ``(B, Hkv)`` or ``(B, Hkv, Dv)`` (per channel).

Every form becomes a float32 *table* ``(B, H, nblk)`` (possibly an expanded view with zero
strides) that the kernels read as ``table[b, h, token // SCALE_BLOCK]``; a V descale becomes
``(B, Hkv, Dv)``. Nothing here reads tensor values, so parsing never synchronizes the GPU.
"""

from __future__ import annotations

import torch

#: tokens per scale block for per-block Q/K scales (a multiple of every kernel's key tile)
SCALE_BLOCK = 128


_UNIT: dict = {}


def _unit(device: torch.device) -> torch.Tensor:
    """A float32 one ``(1, 1, 1)`` on ``device``, made once per device and never written: a missing descale's
    table is a broadcast view of it, so a call launches no fill kernel for it. Not kept when made while a CUDA
    graph is being captured (its fill would run only when the graph replays); neither kept nor used while
    torch.compile traces or fake tensors are active (a real tensor would enter a fake computation)."""
    if torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return torch.ones((1, 1, 1), dtype=torch.float32, device=device)
    t = _UNIT.get(device)
    if t is None:
        t = torch.ones((1, 1, 1), dtype=torch.float32, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _UNIT[device] = t
    return t


def num_scale_blocks(seqlen: int) -> int:
    return max(1, -(-seqlen // SCALE_BLOCK))


def broadcast_strides(table: torch.Tensor) -> tuple[int, ...]:
    """Strides of a scale/mean table as a kernel must index it: 0 along every size-1 dim.

    Tables built here are often views of a smaller tensor (``None``, a scalar or a ``(B, H)``
    descale becomes ``(B, H, 1)``), and expand/unsqueeze keep a nonzero stride on a size-1 dim.
    Kernels read ``table[b, h, token // SCALE_BLOCK]`` for every block; with that stride they
    would read past the table for block >= 1 (the Hopper kernel's NaN-for-Sk>128 bug on
    2026-11-29). A size-1 dim is a broadcast, so its stride is 0.
    """
    return tuple(0 if n == 1 else st for n, st in zip(table.shape, table.stride()))


def _check_tensor(name: str, desc: torch.Tensor, device: torch.device) -> None:
    if not isinstance(desc, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(desc).__name__}")
    if desc.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {desc.dtype}")
    if desc.device != device:
        raise ValueError(f"{name} is on {desc.device} but q is on {device}")


def token_scale_table(
    name: str,
    desc: torch.Tensor | None,
    *,
    batch: int,
    heads: int,
    kv_heads: int,
    max_seqlen: int,
    device: torch.device,
) -> torch.Tensor:
    """Return a float32 ``(batch, heads, nblk)`` table for a Q (heads=Hq) or K (heads=Hkv) descale."""
    if desc is None:
        return _unit(device).expand(batch, heads, 1)
    _check_tensor(name, desc, device)
    nblk = num_scale_blocks(max_seqlen)
    if desc.numel() == 1 and desc.dim() <= 1 or (desc.dim() == 0):
        return desc.reshape(1, 1, 1).expand(batch, heads, 1)
    if desc.dim() == 2:
        if desc.shape == (batch, kv_heads):
            group = heads // kv_heads
            if group == 1:
                return desc.unsqueeze(-1)
            return desc.repeat_interleave(group, dim=1).unsqueeze(-1)
        if desc.shape == (batch, heads):
            return desc.unsqueeze(-1)
        raise ValueError(
            f"{name} has shape {tuple(desc.shape)}; a per-head descale must be "
            f"(batch, kv_heads) = ({batch}, {kv_heads})"
            + (f" or (batch, heads) = ({batch}, {heads})" if heads != kv_heads else "")
        )
    if desc.dim() == 3:
        if desc.shape != (batch, heads, nblk):
            raise ValueError(
                f"{name} has shape {tuple(desc.shape)}; a per-block descale must be "
                f"(batch, heads, ceil(seqlen/{SCALE_BLOCK})) = ({batch}, {heads}, {nblk})"
            )
        return desc
    raise ValueError(
        f"{name} must be a 1-element tensor, (batch, kv_heads) or (batch, heads, nblocks); "
        f"got shape {tuple(desc.shape)}"
    )


def channel_scale_table(
    name: str,
    desc: torch.Tensor | None,
    *,
    batch: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> torch.Tensor:
    """Return a float32 ``(batch, kv_heads, head_dim)`` table for the V descale."""
    if desc is None:
        return _unit(device).expand(batch, kv_heads, head_dim)
    _check_tensor(name, desc, device)
    if desc.dim() == 0 or (desc.dim() == 1 and desc.numel() == 1):
        return desc.reshape(1, 1, 1).expand(batch, kv_heads, head_dim)
    if desc.dim() == 2 and desc.shape == (batch, kv_heads):
        return desc.unsqueeze(-1).expand(batch, kv_heads, head_dim)
    if desc.dim() == 3 and desc.shape == (batch, kv_heads, head_dim):
        return desc
    raise ValueError(
        f"{name} has shape {tuple(desc.shape)}; expected a 1-element tensor, "
        f"(batch, kv_heads) = ({batch}, {kv_heads}) or (batch, kv_heads, head_dim_v) = "
        f"({batch}, {kv_heads}, {head_dim})"
    )
