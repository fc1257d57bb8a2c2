"""Launching a Triton kernel's compiled binary directly, once a call of the same specialization compiled it.

``kernel[grid](*args, **kw)`` binds and specializes every argument on each call (Triton's JIT: ~30-50 us of
host time for a launch with tens of arguments on the H200's host; docs/perf-notes.md, "The host path"),
although for a given kernel the result is fixed by what it specializes on: each tensor's dtype and 16-byte
alignment, each integer's value class, the constexpr keywords. :class:`DirectLaunch` keys on a finer version
of that (integers by value), keeps the ``CompiledKernel`` the first launch of a key returns, and launches it
directly after that (``compiled[grid](*every parameter)``, as :mod:`.hopper.plan_cache` does for the Hopper
kernel). Under the Triton interpreter there is no compiled kernel: every launch goes through the JIT.
"""

from __future__ import annotations

import os

import torch

try:
    from triton.compiler.compiler import CompiledKernel
except ImportError:  # pragma: no cover - an older Triton
    CompiledKernel = ()

#: the launches through :class:`DirectLaunch` (the quantizer's, the varlen V re-pack): on by default, as they pass
#: the GPU check (``scripts/gpu_session.sh direct_launch``: 93 GPU tests, every quantizer output bit for bit the
#: JIT launch's, including the block-scale slots past a packed sequence's end, which the quantizer fills with 1;
#: docs/perf-notes.md, "The four gates"); ``LEANFA_DIRECT_LAUNCH=0`` sends every launch through the JIT
VALIDATED = True
MAX_KEYS = 256


def enabled() -> bool:
    """Whether :class:`DirectLaunch` may skip the JIT (:data:`VALIDATED`, or ``LEANFA_DIRECT_LAUNCH=1``;
    ``=0`` turns it off)."""
    knob = os.environ.get("LEANFA_DIRECT_LAUNCH", "")
    return knob == "1" or (VALIDATED and knob != "0")


def parameter_tail(kernel, n_args: int, keywords: dict):
    """The values of ``kernel``'s parameters after its first ``n_args``, as Triton's binder binds them (the
    keyword, else the default); None when one has neither."""
    tail = []
    for p in kernel.params[n_args:]:
        if p.name in keywords:
            tail.append(keywords[p.name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def grid3(grid) -> tuple:
    """``grid`` in three dimensions (a compiled kernel's launcher reads all three)."""
    return (*grid, 1, 1)[:3]


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, float):
        return float
    return type(a), a  # ints (and bools, None): Triton specializes on their values


class DirectLaunch:
    """``DirectLaunch(kernel)[grid](*args, **constexprs)``: ``kernel[grid](...)``, directly on the compiled kernel
    when a launch of the same key (device, argument specialization, keywords) compiled it before."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kw: self._launch(grid, args, kw)

    def _launch(self, grid, args: tuple, kw: dict):
        if not enabled():
            return self.kernel[grid](*args, **kw)
        key = (torch.cuda.current_device() if torch.cuda.is_available() else None,
               tuple(map(_arg_key, args)), tuple(sorted(kw.items())))
        hit = self._compiled.get(key)
        if hit is not None:
            compiled, tail = hit
            return compiled[grid3(grid)](*args, *tail)
        compiled = self.kernel[grid](*args, **kw)
        if not isinstance(compiled, CompiledKernel):  # (the interpreter)
            return compiled
        tail = parameter_tail(self.kernel, len(args), kw)
        if tail is not None:
            if len(self._compiled) >= MAX_KEYS:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = (compiled, tail)
        return compiled
