"""The varlen tile table (leanfa/kernels/hopper/varlen_tiles.py), on the CPU: every real (sequence, query tile)
pair exactly once, heaviest first, and nothing else."""

import pytest
import torch

from leanfa.kernels.hopper import varlen_tiles

BM = 128


def _pairs(table):
    n = int(table[0])
    return n, [(int(p) >> varlen_tiles.PAIR_SHIFT, int(p) & 0xFFFF) for p in table[1:1 + n]], table[1 + n:]


def _seen(b, m, lq, lk, causal):
    return max(0, min(lk[b], (m + 1) * BM + lk[b] - lq[b])) if causal else lk[b]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens", [
    ([300, 0, 1, 699], None),
    ([1], [1]),
    ([0, 0], [0, 5]),
    ([128, 129, 127, 12000] + [50] * 40, None),
    ([200, 64, 1000], [900, 64, 3000]),  # chunked prefill: Sq < Sk
    ([500, 300], [100, 300]),  # Sq > Sk: rows before the first key see nothing
])
def test_table_lists_every_real_tile_once_heaviest_first(lens, causal):
    lq, lk = lens[0], lens[1] or lens[0]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    table = varlen_tiles.build(cu_q, cu_k, sum(lq), causal, BM)
    assert table.dtype == torch.int32
    assert table.numel() == 1 + varlen_tiles.capacity(sum(lq), len(lq), BM)
    n, pairs, padding = _pairs(table)
    expected = {(b, m) for b, length in enumerate(lq) for m in range(-(-length // BM))}
    assert n == len(expected) and sorted(pairs) == sorted(expected)
    assert bool((padding == -1).all())
    costs = [_seen(b, m, lq, lk, causal) for b, m in pairs]
    assert costs == sorted(costs, reverse=True)


def test_limits_are_refused():
    assert varlen_tiles.table_problem(1000, varlen_tiles.MAX_SEQUENCES, BM)
    assert varlen_tiles.table_problem(varlen_tiles.MAX_TILES_PER_SEQUENCE * BM, 2, BM)
    assert varlen_tiles.table_problem(10_000, 3, BM) is None
