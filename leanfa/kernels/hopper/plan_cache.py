"""Launch plans reused across calls of one signature: the host path of short prefills.

At S <= 2K the Hopper kernel runs ~0.16-0.25 ms, and ``flash_attn_func``'s host work without this cache is
as long (~0.2-0.4 ms per FP8 call on the H200's host; docs/perf-notes.md, "The host path: plans kept per call
signature"). Most of it is repeated work: :func:`.launch.make_plan` reads the environment knobs, checks
layouts and builds four validated TMA descriptors, and Triton's launcher binds and specializes ~45
arguments, on every call, although all of it follows from the call's *signature*:

* every input tensor's shape, strides, dtype and 16-byte alignment (which fix every integer
  argument the kernel gets and how Triton specializes it), and its device;
* the scalars (causal, softmax scale, LSE, sink keys) and the ``LEANFA_HOPPER_*`` knobs.

The first call of a signature builds its plan with ``make_plan`` and keeps it as a
:class:`Template`, with the tensors taken out (a template must not keep the caller's memory alive).
Later calls put their own tensors back in (:meth:`Template.bind`: descriptors copied with the new
base, no re-validation: the signature is what was validated), and launch Triton's compiled kernel
of the first launch directly (:meth:`Template.launch`).

The inputs a plan is bound from are the call's tensors as the kernel reads them: packed varlen tensors
viewed as a batch of one, and V as :func:`.launch.prepare_v` makes it (an FP8 V re-packed or transposed:
that copy is made every call, before the lookup). Only plans whose every tensor argument is one of those
inputs are kept: a plan that made a tensor of its own (the clock-trace buffer) is rebuilt
every call, as are timing ablations. Varlen calls and copied FP8 V's are kept too
(:data:`PREPARED_VALIDATED`); ``LEANFA_HOPPER_PLAN_CACHE=1`` keeps dense ones only.
``LEANFA_HOPPER_PLAN_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..launcher import grid3, parameter_tail
from .gluon_compat import TensorDescriptor

#: every environment knob a plan or the kernel's verdict on a call depends on (tests/test_hopper_host.py
#: checks the list against the hopper package's sources)
KNOBS = (
    "LEANFA_HOPPER_STORE_TMA", "LEANFA_HOPPER_TRACE", "LEANFA_HOPPER_ABLATE", "LEANFA_HOPPER_PERSISTENT",
    "LEANFA_HOPPER_STAGES", "LEANFA_HOPPER_PLAN_CACHE", "LEANFA_HOPPER_SINK",
)
MAX_TEMPLATES = 256  # signatures kept (a template holds no tensors: ~1 KB each)

_ENV = getattr(os.environ, "_data", None)  # CPython's raw mapping: one dict lookup per knob
_KEYS = tuple(os.environ.encodekey(k) for k in KNOBS) if _ENV is not None else KNOBS


def knob_values() -> tuple:
    """The knobs' current values (read on every call: tests and scripts change them between calls)."""
    if _ENV is None:
        return tuple(map(os.environ.get, KNOBS))
    return tuple(map(_ENV.get, _KEYS))


_OFF = KNOBS.index("LEANFA_HOPPER_PLAN_CACHE")
_ABLATE = KNOBS.index("LEANFA_HOPPER_ABLATE")


#: Calls whose plan works on prepared inputs (varlen: packed tensors viewed as a batch of one; FP8 with a V
#: the plan re-packs or transposes every call) are kept: their bound plans equal ``make_plan``'s on the CPU
#: (tests/test_hopper_host.py), and the GPU suites pass with them kept (247 tests on the H200,
#: ``scripts/gpu_session.sh prepared_cache``: the Hopper, attention, edge-case and fuzz suites).
#: ``LEANFA_HOPPER_PLAN_CACHE=1``: dense only.
PREPARED_VALIDATED = True


def prepared_enabled(knobs: tuple) -> bool:
    """Whether plans over prepared inputs may be kept (:data:`PREPARED_VALIDATED` unless the knob is 1, or the
    knob at 2)."""
    return knobs[_OFF] in ("2", b"2") or (PREPARED_VALIDATED and knobs[_OFF] not in ("1", b"1"))


def enabled(knobs: tuple) -> bool:
    """Whether plans may be kept with these knob values: not with ``LEANFA_HOPPER_PLAN_CACHE=0``, and not for
    a timing ablation (``LEANFA_HOPPER_ABLATE``, which warns on every plan it builds)."""
    return knobs[_OFF] not in ("0", b"0") and not knobs[_ABLATE]


def _tensor_key(t):
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0


def signature(inputs: tuple, scalars: tuple, knobs: tuple):
    """The cache key of a call: its tensors' layouts and alignment, its scalars, its device, its knobs."""
    return (inputs[0].device, scalars, knobs, *map(_tensor_key, inputs))


def extend(key: tuple, tensors: tuple, inputs: tuple) -> tuple:
    """``key`` with more tensors' layouts (the outputs and prepared inputs, made after the inputs' key was taken)
    and which of ``inputs`` are one tensor (e.g. one ``cu_seqlens`` for queries and keys): a template binds an
    argument from the first input it was, which is right only for calls that alias the same inputs."""
    first: dict = {}
    aliases = tuple(first.setdefault(id(t), i) for i, t in enumerate(inputs) if t is not None)
    return (*key, *map(_tensor_key, tensors), aliases)


@dataclass
class Template:
    """A plan with its tensor arguments taken out, and where each call's inputs go back in."""
    plan: object  # launch.Plan, tensors replaced by None
    tensor_slots: tuple  # (argument position, input index)
    desc_slots: tuple  # (argument position, input index): TMA descriptors over an input
    compiled: object = None  # Triton's CompiledKernel of the first launch
    tail: tuple = ()  # the kernel's constexpr arguments, in its signature's order after plan.args
    grid: tuple = ()  # plan.grid in three dims

    @classmethod
    def of(cls, plan, inputs: tuple):
        """The template of ``plan`` (built by ``make_plan`` from ``inputs``), or None when a tensor argument
        is not one of the inputs. An argument that is several inputs (one tensor passed twice) is bound from
        the first of them: the key says which inputs a call aliases (:func:`extend`)."""
        if plan.trace is not None:
            return None
        where: dict = {}
        for i, t in enumerate(inputs):
            if t is not None:
                where.setdefault(id(t), i)
        args, tensors, descs = list(plan.args), [], []
        for pos, a in enumerate(args):
            if isinstance(a, TensorDescriptor):
                if id(a.base) not in where:
                    return None
                descs.append((pos, where[id(a.base)]))
                args[pos] = _with_base(a, None)
            elif isinstance(a, torch.Tensor):
                if id(a) not in where:
                    return None
                tensors.append((pos, where[id(a)]))
                args[pos] = None
        bare = type(plan)(tuple(args), plan.constexprs, plan.grid, None)
        return cls(bare, tuple(tensors), tuple(descs))

    def bind(self, inputs: tuple):
        """The plan of a call with these inputs (of this template's signature)."""
        args = list(self.plan.args)
        for pos, i in self.tensor_slots:
            args[pos] = inputs[i]
        for pos, i in self.desc_slots:
            args[pos] = _with_base(args[pos], inputs[i])
        p = self.plan
        return type(p)(tuple(args), p.constexprs, p.grid, None, self)

    def launch(self, plan) -> bool:
        """Launch ``plan`` (bound from this template) on the compiled kernel of an earlier launch; False when
        there is none yet (the caller launches through Triton and hands the result to :meth:`keep`)."""
        if self.compiled is None:
            return False
        self.compiled[self.grid](*plan.args, *self.tail)
        return True

    def keep(self, compiled, kernel, constexprs: dict) -> None:
        """Remember the compiled kernel of this signature, and the constexpr arguments that follow
        ``plan.args`` in ``kernel``'s signature (Triton's compiled launcher takes every parameter, in order,
        as its binder would pass them: keyword or default). A parameter with neither keeps the Triton path."""
        tail = parameter_tail(kernel, len(self.plan.args), constexprs)
        if tail is None:
            return
        self.tail = tail
        self.grid = grid3(self.plan.grid)
        self.compiled = compiled


def _with_base(desc: TensorDescriptor, base) -> TensorDescriptor:
    """``desc`` over another tensor of the same layout, without re-running its checks."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(desc.__dict__)
    d.base = base
    return d


class Cache:
    """Templates by signature (at most :data:`MAX_TEMPLATES`; the oldest go first)."""

    def __init__(self):
        self._templates: dict = {}

    def get(self, key):
        return self._templates.get(key)

    def put(self, key, template) -> None:
        if len(self._templates) >= MAX_TEMPLATES:
            self._templates.pop(next(iter(self._templates)))
        self._templates[key] = template

    def clear(self) -> None:
        self._templates.clear()
