"""Shared test helpers: fresh random inputs, relative error, tolerances."""

from __future__ import annotations

import contextlib
import inspect

import torch

# Tolerances on relative L2 error vs float64, per input precision:
# bf16/fp16 operands and P rounded to 16 bits give ~3-6e-3; FP8 e4m3 has 3 mantissa bits
# (2^-4 relative rounding) on Q, K, P and V, ~4-6e-2 on Gaussian data.
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 5e-3, torch.float8_e4m3fn: 9e-2}


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    ref = ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or broken)"
    denom = ref.norm().item()
    return (out - ref).norm().item() / max(denom, 1e-30)


def randn(shape, dtype, device, gen_seed=None, scale=1.0):
    g = torch.Generator().manual_seed(gen_seed) if gen_seed is not None else None
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def qkv(b, sq, sk, hq, hkv, dqk, dv, dtype, device, k_outliers=False, seed=None):
    """Fresh random q/k/v; with k_outliers, K gets a per-channel bias and two huge channels."""
    q = randn((b, sq, hq, dqk), torch.float32, "cpu", seed)
    k = randn((b, sk, hkv, dqk), torch.float32, "cpu", None if seed is None else seed + 1)
    v = randn((b, sk, hkv, dv), torch.float32, "cpu", None if seed is None else seed + 2)
    if k_outliers:
        k = k + torch.randn(dqk) * 2.0
        k[..., 3] += 40.0
        k[..., 17] -= 25.0
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def poison_empty(monkeypatch):
    """``torch.empty`` hands out buffers filled with 0xFF bytes (NaN in float32 and e4m3, -1 in int32), so a test
    sees any element a kernel leaves unwritten (the allocator often hands back zeros, which hide it)."""
    real_empty = torch.empty

    def empty(*args, **kw):
        t = real_empty(*args, **kw)
        t.reshape(-1).view(torch.uint8).fill_(255)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """flash-attn's ``cu_seqlens``: int32 ``[0, l0, l0 + l1, ...]`` for sequence ``lengths``."""
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


class FakeCompiled:
    """What a direct launch needs of Triton's ``CompiledKernel``: ``kernel[grid](*every_parameter)``, whose
    launcher reads ``grid[0]``, ``grid[1]`` and ``grid[2]``; records ``(grid, args)`` per launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.calls.append(((grid[0], grid[1], grid[2]), args))
        return runner


def hopper_accepts_everything(monkeypatch):
    """The dispatcher sees a Hopper kernel that supports every call, on a Triton counted as GPU-validated (so a test
    sees only the dispatcher's own routing, not the self-check an unvalidated Triton runs), with its
    once-per-process warnings reset."""
    from leanfa.kernels import dispatch

    class AcceptingHopper:
        from leanfa.kernels.hopper import HEAD_DIMS

        @staticmethod
        def supports(problem):
            return True, ""

        @staticmethod
        def paged_problem(page_size, v):
            return None

    monkeypatch.setattr(dispatch, "_hopper", lambda: AcceptingHopper)
    monkeypatch.setattr(dispatch._versions, "triton_gpu_validated", lambda: True)
    monkeypatch.setattr(dispatch, "_WARNED", set())
    return dispatch


def public_call(q, k, v, *, precision, cu=None, **kw):
    """The public API as a user calls it: BF16 ``flash_attn_func`` (``flash_attn_varlen_func`` with ``cu``, a dict of
    ``cu_seqlens_q/k`` and ``max_seqlen_q/k``), else ``leanfa.attention(precision=...)``; ``kw`` passed through."""
    import leanfa

    if precision == "bf16":
        if cu is None:
            return leanfa.flash_attn_func(q, k, v, **kw)
        return leanfa.flash_attn_varlen_func(q, k, v, **cu, **kw)
    return leanfa.attention(q, k, v, precision=precision, **(cu or {}), **kw)


def check_out_lse(out, lse, ref, ref_lse, tol, lse_tol):
    """No NaN (every element written over the poison), ``out`` within ``tol`` relative L2 of ``ref``, the LSE -inf
    exactly where ``ref_lse`` is (rows with no visible key, whose output must be 0), finite LSEs within ``lse_tol``.
    ``out`` is ``(B, S, H, D)`` or packed ``(total, H, D)``, the LSE ``(B, H, S)`` or ``(H, total)``."""
    assert not torch.isnan(out).any(), "NaN (or never written) in out"
    assert not torch.isnan(lse).any(), "NaN (or never written) in lse"
    err = float((out.double() - ref).norm() / ref.norm().clamp(min=1e-30))
    assert err < tol, err
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "LSE -inf pattern (rows with no visible key)"
    rows_out = out.transpose(-3, -2) if out.dim() == 4 else out.transpose(0, 1)  # (.., H, S, D) as the LSE
    assert rows_out[empty].abs().max() == 0 if empty.any() else True, "rows with no key are 0"
    if (~empty).any():
        lse_err = float((lse.double() - ref_lse)[~empty].abs().max())
        assert lse_err < lse_tol, lse_err


def quantized_problem(q, k, v, *, causal, precision, lse=True, cu=None, **options):
    """A validated :class:`leanfa.problem.Problem` of BF16 ``q, k, v`` in ``precision``: ``"bf16"`` as they are,
    ``"fp8"`` through ``quantize_fp8`` (K smoothed), ``"fp8qk"`` FP8 Q/K with the 16-bit V (the mixed mode); ``cu``
    the packed batch's ``cu_seqlens_q/k`` and ``max_seqlen_q/k``; ``options`` (``window_size``, ``softcap``) passed
    to ``_build_problem``."""
    import leanfa
    from leanfa.api import _build_problem

    kw = dict(q_descale=None, k_descale=None, v_descale=None, k_mean=None)
    if precision == "fp8":
        qq = leanfa.quantize_fp8(q, k, v, **(cu or {}))
        q, k, v, kw = qq.q, qq.k, qq.v, qq.descales()
    elif precision == "fp8qk":
        qq = leanfa.quantize_fp8(q, k, v, **(cu or {}))
        q, k = qq.q, qq.k
        kw = dict(q_descale=qq.q_descale, k_descale=qq.k_descale, v_descale=None, k_mean=qq.k_mean)
    cu = cu or dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
    return _build_problem(q, k, v, varlen=cu["cu_seqlens_q"] is not None, **cu, softmax_scale=None, causal=causal,
                          return_lse=lse, out_dtype=None, **options, **kw)


@contextlib.contextmanager
def mutated(fn, edits):
    """The Hopper emulator runs ``fn`` (a ``@gluon.jit`` function) with each ``(old, new)`` of ``edits`` made in its
    source (each ``old`` must be there) inside the block; the real source again after it."""
    from leanfa.kernels.hopper.emulate import reset_shadows, shadow

    src = inspect.getsource(fn.fn)
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new)
    reset_shadows()
    shadow(fn, source=src)
    try:
        yield
    finally:
        reset_shadows()
