"""Random-sign Hadamard rotations of the head dim: used by the quantizer's ``rotate=True``
(:func:`leanfa.quant.rotation_matrix`) and by the accuracy model (:mod:`leanfa.accuracy_model`)."""

from __future__ import annotations

import math

import torch


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def _paley12() -> torch.Tensor:
    """Hadamard matrix of order 12 (Paley construction I, q = 11)."""
    q = 11
    residues = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if i in residues else -1 for i in range(1, q)]
    qm = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = qm
    return s + torch.eye(q + 1, dtype=torch.float64)


def hadamard_pm1(n: int) -> torch.Tensor:
    """A ±1 Hadamard matrix of order ``n`` (``H Hᵀ = n I``): Sylvester for powers of two,
    Paley-12 ⊗ Sylvester for 12·2^k (e.g. 192); float64."""
    if n >= 1 and n & (n - 1) == 0:
        return _sylvester(n)
    if n % 12 == 0 and (n // 12) & (n // 12 - 1) == 0:
        return torch.kron(_paley12(), _sylvester(n // 12))
    raise ValueError(f"no Hadamard matrix of order {n} here (need 2^k or 12*2^k)")


def random_hadamard_pm1(n: int, seed: int = 0) -> torch.Tensor:
    """``diag(±1) H`` (float64, entries ±1) with seeded random signs: :func:`random_hadamard` times sqrt(n)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
    return signs[:, None] * hadamard_pm1(n)


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """Orthogonal ``diag(±1) H / sqrt(n)`` (float64); ``x @ R`` rotates the head dim."""
    return random_hadamard_pm1(n, seed) / math.sqrt(n)
