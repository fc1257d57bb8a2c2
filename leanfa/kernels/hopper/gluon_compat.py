"""The Gluon and Triton compiler names the Hopper kernels use, the same on every supported Triton.

Gluon (``triton.experimental.gluon``) is experimental and renames its API between Triton releases. The
kernel modules import every Gluon name from here, and the kernels are written against the Triton 3.6
spelling; where an installed Triton spells a name differently, this module supplies the 3.6 name bound to
the new implementation. On Triton 3.6 every name below *is* Triton's own object (nothing is wrapped).

The moves covered (Triton 3.6 -> 3.9; :data:`RENAMED` lists those that apply to the installed Triton):

* ``gl.thread_barrier()`` became ``gl.barrier()`` in 3.7 (``cluster=False``: the same ``bar.sync`` of the
  CTA). ``gl`` here is then a copy of Gluon's language namespace with ``thread_barrier`` added.
* ``tma.async_copy_global_to_shared`` / ``tma.async_copy_shared_to_global`` became ``tma.async_load`` /
  ``tma.async_store`` in 3.8 (3.8 keeps the old names as aliases, 3.9 as stubs that raise); ``tma`` here
  binds the old names to the new builtins.
* ``warp_specialize([(fn, args), ...], worker_num_warps, worker_num_regs)``, ``warpgroup_mma`` /
  ``warpgroup_mma_wait``, ``mbarrier.init/expect/arrive/wait/invalidate``, ``allocate_shared_memory``, the
  layout classes, ``gluon.jit(do_not_specialize=...)``, ``GluonASTSource(fn, signature, constexprs)`` and
  ``GPUTarget`` keep their 3.6 signatures through 3.9 (each use compiles for sm90 on 3.6-3.9: the AOT
  check, ``scripts/hopper_compile_check.py``); they are re-exported unchanged.

A renamed name is added to a fresh plain module object (``types.ModuleType``: Gluon's code generator
accepts only that exact type as a global namespace), never to Triton's own modules.
"""

from __future__ import annotations

import types

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as _gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.language.nvidia.hopper import mbarrier as _mbarrier
from triton.experimental.gluon.language.nvidia.hopper import tma as _tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

__all__ = ["GPUTarget", "GluonASTSource", "RENAMED", "TensorDescriptor", "fence_async_shared", "gl", "gluon",
           "mangle_type", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait"]

#: ``"module.old_name -> new_name"`` for each 3.6 name this module supplies on the installed Triton
RENAMED: list[str] = []


def _with_names(module, short: str, names: dict[str, tuple[str, ...]]):
    """``module`` itself when it has none of the newer spellings in ``names`` (``{3.6 name: (newer
    spellings, newest first)}``); else a copy of its namespace with each 3.6 name bound to the newest spelling
    ``module`` has (a 3.6 name a Triton keeps may be a stub that raises: 3.9's ``tma.async_copy_*``)."""
    renamed = {}
    for name, spellings in names.items():
        new = next((s for s in spellings if hasattr(module, s)), None)
        if new is not None:
            renamed[name] = getattr(module, new)
            RENAMED.append(f"{short}.{name} -> {new}")
        elif not hasattr(module, name):
            raise ImportError(f"triton {triton.__version__}: Gluon's {module.__name__} has neither {name} "
                              f"nor any of {', '.join(spellings)}")
    if not renamed:
        return module
    ns = types.ModuleType(f"{__name__}.{short}", module.__doc__)
    ns.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    ns.__dict__.update(renamed)
    return ns


gl = _with_names(_gl, "gl", {"thread_barrier": ("barrier",)})
tma = _with_names(_tma, "tma", {"async_copy_global_to_shared": ("async_load",),
                                "async_copy_shared_to_global": ("async_store",)})
mbarrier = _mbarrier
