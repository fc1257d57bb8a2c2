"""Exact merge of partial attention results through their log-sum-exps.

Attention of a query row over a key set ``K = K_a ∪ K_b`` (disjoint) from the results over each part:
``lse = log(exp(lse_a) + exp(lse_b))`` and ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``.
No approximation: the softmax over ``K`` is the two partial softmaxes reweighted by their share of the
total mass. A part the row saw no key of has ``lse = -inf`` and weight 0; a row that saw no key in
either stays ``out = 0``, ``lse = -inf`` (leanfa's convention for such rows).
"""

from __future__ import annotations

import torch


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a partial result into an accumulator, in place, in float32.

    ``acc_out``: ``(B, S, H, Dv)`` float32, ``acc_lse``: ``(B, H, S)`` float32 (start them at 0 and
    ``-inf``); ``out``: ``(B, S, H, Dv)`` (any float dtype), ``lse``: ``(B, H, S)`` float32 — leanfa's
    ``(out, lse)`` layouts. Afterwards the accumulator holds attention over the union of the key sets.
    """
    new_lse = torch.logaddexp(acc_lse, lse)
    empty = torch.isneginf(new_lse)
    safe = torch.where(empty, torch.zeros_like(new_lse), new_lse)
    zero = torch.zeros_like(new_lse)
    w_acc = torch.where(empty, zero, torch.exp(acc_lse - safe)).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    w_new = torch.where(empty, zero, torch.exp(lse - safe)).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(w_new * out.float())
    acc_lse.copy_(new_lse)
