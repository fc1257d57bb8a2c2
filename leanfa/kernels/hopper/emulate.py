"""CPU emulation of the Hopper kernel: runs the *kernel's own Python source* on CPU tensors.

There is no Gluon interpreter, so this module re-executes the source of
:func:`.kernel_pingpong.attn_fwd_pingpong_kernel` (and every ``@gluon.jit`` helper it calls, recursively) with the
Gluon names rebound to small PyTorch-backed fakes: ``gl`` (tensor math on torch tensors, layouts
are no-ops), shared memory, ``mbarrier``, ``tma`` and ``warpgroup_mma``. It consumes the real
:class:`.launch.Plan` (descriptors, pointers, strides, constexprs, grid) built by
:func:`.launch.make_plan`, so host-side bugs show up too.

What it checks, beyond the numbers (every violation raises :class:`EmulationError`):

* pointers: every ``gl.load``/``gl.store`` address must be an element of the tensor's view
  (catches wrong strides, e.g. a broadcast scale table read past its end);
* TMA boxes are zero-filled outside the descriptor's shape, like the hardware; the box size is
  what ``mbarrier.expect`` must announce;
* mbarriers: arrival counts, transaction bytes, phase parity. TMA copies complete as *late* as
  possible (only when a wait needs them), so a wait on a stale parity returns at once and the
  following read of a buffer whose copy is still in flight is flagged;
* shared-memory hazards: a wgmma (or ``.load``) may only read a buffer whose TMA copy landed
  *and* was observed through its mbarrier; a TMA (issued in a ``warp_specialize`` partition) may
  only overwrite a buffer that every partition which read it released: its wgmmas waited for
  (``warpgroup_mma_wait``), then a barrier over the partition's warps (``gl.thread_barrier``), then
  an mbarrier arrive that the loading partition observed. Compiler-inserted ``bar.sync`` are not
  counted;
* at the end: no copy in flight, every loaded K/V box read exactly once.

Limits: each ``warp_specialize`` partition is a thread of control, and they take turns
deterministically (``ws_order`` picks which starts; a partition blocked on an mbarrier hands over):
other interleavings are checked by the release rule above, not explored; integer ``//`` and ``%`` follow Python (floor), Triton's follow
C (truncation) -- they agree for the non-negative values this kernel uses; layouts are ignored;
wgmma is an fp32 matmul of the exact operand values (the hardware's accumulation order and FP8
accumulator precision differ slightly).

Use :func:`emulate` (a :class:`leanfa.problem.Problem` in, ``(out, lse)`` out) or :func:`run_plan`.
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
import threading
import types
from dataclasses import dataclass, field

import torch

_TORCH_DT = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn,
    "i64": torch.int64, "i32": torch.int32,
}


class EmulationError(AssertionError):
    pass


# ----------------------------------------------------------------------------- machine state

@dataclass
class _Buf:
    """One TMA box / barrier-sized unit of shared memory (``alloc.index(i)``)."""
    state: str = "empty"  # empty | pending | landed | visible
    bar: object = None
    coords: tuple = ()
    desc_name: str = ""
    free: bool = True  # released through an mbarrier the producer observed
    # per reading partition: [reads, wgmmas in flight, epoch of its last completed read, released]
    read_parts: dict = field(default_factory=dict)
    # a TMA store's staging buffer (the output epilogue): generic writes -> fence_async_shared -> a barrier
    # over the writing warps -> the TMA store, which reads the buffer until tma.store_wait
    staged: str = ""  # "" | "written" (not fenced) | "fenced"
    fence_epoch: int = -1
    store_reader: object = None  # the partition whose TMA store is still reading this buffer
    store_done_epoch: int = -1  # the epoch of the store_wait that retired the last store
    store_epoch: int = -1  # the epoch of the last generic store (a generic load of it needs a barrier after)
    # the row ranges of the buffer the TMA copies of its current fill write (paged K/V: one box per page), or None
    # for a fill by one copy of the whole buffer
    parts: set | None = None

    def reader(self, part):
        return self.read_parts.setdefault(part, [0, 0, -1, False])

    @property
    def readers(self) -> int:
        """wgmmas reading this buffer that were issued and not yet waited for (all partitions)."""
        return sum(r[1] for r in self.read_parts.values())


class _Part:
    """One thread of control: the whole CTA (outside ``warp_specialize``), or one of its partitions."""

    def __init__(self, name="cta"):
        self.name = name
        self.epoch = 0  # number of gl.thread_barrier() so far in this partition
        self.pending_groups = []  # per wgmma call in flight, oldest first: the bufs it reads
        self.tma_stores = []  # staging buffers its TMA stores read until a store_wait
        self.done = False


class _Machine:
    def __init__(self):
        self.part = _Part()
        self.ws = None  # the running warp_specialize region (_WS), if any
        self.ws_order = "consumer-first"
        self.progress = 0  # bumped by every state change (deadlock detection)
        self.pid = (0, 0, 0)
        self.events = []  # ('read', desc_name, coords) / ('load', ...) / ('wait', ...)
        self.allocs = []
        self.valid_cache = {}

    @property
    def epoch(self):
        return self.part.epoch

    def err(self, msg):
        raise EmulationError(f"program {self.pid[:2]} [{self.part.name}]: {msg}")


M = _Machine()  # the emulator is single-threaded; one machine at a time


# ----------------------------------------------------------------------------- pointers

class _Dtype:
    def __init__(self, t):
        self.element_ty = t


class Ptr:
    """``tensor`` + element offset (an int or an integer tensor), relative to its storage offset."""

    def __init__(self, t, off=0, name="?"):
        self.t, self.off, self.name = t, off, name

    def __add__(self, x):
        return Ptr(self.t, self.off + x, self.name)

    __radd__ = __add__

    @property
    def dtype(self):
        return _Dtype(self.t.dtype)


def _flat(t):
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


def _valid(t):
    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
    v = M.valid_cache.get(key)
    if v is None:
        n = t.untyped_storage().nbytes() // t.element_size()
        idx = torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset())
        v = torch.zeros(n, dtype=torch.bool)
        v[idx.reshape(-1)] = True
        M.valid_cache[key] = v
    return v


def _addresses(ptr, mask):
    off = torch.as_tensor(ptr.off).to(torch.int64) + ptr.t.storage_offset()
    if mask is not None:
        off, mask = torch.broadcast_tensors(off, torch.as_tensor(mask))
    valid = _valid(ptr.t)
    sel = off if mask is None else off[mask]
    if sel.numel():
        if int(sel.min()) < 0 or int(sel.max()) >= valid.numel():
            M.err(f"pointer into '{ptr.name}' out of its storage (offsets {int(sel.min())}..{int(sel.max())}, "
                  f"storage has {valid.numel()} elements)")
        if not bool(valid[sel].all()):
            M.err(f"pointer into '{ptr.name}' hits storage outside the tensor's view")
    return off, mask


def _load(ptr, mask=None, other=None, **_):
    off, mask = _addresses(ptr, mask)
    flat = _flat(ptr.t)
    if mask is None:
        return flat[off].clone()
    safe = torch.where(mask, off, torch.zeros_like(off))
    return torch.where(mask, flat[safe], torch.as_tensor(0 if other is None else other, dtype=ptr.t.dtype))


def _store(ptr, val, mask=None, **_):
    off, mask = _addresses(ptr, mask)
    val = torch.as_tensor(val).to(ptr.t.dtype)
    flat = _flat(ptr.t)
    if mask is None:
        off, val = torch.broadcast_tensors(off, val)
        flat[off.reshape(-1)] = val.reshape(-1)
    else:
        off, val, mask = torch.broadcast_tensors(off, val, mask)
        flat[off[mask]] = val[mask]


# ----------------------------------------------------------------------------- shared memory

class _BarrierLayout:
    pass


class _Alloc:
    def __init__(self, dtype, shape):
        self.dtype, self.shape = dtype, list(shape)
        self.data = torch.zeros(shape, dtype=dtype)
        self.bufs = [_Buf() for _ in range(shape[0])]
        M.allocs.append(self)


class SmemView:
    def __init__(self, alloc, index=None, ops=()):
        self.alloc, self.idx, self.ops = alloc, index, tuple(ops)

    @property
    def dtype(self):
        return self.alloc.dtype

    def _tensor(self):
        t = self.alloc.data if self.idx is None else self.alloc.data[self.idx]
        for op, arg in self.ops:
            if op == "slice":
                t = t.narrow(arg[2], arg[0], arg[1])
            else:
                t = t.reshape(arg) if op == "reshape" else t.permute(arg)
        return t

    @property
    def shape(self):
        return list(self._tensor().shape)

    def index(self, i):
        if self.idx is not None or self.ops:
            M.err("index() of a sub-view is not modelled")
        i = int(i)
        if not 0 <= i < self.alloc.shape[0]:
            M.err(f"smem index {i} out of range {self.alloc.shape[0]}")
        return SmemView(self.alloc, i)

    def reshape(self, shape):
        return SmemView(self.alloc, self.idx, self.ops + (("reshape", tuple(int(s) for s in shape)),))

    def permute(self, order):
        return SmemView(self.alloc, self.idx, self.ops + (("permute", tuple(order)),))

    def slice(self, start, length, dim=0):
        """Rows ``[start, start + length)`` along ``dim`` of one buffer (a TMA destination: part of its fill)."""
        if self.idx is None or self.ops:
            M.err("slice() of a whole allocation or of a reshaped view is not modelled")
        return SmemView(self.alloc, self.idx, (("slice", (int(start), int(length), int(dim))),))

    def part(self):
        """The ``(start, length, dim)`` of a sliced view, or None for the whole buffer."""
        return next((arg for op, arg in self.ops if op == "slice"), None)

    def buf(self):
        if self.idx is None:
            M.err("whole-allocation access is not modelled")
        return self.alloc.bufs[self.idx]

    def read(self, what):
        b = self.buf()
        if what == "a generic load" and b.staged == "written":
            # a staged output tile read back (the varlen epilogue): every warp's rows only after a barrier
            if b.store_epoch >= M.epoch:
                M.err("a generic load of shared memory written by generic stores with no barrier over the warps "
                      "in between")
        elif b.state != "visible" and what.startswith("wgmma") and b.staged:
            # written by the warpgroup's own generic stores: the async proxy sees them only
            # after fence_async_shared, and every warp's rows only after a barrier behind the fence
            if b.staged == "written":
                M.err(f"{what} reads shared memory written by generic stores with no fence_async_shared")
            if b.fence_epoch >= M.epoch:
                M.err(f"{what} reads fenced shared memory with no barrier over the warps after the fence")
        elif b.state != "visible":
            M.err(f"{what} reads shared memory that is {b.state} (copy {b.desc_name}{b.coords}; "
                  "not landed, or landed but not observed through its mbarrier)")
        b.reader(M.part)[0] += 1
        return self._tensor()

    def load(self, layout=None):
        t = self.read("a generic load").clone()
        self.buf().reader(M.part)[2] = M.epoch
        return t

    def store(self, value):
        """A generic shared-memory write (the TMA-store epilogue's staging buffer)."""
        b = self.buf()
        if b.state in ("pending", "landed") or b.readers:
            M.err("a generic store into shared memory a TMA load or a wgmma is still using")
        if b.store_reader is not None:
            M.err("a generic store into shared memory a TMA store is still reading (no tma.store_wait(0))")
        if b.store_done_epoch >= M.epoch:
            M.err("a generic store into shared memory right after tma.store_wait with no barrier over the "
                  "warps in between (only the issuing thread saw the store finish)")
        r = b.read_parts.get(M.part)
        if r is not None and r[2] >= M.epoch:
            M.err("a generic store into shared memory that its warps may still be reading (a generic load with "
                  "no barrier over the warps since)")
        self._tensor().copy_(torch.as_tensor(value).to(self.alloc.dtype))
        b.staged, b.fence_epoch, b.store_epoch = "written", -1, M.epoch


class Barrier:
    def __init__(self):
        self.valid = False
        self.count = self.arrivals = self.tx = self.phase = 0
        self.inflight = []  # [(buf, data_fn, nbytes)]
        self.landed = []
        self.releases = []  # bufs released by arrivals in the current phase
        self.released = []  # ... of completed phases, freed when a wait observes the completion

    def _maybe_complete(self):
        if self.arrivals == 0 and self.tx == 0:
            M.progress += 1
            self.phase += 1
            self.arrivals = self.count
            self.released += self.releases
            self.releases = []
            for b in self.landed:
                b.state = "landed"

    def _complete_one(self):
        buf, fn, nbytes, alloc, idx, view = self.inflight.pop(0)
        if view is None:
            alloc.data[idx] = fn()
        else:
            view._tensor().copy_(fn())
        self.tx -= nbytes
        self.landed.append(buf)
        if self.tx < 0:
            M.err("mbarrier transaction count went negative (expect announced fewer bytes than arrived)")
        self._maybe_complete()


class _BarrierArray:
    def __init__(self, count):
        self.bars = [Barrier() for _ in range(count)]

    def index(self, i):
        return self.bars[int(i)]


def _allocate_shared_memory(dtype, shape, layout=None, value=None):
    shape = [int(s) for s in shape]
    if isinstance(layout, _BarrierLayout):
        return _BarrierArray(shape[0])
    return SmemView(_Alloc(dtype, shape))


class _MBarrier:
    MBarrierLayout = _BarrierLayout

    @staticmethod
    def init(bar, count):
        bar.valid, bar.count, bar.arrivals, bar.tx, bar.phase = True, int(count), int(count), 0, 0

    @staticmethod
    def invalidate(bar):
        if bar.inflight:
            M.err("mbarrier invalidated with a TMA copy still in flight")
        if bar.arrivals != bar.count or bar.tx:
            M.err("mbarrier invalidated in the middle of a phase")
        bar.valid = False

    @staticmethod
    def expect(bar, nbytes, pred=True):
        if not pred:
            return
        if not bar.valid:
            M.err("expect on an uninitialised mbarrier")
        bar.arrivals -= 1
        if bar.arrivals < 0:
            M.err("more arrivals than the mbarrier's count in one phase")
        bar.tx += int(nbytes)
        bar._maybe_complete()

    @staticmethod
    def arrive(bar, count=1, pred=True):
        if not pred:
            return
        if not bar.valid:
            M.err("arrive on an uninitialised mbarrier")
        if M.ws is not None:
            # happens-before: every read this partition completed (wgmma waited) *and* followed by a
            # barrier over the partition's warps is released by this arrive; a buffer is handed
            # back once every partition that read it released it (both consumer warpgroups)
            for a in M.allocs:
                for b in a.bufs:
                    rp = b.read_parts.get(M.part)
                    if not b.free and rp is not None and rp[1] == 0 and rp[2] < M.part.epoch:
                        rp[3] = True
                        if all(r[3] for r in b.read_parts.values()):
                            bar.releases.append(b)
        M.progress += 1
        bar.arrivals -= count
        if bar.arrivals < 0:
            M.err("more arrivals than the mbarrier's count in one phase")
        bar._maybe_complete()

    @staticmethod
    def wait(bar, phase, pred=True, deps=()):
        if not pred:
            return
        if not bar.valid:
            M.err("wait on an uninitialised mbarrier")
        parity = int(phase) & 1
        M.events.append(("wait", id(bar), parity))
        # try_wait.parity(P) succeeds once the current (incomplete) phase's parity differs from P
        while (bar.phase & 1) == parity:
            if bar.inflight:
                bar._complete_one()
            elif M.ws is not None:
                M.ws.yield_(f"waiting for parity {parity} of an mbarrier in phase {bar.phase} "
                            f"(arrivals left {bar.arrivals}, tx left {bar.tx})")
            else:
                M.err(f"deadlock: waiting for parity {parity} of an mbarrier whose phase {bar.phase} "
                      f"can never complete (arrivals left {bar.arrivals}, tx left {bar.tx})")
        for b in bar.released:
            b.free = True
        bar.released = []
        for b in bar.landed:
            if b.state == "landed":
                b.state = "visible"
        bar.landed = [b for b in bar.landed if b.state != "visible"]


class FakeDesc:
    def __init__(self, d, name):
        self.base, self.shape, self.strides = d.base, [int(s) for s in d.shape], [int(s) for s in d.strides]
        self.block_shape = [int(s) for s in d.block_shape]
        self.layout, self.name, self.dtype = d.layout, name, d.base.dtype
        self.block_type = types.SimpleNamespace(
            shape=list(self.block_shape),
            nbytes=math.prod(self.block_shape) * d.base.element_size())
        self.view = _flat(d.base).as_strided(self.shape, self.strides, d.base.storage_offset())

    def _clip(self, coords):
        """``(tensor slices, box slices)`` of the part of the box at ``coords`` inside the tensor (TMA clips
        the rest), or None if none of it is."""
        inside, in_box = [], []
        for c, n, s in zip(coords, self.block_shape, self.shape):
            lo, hi = max(c, 0), min(c + n, s)
            if hi <= lo:
                return None
            inside.append(slice(lo, hi))
            in_box.append(slice(lo - c, hi - c))
        return tuple(inside), tuple(in_box)

    def box(self, coords):
        """A TMA load: the box at ``coords``, zeros outside the tensor."""
        out = torch.zeros(self.block_shape, dtype=self.dtype)
        clip = self._clip(coords)
        if clip is not None:
            out[clip[1]] = self.view[clip[0]]
        return out

    def write_box(self, coords, data):
        """A TMA store: the box's part inside the tensor."""
        clip = self._clip(coords)
        if clip is not None:
            self.view[clip[0]] = data.reshape(self.block_shape)[clip[1]].to(self.dtype)


def _fence_async_shared(cluster=False):
    """Generic shared-memory writes so far become visible to the async proxy (TMA, wgmma)."""
    for a in M.allocs:
        for b in a.bufs:
            if b.staged == "written":
                b.staged, b.fence_epoch = "fenced", M.epoch


class _TMA:
    @staticmethod
    def async_copy_shared_to_global(desc, coord, src):
        coords = tuple(int(c) for c in coord)
        b = src.buf()
        if b.staged != "fenced":
            M.err(f"TMA store {desc.name}{coords} of shared memory not fenced (fence_async_shared) after its "
                  "generic writes")
        if b.fence_epoch >= M.epoch:
            M.err(f"TMA store {desc.name}{coords} issued with no barrier over the warps after the fence (other "
                  "warps' writes may not be done)")
        if list(src.shape) != desc.block_shape:
            M.err(f"TMA store box {desc.block_shape} from a buffer of shape {src.shape}")
        desc.write_box(coords, src._tensor())
        b.store_reader = M.part
        M.part.tma_stores.append(b)
        M.events.append(("store", desc.name, coords))

    @staticmethod
    def store_wait(pendings):
        if int(pendings) != 0:
            M.err("tma.store_wait(n > 0) is not modelled")
        for b in M.part.tma_stores:
            b.store_reader, b.store_done_epoch = None, M.epoch
        M.part.tma_stores = []

    @staticmethod
    def async_copy_global_to_shared(desc, coord, bar, result, pred=True):
        if not pred:
            return
        coords = tuple(int(c) for c in coord)
        b = result.buf()
        part = result.part()
        if b.state == "pending" and part is not None and b.parts is not None and b.bar is bar:
            # another part of the same fill (paged K/V: the next page's box), on the same barrier
            dim = part[2]
            if any(p[2] != dim or (p[0] < part[0] + part[1] and part[0] < p[0] + p[1]) for p in b.parts):
                M.err(f"TMA {desc.name}{coords} overlaps another copy of the same fill ({sorted(b.parts)} vs {part})")
            b.parts.add(part)
            M.progress += 1
            bar.inflight.append((b, lambda: desc.box(coords), desc.block_type.nbytes, result.alloc, result.idx, result))
            M.events.append(("load", desc.name, coords))
            return
        if b.state == "pending":
            M.err(f"TMA into a buffer whose previous copy is still in flight ({desc.name}{coords})")
        if b.readers:
            M.err(f"TMA {desc.name}{coords} overwrites a buffer a wgmma is still reading (no warpgroup_mma_wait)")
        if M.ws is None:
            M.err(f"TMA {desc.name}{coords} issued outside a warp_specialize partition (the kernel loads in its "
                  "producer partition; the emulator checks that protocol only)")
        if not b.free:
            M.err(f"TMA {desc.name}{coords} overwrites a buffer (last {b.desc_name}{b.coords}) that was not "
                  "released to this partition (consumer arrive after wgmma wait + partition barrier, "
                  "observed by an mbarrier wait)")
        if list(result.shape) != desc.block_shape:
            M.err(f"TMA box {desc.block_shape} into a buffer of shape {result.shape}")
        if (coords[-1] * desc.dtype.itemsize) % 16:
            # H200 run 16 (a probe of FP8 varlen, since removed): a box whose start along the innermost,
            # contiguous dimension is not 16-byte aligned kills the kernel ("illegal instruction")
            M.err(f"TMA {desc.name}{coords}: the box starts {coords[-1]} elements into the contiguous dimension, "
                  f"not a multiple of 16 bytes")
        if not bar.valid:
            M.err("TMA on an uninitialised mbarrier")
        b.state, b.bar, b.coords, b.desc_name = "pending", bar, coords, desc.name
        b.free, b.read_parts = False, {}
        b.parts = None if part is None else {part}
        M.progress += 1
        bar.inflight.append((b, lambda: desc.box(coords), desc.block_type.nbytes, result.alloc, result.idx,
                             None if part is None else result))
        M.events.append(("load", desc.name, coords))


def _operand(x, what, group):
    """``x`` as a tensor; a shared-memory operand is recorded in the wgmma's ``group``."""
    if isinstance(x, SmemView):
        b = x.buf()
        t = x.read(what)
        b.reader(M.part)[1] += 1
        group.append(b)
        M.events.append(("read", b.desc_name, b.coords, M.part.name))
        return t.float()
    return x.float()


class InFlight:
    """The accumulator of an async wgmma: usable only as the accumulator of the next wgmma of its
    chain, or through the ``warpgroup_mma_wait`` that retires its group. Any other use -- reading a
    result the tensor cores may still be writing -- is an error."""

    def __init__(self, value, group):
        self.value, self.group = value, group

    def _bad(self, *_a, **_k):
        M.err("a wgmma result is read before the warpgroup_mma_wait that retires it")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __getitem__ = _bad
    __lt__ = __le__ = __gt__ = __ge__ = __neg__ = __float__ = _bad

    def __getattr__(self, name):
        self._bad()


def _warpgroup_mma(a, b, acc, *, use_acc=True, precision=None, max_num_imprecise_acc=None, is_async=False):
    group = []
    r = torch.matmul(_operand(a, "wgmma A", group), _operand(b, "wgmma B", group))
    if isinstance(acc, InFlight):  # chained onto an in-flight wgmma: one group (they retire together)
        if not M.part.pending_groups or M.part.pending_groups[-1] is not acc.group:
            M.err("a wgmma chains onto an accumulator that is not the newest in-flight group")
        acc.group.extend(group)
        group, acc = acc.group, acc.value
    else:
        M.part.pending_groups.append(group)
    if use_acc:
        r = acc.float() + r
    if not is_async:
        return _warpgroup_mma_wait(0, deps=(InFlight(r, group), ))
    return InFlight(r, group)


def _warpgroup_mma_wait(num_outstanding=0, deps=None):
    """Retire all but the newest ``num_outstanding`` wgmma groups (they complete in issue order);
    ``deps`` that are results of retired groups come back as tensors."""
    n = int(num_outstanding)
    groups = M.part.pending_groups
    retire, keep = (groups[:-n], groups[-n:]) if n > 0 else (groups, [])
    for group in retire:
        for b in group:
            rp = b.reader(M.part)
            rp[1] -= 1
            rp[2] = M.epoch
    M.part.pending_groups = keep
    out = []
    for d in deps:
        if isinstance(d, InFlight):
            if any(d.group is g for g in keep):
                M.err("warpgroup_mma_wait returns a wgmma result whose group is still in flight")
            d = d.value
        out.append(d)
    return out[0] if len(out) == 1 else tuple(out)


# ----------------------------------------------------------------------------- fake gl

def _t(x):
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _fma(a, b, c):
    return (_t(a).double() * _t(b).double() + _t(c).double()).float()


def _thread_barrier():
    M.part.epoch += 1


class _Abort(BaseException):
    pass


class _WS:
    """A ``gl.warp_specialize`` region: each partition is a Python thread, but only the one
    holding the baton runs (deterministic). A partition blocked on an mbarrier passes the baton
    on; when a whole round of partitions makes no progress, that is a deadlock."""

    def __init__(self, parts):
        self.parts = parts
        self.cv = threading.Condition()
        self.current = None
        self.error = None
        self.stalls = 0

    def _next(self, me):
        live = [p for p in self.parts if not p.done]
        if not live:
            return None
        i = (self.parts.index(me) + 1) % len(self.parts) if me in self.parts else 0
        while self.parts[i].done:
            i = (i + 1) % len(self.parts)
        return self.parts[i]

    def _give(self, to):
        with self.cv:
            self.current = to
            if to is not None:
                M.part = to
            self.cv.notify_all()

    def _await_turn(self, me):
        with self.cv:
            while self.current is not me and self.error is None:
                self.cv.wait()
        if self.error is not None:
            raise _Abort()
        M.part = me

    def yield_(self, why):
        me = M.part
        before = M.progress
        nxt = self._next(me)
        if nxt is me:
            M.err(f"deadlock: {why}; no other partition can run")
        if before == getattr(me, "_stall_progress", None):
            me._stalls += 1
        else:
            me._stall_progress, me._stalls = before, 0
        if me._stalls > 2 * len(self.parts):
            M.err(f"deadlock: {why}; every partition is blocked")
        self._give(nxt)
        self._await_turn(me)


def _warp_specialize(functions_and_args, worker_num_warps, worker_num_regs):
    if M.ws is not None:
        M.err("nested warp_specialize")
    names = ["default"] + [f"worker{i}" for i in range(len(functions_and_args) - 1)]
    parts = [_Part(n) for n in names]
    ws = _WS(parts)
    results = [None] * len(parts)
    parent = M.part

    def body(i):
        fn, args = functions_and_args[i]
        try:
            ws._await_turn(parts[i])
            results[i] = fn(*args)
            if parts[i].pending_groups:
                M.err("partition exits with wgmmas not waited for")
            if parts[i].tma_stores:
                M.err("partition exits with a TMA store still reading shared memory (no tma.store_wait(0))")
        except _Abort:
            return
        except BaseException as e:  # noqa: BLE001
            with ws.cv:
                if ws.error is None:
                    ws.error = e
                ws.current = "main"
                ws.cv.notify_all()
            return
        parts[i].done = True
        nxt = ws._next(parts[i])
        ws._give(nxt if nxt is not None else "main")

    M.ws = ws
    threads = [threading.Thread(target=body, args=(i, ), daemon=True) for i in range(len(parts))]
    for t in threads:
        t.start()
    first = parts[0] if M.ws_order == "consumer-first" else parts[-1]
    ws._give(first)
    with ws.cv:
        while ws.current != "main" and ws.error is None:
            ws.cv.wait()
        if ws.error is not None:
            ws.cv.notify_all()
    for t in threads:
        t.join(timeout=10)
    M.ws = None
    M.part = parent
    if ws.error is not None:
        raise ws.error
    return results[0]


def _program_id(axis):
    return torch.tensor(M.pid[int(axis)], dtype=torch.int32)


def _runtime_range(*bounds):
    for i in range(*[int(x) for x in bounds]):
        yield torch.tensor(i, dtype=torch.int32)


def _num_programs(axis):
    return torch.tensor(M.grid[int(axis)], dtype=torch.int32)


def _none(*a, **k):
    return None


#: the inline PTX the kernel's arithmetic uses, as torch functions (the clock trace's reads are not emulated)
_INLINE_ASM = {"tanh.approx.f32 $0, $1;": torch.tanh}


def _inline_asm_elementwise(asm, constraints, args, dtype=None, is_pure=True, pack=1):
    """The PTX of :data:`_INLINE_ASM` (``tanh.approx.f32``, the softcap's MUFU.TANH: emulated exactly in float32; the
    hardware's relative error is <= 2^-11)."""
    fn = _INLINE_ASM.get(asm)
    if fn is None:
        M.err(f"inline asm not emulated: {asm!r}")
    return fn(*(_t(a).float() for a in args))


def _static_assert(cond, msg=""):
    if not cond:
        M.err(f"static_assert failed: {msg}")


gl_fake = types.SimpleNamespace(
    constexpr=lambda x: x,
    float32=torch.float32, float16=torch.float16, bfloat16=torch.bfloat16, int32=torch.int32,
    int64=torch.int64, float8e4nv=torch.float8_e4m3fn,
    program_id=_program_id,
    num_programs=_num_programs,
    allocate_shared_memory=_allocate_shared_memory,
    arange=lambda start, end, layout=None: torch.arange(int(start), int(end), dtype=torch.int32),
    SliceLayout=_none, BlockedLayout=_none, NVMMADistributedLayout=_none, DotOperandLayout=_none,
    zeros=lambda shape, dtype, layout=None: torch.zeros([int(s) for s in shape], dtype=dtype),
    full=lambda shape, value, dtype, layout=None: torch.full([int(s) for s in shape], value, dtype=dtype),
    zeros_like=torch.zeros_like,
    maximum=lambda a, b, **k: torch.maximum(_t(a), _t(b)),
    minimum=lambda a, b, **k: torch.minimum(_t(a), _t(b)),
    where=lambda c, a, b: torch.where(_t(c), a, b),
    exp2=torch.exp2, log2=torch.log2, exp=torch.exp, log=torch.log, abs=torch.abs, sqrt=torch.sqrt,
    fma=_fma,
    max=lambda x, axis=None, **k: torch.amax(x, dim=axis),
    min=lambda x, axis=None, **k: torch.amin(x, dim=axis),
    sum=lambda x, axis=None, **k: torch.sum(x, dim=axis),
    convert_layout=lambda x, layout=None, **k: x,
    load=_load, store=_store,
    thread_barrier=_thread_barrier,
    warp_specialize=_warp_specialize,
    static_range=lambda *a: range(*[int(x) for x in a]),
    static_assert=_static_assert,
    inline_asm_elementwise=_inline_asm_elementwise,
)

_FAKES = {
    "gl": gl_fake, "mbarrier": _MBarrier, "tma": _TMA, "fence_async_shared": _fence_async_shared,
    "warpgroup_mma": _warpgroup_mma, "warpgroup_mma_wait": _warpgroup_mma_wait,
}


class _Strip(ast.NodeTransformer):
    """``x.type.layout`` -> ``None`` (layouts are not modelled; torch tensors have no ``.type``)."""

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if node.attr == "layout" and isinstance(node.value, ast.Attribute) and node.value.attr == "type":
            return ast.Constant(None)
        return node


_SHADOWS = {}  # by the jitted Python function (hashing a JITFunction compiles its cache key)
#: constexpr functions that decide control flow (the others build layouts and become ``None``)
_CONTROL_CONSTEXPR_FUNCTIONS = {"ablates"}


def reset_shadows():
    _SHADOWS.clear()


def shadow(jit_fn, source=None):
    """The plain-Python twin of a ``@gluon.jit`` function, bound to the fakes.

    ``source`` replaces the function's source (tests: mutate the kernel and check the emulator
    catches it); the result is cached until :func:`reset_shadows`.
    """
    from triton.language.core import constexpr as tl_constexpr
    from triton.runtime.jit import ConstexprFunction, JITFunction

    fn = jit_fn.fn
    if source is None and fn in _SHADOWS:
        return _SHADOWS[fn]
    tree = ast.parse(textwrap.dedent(source or inspect.getsource(fn)))
    fdef = tree.body[0]
    fdef.decorator_list = []
    for a in fdef.args.args + fdef.args.kwonlyargs:
        a.annotation = None
    tree = ast.fix_missing_locations(_Strip().visit(tree))
    g = dict(fn.__globals__)
    g["range"] = _runtime_range  # a jit loop over range() has a runtime (tensor) induction variable
    for name, val in list(g.items()):
        if name in _FAKES:
            g[name] = _FAKES[name]
        elif isinstance(val, JITFunction):
            g[name] = _LazyShadow(val)
        elif isinstance(val, ConstexprFunction):  # layouts are not modelled; control flow is
            g[name] = val.fn if name in _CONTROL_CONSTEXPR_FUNCTIONS else _none
        elif isinstance(val, tl_constexpr):
            g[name] = val.value
    ns = {}
    exec(compile(tree, inspect.getsourcefile(fn), "exec"), g, ns)
    _SHADOWS[fn] = ns[fn.__name__]
    return _SHADOWS[fn]


class _LazyShadow:
    def __init__(self, jf):
        self.jf = jf

    def __call__(self, *a, **k):
        return shadow(self.jf)(*a, **k)


# ----------------------------------------------------------------------------- driver

@dataclass
class Report:
    programs: int = 0
    # (pid_bh, pid_m) -> {partition: [K box coords it read, in order]} (one list per consumer partition)
    schedule: dict = field(default_factory=dict)
    waits: dict = field(default_factory=dict)


def run_plan(plan, *, programs=None, ws_order="consumer-first") -> Report:
    """Emulate every program of ``plan`` (or the listed ``(pid0, pid1)``); raise on any violation.

    ``ws_order``: which ``warp_specialize`` partition gets the first turn,
    ``"consumer-first"`` or ``"producer-first"`` (the producer then runs as far ahead as it can)."""
    kernel = plan.kernel
    kern = shadow(kernel)
    names = [n for n in kernel.arg_names if n not in plan.constexprs]
    args = []
    for n, a in zip(names, plan.args):
        if hasattr(a, "block_shape"):
            a = FakeDesc(a, n.replace("_desc", ""))
        elif isinstance(a, torch.Tensor):
            a = Ptr(a, 0, n)
        args.append(a)
    kw = dict(plan.constexprs)
    grid = list(plan.grid) + [1] * (3 - len(plan.grid))
    todo = programs or [(i, j) for i in range(grid[0]) for j in range(grid[1])]
    rep = Report()
    global M
    for pid in todo:
        cache = M.valid_cache
        M = _Machine()
        M.valid_cache = cache
        M.ws_order = ws_order
        M.pid = (pid[0], pid[1], 0)
        M.grid = grid
        kern(*args, **kw)
        for a in M.allocs:
            for b in a.bufs:
                if b.state == "pending":
                    M.err(f"kernel exits with the copy {b.desc_name}{b.coords} in flight")
                per_part = [r[0] for r in b.read_parts.values()]
                if b.state in ("landed", "visible") and b.desc_name in ("k", "v") and (
                        not per_part or any(n != 1 for n in per_part)):
                    M.err(f"{b.desc_name} box {b.coords} loaded and read {per_part or 0} times by its "
                          "consumer partition(s) (expected once by each)")
        rep.programs += 1
        reads = {}
        for _, d, c, part in (x for x in M.events if x[0] == "read"):
            if d == "k":
                reads.setdefault(part, []).append(c)
        rep.schedule[pid] = reads
        rep.waits[pid] = [x[2] for x in M.events if x[0] == "wait"]
    return rep


def emulate(problem, *, programs=None, poison=True, ws_order="consumer-first"):
    """Run a :class:`leanfa.problem.Problem` (dense or varlen) through the emulated kernel on CPU:
    ``(out, lse, report)``."""
    from . import launch as L

    q, p = problem.q, problem
    if p.varlen:
        out = torch.empty((q.shape[0], p.heads, p.head_dim_v), dtype=p.out_dtype)
        lse = torch.empty((p.heads, q.shape[0]), dtype=torch.float32) if p.return_lse else None
    else:
        out = torch.empty((p.batch, p.max_seqlen_q, p.heads, p.head_dim_v), dtype=p.out_dtype)
        lse = torch.empty((p.batch, p.heads, p.max_seqlen_q), dtype=torch.float32) if p.return_lse else None
    if poison:
        out.fill_(float("nan"))
        if lse is not None:
            lse.fill_(float("nan"))
    plan = _make_plan_cpu(L, problem, out, lse)
    rep = run_plan(plan, programs=programs, ws_order=ws_order)
    return out, lse, rep


def _make_plan_cpu(L, p, out, lse):
    """``launch.make_plan`` on CPU tensors (the TMA descriptor checks only look at pointers)."""
    from . import plan_kwargs

    return L.make_plan(p.q, p.k, p.v, out, lse, p.q_scale, p.k_scale, p.v_scale, p.k_mean,
                       causal=p.causal, softmax_scale=p.softmax_scale, return_lse=p.return_lse, **plan_kwargs(p))
