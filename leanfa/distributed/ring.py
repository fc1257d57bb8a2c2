"""Moving one rank's K/V block to the next rank around a ring, with ``torch.distributed`` P2P.

A block is a list of tensors (BF16 K and V; or FP8 K and V with their descales) packed into one byte
buffer, so a ring step is one send and one receive. Packing keeps each tensor's strides and copies its
storage *span* (from its first to its last element), so a tensor whose layout matters is moved as it
is: leanfa's FP8 V is a ``(B, S, H, D)`` view of transposed ``(B, H, D, S_padded)`` storage, and
``.contiguous()`` would re-layout it into the form the kernel cannot use. Callers pass compact
tensors (span about the tensor's size): a strided view into a larger buffer would move the buffer.

:class:`Ring` posts a step's send (to rank ``r+1``) and receive (from rank ``r-1``) with
``batch_isend_irecv``. On CUDA it does so on a side stream, so the transfer overlaps the attention the
caller runs meanwhile on its own stream; :meth:`Ring.finish` makes the caller's stream wait for it. On
CPU (gloo) the transfer runs in gloo's threads and :meth:`Ring.finish` waits on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

#: byte alignment of each tensor in a packed buffer (enough for any dtype's view, and TMA's 16 bytes)
ALIGN = 16


@dataclass(frozen=True)
class Piece:
    """Where one tensor lives in a packed buffer: its dtype, byte offset, shape, strides and span
    (elements from its first to its last one)."""

    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    span: int


def _span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    if any(s < 0 for s in t.stride()):
        raise ValueError("negative strides cannot be packed")
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def layout(tensors: list[torch.Tensor]) -> tuple[tuple[Piece, ...], int]:
    """The pieces of a packed buffer holding ``tensors``, and its size in bytes."""
    pieces, offset = [], 0
    for t in tensors:
        span = _span(t)
        pieces.append(Piece(t.dtype, offset, tuple(t.shape), tuple(t.stride()), span))
        offset += -(-span * t.element_size() // ALIGN) * ALIGN
    return tuple(pieces), offset


def pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[Piece, ...]]:
    """One uint8 buffer holding ``tensors`` (each with its own strides), and its layout."""
    pieces, nbytes = layout(tensors)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=tensors[0].device if tensors else None)
    for t, p in zip(tensors, pieces):
        if p.span:
            src = t.as_strided((p.span,), (1,), t.storage_offset()).view(torch.uint8)
            buf[p.offset:p.offset + src.numel()].copy_(src)
    return buf, pieces


def unpack(buf: torch.Tensor, pieces: tuple[Piece, ...]) -> list[torch.Tensor]:
    """Views of the tensors in a packed buffer (no copy)."""
    out = []
    for p in pieces:
        nbytes = p.span * p.dtype.itemsize
        flat = buf[p.offset:p.offset + nbytes].view(p.dtype)
        out.append(flat.as_strided(p.shape, p.stride))
    return out


def nbytes(pieces: tuple[Piece, ...]) -> int:
    """The size of a packed buffer with these pieces."""
    if not pieces:
        return 0
    last = pieces[-1]
    return last.offset + -(-last.span * last.dtype.itemsize // ALIGN) * ALIGN


class Ring:
    """Send to the next rank and receive from the previous one of ``group``, one step at a time."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = self._global((self.rank + 1) % self.world)
        self.prev = self._global((self.rank - 1) % self.world)
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def start(self, send: torch.Tensor, recv: torch.Tensor):
        """Post sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        if self.stream is None:
            return dist.batch_isend_irecv(ops)
        self.stream.wait_stream(torch.cuda.current_stream(send.device))  # send is written, recv allocated
        with torch.cuda.stream(self.stream):
            return dist.batch_isend_irecv(ops)

    def finish(self, works) -> None:
        """Wait for a step's transfers: the host on CPU; on CUDA the caller's stream (not the host)."""
        if self.stream is None:
            for w in works:
                w.wait()
            return
        with torch.cuda.stream(self.stream):
            for w in works:
                w.wait()
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
