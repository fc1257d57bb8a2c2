"""Arguments of a context-parallel call, checked across ranks: one error, the same on every rank.

A rank that raised on its own while the others went on into a collective would leave them waiting
forever. So nothing is checked locally: every rank describes its arguments in plain values
(:func:`describe`, which never raises), one ``all_gather_object`` gives every rank every description,
and :func:`validate` — a pure function of that list — raises the same error everywhere, naming the rank.
"""

from __future__ import annotations

import torch

from .layout import shard_sizes, varlen_runs

#: the 16-bit input dtypes (the kernels' FP8 inputs are made here, from these)
INPUT_DTYPES = ("torch.bfloat16", "torch.float16")
PRECISIONS = ("fp8", "bf16")


def _tensor(t):
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return (tuple(t.shape), str(t.dtype), t.device.type)


def _cu(cu):
    if cu is None:
        return None
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and not cu.is_floating_point():
        return tuple(int(x) for x in cu.tolist())
    return repr(cu)


def describe(q, k, v, causal, precision, softmax_scale, backend, cu_seqlens=None) -> dict:
    """This rank's arguments as plain, picklable values (``cu_seqlens``: the full batch's, for packed inputs)."""
    return dict(q=_tensor(q), k=_tensor(k), v=_tensor(v), cu_seqlens=_cu(cu_seqlens),
                causal=causal if isinstance(causal, bool) else repr(causal),
                precision=precision if isinstance(precision, str) else repr(precision),
                softmax_scale=softmax_scale if isinstance(softmax_scale, (float, int, type(None))) else repr(softmax_scale),
                backend=backend if isinstance(backend, str) else repr(backend))


def _per_rank(r: int, d: dict, head_dims) -> None:
    cu = d["cu_seqlens"]
    if isinstance(cu, str) or (cu is not None and (not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])))):
        raise ValueError(f"context_parallel_attention: cu_seqlens on rank {r} must be a 1-D integer tensor from 0, "
                         f"not decreasing (the full batch's), got {cu}")
    rank_of_tensors, layout = (3, "(tokens, heads, head_dim)") if cu is not None else (4, "(batch, seqlen, heads, head_dim)")
    for name in ("q", "k", "v"):
        if not isinstance(d[name], tuple):
            raise TypeError(f"context_parallel_attention: {name} on rank {r} must be a torch.Tensor, got {d[name]}")
        shape, dtype, _ = d[name]
        if len(shape) != rank_of_tensors:
            raise ValueError(f"context_parallel_attention: {name} on rank {r} must be {layout}, got shape {shape}")
        if dtype not in INPUT_DTYPES:
            raise TypeError(f"context_parallel_attention: {name} on rank {r} has dtype {dtype}; expected "
                            f"torch.bfloat16 or torch.float16")
    (qs, qt, qdev), (ks, kt, kdev), (vs, vt, vdev) = d["q"], d["k"], d["v"]
    if cu is not None:  # as (1, tokens, heads, head_dim) from here on
        qs, ks, vs = (1, *qs), (1, *ks), (1, *vs)
    if not (qt == kt == vt) or not (qdev == kdev == vdev):
        raise TypeError(f"context_parallel_attention: q, k, v on rank {r} must share dtype and device, got "
                        f"{qt}/{kt}/{vt} on {qdev}/{kdev}/{vdev}")
    if not (qs[0] == ks[0] == vs[0]) or not (qs[1] == ks[1] == vs[1]):
        raise ValueError(f"context_parallel_attention: q, k, v on rank {r} must share batch and sequence "
                         f"(self-attention over one shard), got shapes {qs}, {ks}, {vs}")
    if ks[2] != vs[2] or qs[2] % ks[2] or qs[3] != ks[3]:
        raise ValueError(f"context_parallel_attention: on rank {r}, k and v need the same heads, q's heads a "
                         f"multiple of them and q, k the same head_dim; got shapes {qs}, {ks}, {vs}")
    why = head_dims(qs[3], vs[3])
    if why:
        raise ValueError(f"context_parallel_attention: on rank {r}: {why}")
    if not isinstance(d["causal"], bool):
        raise TypeError(f"context_parallel_attention: causal on rank {r} must be a bool, got {d['causal']}")
    if d["precision"] not in PRECISIONS:
        raise ValueError(f"context_parallel_attention: precision on rank {r} must be one of {PRECISIONS}, "
                         f"got {d['precision']!r}")


def validate(descs: list[dict], head_dims) -> int:
    """Raise if any rank's arguments are bad or the ranks disagree; else return the total sequence length.
    ``head_dims(dqk, dv)``: why those head dims are not supported, or None."""
    world = len(descs)
    for r, d in enumerate(descs):
        _per_rank(r, d, head_dims)
    first = descs[0]
    seq = 0 if first["cu_seqlens"] is not None else 1  # the axis of the tokens

    def agreed(d):  # everything but the shard's length
        return {key: ((*val[0][:seq], *val[0][seq + 1:]), *val[1:]) if key in ("q", "k", "v") else val
                for key, val in d.items()}

    ref = agreed(first)
    for r, d in enumerate(descs[1:], start=1):
        mine = agreed(d)
        for key in ref:
            if mine[key] != ref[key]:
                what = "shape (seqlen aside), dtype, device" if key in ("q", "k", "v") else "value"
                raise ValueError(f"context_parallel_attention: ranks disagree on {key} ({what}): rank 0 has "
                                 f"{first[key]}, rank {r} has {d[key]}")
    lengths = [d["q"][0][seq] for d in descs]
    total = sum(lengths)
    cu = first["cu_seqlens"]
    if cu is not None and cu[-1] != total:
        raise ValueError(f"context_parallel_attention: cu_seqlens ends at {cu[-1]} but the ranks hold {total} tokens "
                         f"({lengths} by rank)")
    for r, n in enumerate(lengths):
        want = sum(shard_sizes(total, world, r)) if cu is None else sum(map(sum, varlen_runs(cu, world, r)))
        if n != want:
            raise ValueError(f"context_parallel_attention: rank {r} holds {n} tokens; the load-balanced layout of "
                             f"{total} tokens ({lengths} by rank) over {world} ranks gives it {want} "
                             f"(leanfa.distributed.shard / shard_varlen cut a full batch that way)")
    return total
