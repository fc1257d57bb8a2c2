"""Output buffers every attention backend writes into (one place for shapes and poisoning)."""

from __future__ import annotations

import os

import torch


def allocate_outputs(problem):
    """``(out, lse or None)`` for a validated :class:`leanfa.problem.Problem`: out ``(B, Sq, Hq, Dv)``
    (varlen ``(total_q, Hq, Dv)``), lse ``(B, Hq, Sq)`` (varlen ``(Hq, total_q)``) float32.

    Filled with NaN first when ``LEANFA_POISON_OUTPUTS=1``, so a test can prove every element
    was written."""
    p = problem
    dev = p.q.device
    if p.varlen:
        out = torch.empty((p.q.shape[0], p.heads, p.head_dim_v), dtype=p.out_dtype, device=dev)
        lse = torch.empty((p.heads, p.q.shape[0]), dtype=torch.float32, device=dev) if p.return_lse else None
    else:
        out = torch.empty((p.batch, p.max_seqlen_q, p.heads, p.head_dim_v), dtype=p.out_dtype, device=dev)
        lse = torch.empty((p.batch, p.heads, p.max_seqlen_q), dtype=torch.float32, device=dev) if p.return_lse else None
    if os.environ.get("LEANFA_POISON_OUTPUTS", "0") == "1":
        out.fill_(float("nan"))
        if lse is not None:
            lse.fill_(float("nan"))
    return out, lse
