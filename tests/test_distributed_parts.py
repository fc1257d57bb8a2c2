"""leanfa.distributed's parts in one process: the LSE merge, the layout, packing a K/V block, the visibility of
chunk pairs and the cross-rank argument check (tests/test_distributed.py runs the whole on several processes)."""

from __future__ import annotations

import math

import pytest
import torch

from leanfa.distributed import chunk_sizes, merge_into, shard_positions
from leanfa.distributed.attention import DIAGONAL, FULL, NONE, visibility
from leanfa.distributed.checks import describe, validate
from leanfa.distributed.layout import shard_of, unshard_from, varlen_runs, varlen_shard_indices
from leanfa.distributed.ring import ALIGN, pack, unpack



def HEAD_DIMS(dqk, dv):  # (a stand-in for leanfa.api.head_dims_problem: 64 and 128 only)
    return None if dqk == dv and dqk in (64, 128) else f"head dims (q/k {dqk}, v {dv}) are not supported"


def _attend(q, k, v, mask=None):
    """float64 attention (B, S, H, D) with an optional (Sq, Sk) bool mask of visible keys -> out, lse (B, H, S)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def test_merge_of_two_key_sets_is_attention_over_their_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((2, 5, 3, 8), generator=g, dtype=torch.float64) for _ in range(3))
    k = k * 3  # peaked softmax: weights far from uniform
    full, full_lse = _attend(q, k, v)
    acc_out = torch.zeros_like(full, dtype=torch.float32)
    acc_lse = torch.full(full_lse.shape, -math.inf, dtype=torch.float32)
    for part in (slice(0, 2), slice(2, 5)):  # keys 0-1, then 2-4
        o, l = _attend(q, k[:, part], v[:, part])
        merge_into(acc_out, acc_lse, o.float(), l.float())
    assert torch.allclose(acc_out.double(), full, atol=1e-5)
    assert torch.allclose(acc_lse.double(), full_lse, atol=1e-5)


def test_merge_keeps_rows_that_saw_no_key_at_zero_and_minus_inf():
    acc_out = torch.zeros((1, 3, 1, 4))
    acc_lse = torch.full((1, 1, 3), -math.inf)
    out = torch.ones((1, 3, 1, 4))
    lse = torch.tensor([[[-math.inf, 0.5, -math.inf]]])
    merge_into(acc_out, acc_lse, torch.where(torch.isneginf(lse).transpose(1, 2)[..., None], 0.0, out), lse)
    merge_into(acc_out, acc_lse, torch.zeros_like(out), torch.full_like(lse, -math.inf))  # an empty part
    assert not acc_out.isnan().any()
    assert acc_out[0, 1].eq(1).all() and acc_out[0, 0].eq(0).all() and acc_out[0, 2].eq(0).all()
    assert acc_lse[0, 0, 1] == 0.5 and acc_lse[0, 0, 0] == -math.inf and acc_lse[0, 0, 2] == -math.inf


def test_chunks_and_shards():
    assert chunk_sizes(16, 2) == [4, 4, 4, 4]
    assert chunk_sizes(11, 2) == [3, 3, 3, 2]
    assert chunk_sizes(3, 2) == [1, 1, 1, 0]
    # rank r holds chunks r and 2W-1-r, in that order
    assert shard_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert shard_positions(11, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    for total, world in ((16, 2), (11, 2), (37, 4), (3, 4), (0, 3)):
        x = torch.arange(2 * total).reshape(2, total)
        shards = [shard_of(x, r, world) for r in range(world)]
        for r, s in enumerate(shards):
            assert s[0].tolist() == shard_positions(total, world, r).tolist()
        assert torch.equal(unshard_from(shards), x)
    with pytest.raises(ValueError, match="rank 0's shard has 6 tokens along dim 1; the layout of 11 tokens over 2 "
                                         "ranks gives it 5"):
        unshard_from([torch.zeros(1, 6), torch.zeros(1, 5)])


def test_varlen_shards_are_chunk_major_and_cover_every_token_once():
    cu = [0, 5, 5, 16]  # lengths 5, 0, 11 over 2 ranks: chunks (2, 1, 1, 1), (), (3, 3, 3, 2)
    assert varlen_shard_indices(cu, 2, 0).tolist() == [0, 1, 5, 6, 7, 4, 14, 15]  # first chunks, then second ones
    assert varlen_shard_indices(cu, 2, 1).tolist() == [2, 8, 9, 10, 3, 11, 12, 13]
    for world in (1, 2, 3, 4):
        idx = [varlen_shard_indices(cu, world, r) for r in range(world)]
        assert sorted(torch.cat(idx).tolist()) == list(range(16))  # every token on exactly one rank
        halves = [varlen_runs(cu, world, r) for r in range(world)]
        assert [sum(map(sum, h)) for h in halves] == [len(i) for i in idx]


def test_causal_work_is_even_across_ranks():
    """Query-key pairs under the causal mask per rank, for a cut into equal chunks: all ranks the same."""
    for world in (1, 2, 4, 8):
        total = 2 * world * 8
        work = []
        for r in range(world):
            pos = shard_positions(total, world, r)
            work.append(int((pos + 1).sum()))  # query at position p sees p + 1 keys
        assert len(set(work)) == 1, work


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_visibility_of_chunk_pairs_is_the_causal_mask(world):
    """Over every (query chunk, key chunk) pair, FULL/DIAGONAL/NONE reassemble the causal mask exactly."""
    total = 2 * world * 3
    starts = [0]
    for n in chunk_sizes(total, world):
        starts.append(starts[-1] + n)
    mask = torch.zeros((total, total), dtype=torch.bool)
    for a in range(2 * world):
        for b in range(2 * world):
            qa, kb = slice(starts[a], starts[a + 1]), slice(starts[b], starts[b + 1])
            seen = visibility(a, b, True)
            assert visibility(a, b, False) == FULL
            if seen == FULL:
                mask[qa, kb] = True
            elif seen == DIAGONAL:
                mask[qa, kb] = torch.ones((3, 3), dtype=torch.bool).tril()
            else:
                assert seen == NONE
    assert torch.equal(mask, torch.ones((total, total), dtype=torch.bool).tril())


def test_pack_keeps_layouts_and_alignment():
    """Packing moves each tensor's storage as it is: a transposed FP8-like view stays transposed."""
    store = torch.arange(2 * 3 * 4 * 16, dtype=torch.uint8).reshape(2, 3, 4, 16)
    v = store.view(torch.float8_e4m3fn).permute(0, 3, 1, 2)[:, :13]  # (B, S, H, D), stride(1) == 1
    k = torch.randn(2, 13, 3, 4, dtype=torch.bfloat16)
    d = torch.rand(2, 3, 1)
    buf, pieces = pack([k, d, v])
    assert buf.dtype == torch.uint8 and all(p.offset % ALIGN == 0 for p in pieces)
    k2, d2, v2 = unpack(buf.clone(), pieces)
    assert torch.equal(k2, k) and torch.equal(d2, d)
    assert v2.stride() == v.stride() and torch.equal(v2.view(torch.uint8), v.view(torch.uint8))


def _desc(shape=(1, 8, 2, 64), kv_shape=None, dtype=torch.bfloat16, causal=True, precision="bf16"):
    q = torch.empty(shape, dtype=dtype)
    kv = torch.empty(kv_shape or shape, dtype=dtype)
    return describe(q, kv, kv, causal, precision, None, "auto")


def test_validate_returns_total_and_names_the_disagreeing_rank():
    assert validate([_desc((1, 8, 2, 64)), _desc((1, 8, 2, 64))], HEAD_DIMS) == 16
    assert validate([_desc((1, 5, 2, 64)), _desc((1, 6, 2, 64))], HEAD_DIMS) == 11  # chunks 3, 3, 3, 2
    with pytest.raises(ValueError, match="ranks disagree on causal.*rank 2 has False"):
        validate([_desc(), _desc(), _desc(causal=False)], HEAD_DIMS)
    with pytest.raises(ValueError, match="ranks disagree on k"):
        validate([_desc(), _desc(kv_shape=(1, 8, 1, 64))], HEAD_DIMS)
    with pytest.raises(ValueError, match="rank 0 holds 6 tokens.*gives it 5"):
        validate([_desc((1, 6, 2, 64)), _desc((1, 5, 2, 64))], HEAD_DIMS)
    with pytest.raises(TypeError, match="q on rank 0 has dtype torch.float32"):
        validate([_desc(dtype=torch.float32), _desc()], HEAD_DIMS)
    with pytest.raises(ValueError, match="precision on rank 1"):
        validate([_desc(), _desc(precision="fp4")], HEAD_DIMS)
    with pytest.raises(ValueError, match="head dims .q/k 32"):
        validate([_desc((1, 8, 2, 32))], HEAD_DIMS)
    bad = describe("not a tensor", None, None, True, "bf16", None, "auto")  # describing never raises
    with pytest.raises(TypeError, match="q on rank 1 must be a torch.Tensor, got str"):
        validate([_desc(), bad], HEAD_DIMS)


def test_fp8_block_is_about_half_the_bytes_of_bf16():
    from leanfa.distributed.attention import _Shard16, _ShardFP8

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn((1, 256, 2, 64), generator=g).to(torch.bfloat16) for _ in range(3))
    bf16 = pack(_Shard16(q, k, v, 256, 1, 0).payload())[0].numel()
    fp8 = pack(_ShardFP8(q, k, v, 256, 1, 0, _ShardFP8.sums(k)).payload())[0].numel()
    assert bf16 == 2 * 256 * 2 * 64 * 2
    assert fp8 <= 0.52 * bf16, (fp8, bf16)  # FP8 K and V, plus their descales


def test_validate_packed_batches():
    def packed(tokens, cu, heads=2):
        t = torch.empty((tokens, heads, 64), dtype=torch.bfloat16)
        return describe(t, t, t, True, "fp8", None, "auto", None if cu is None else torch.tensor(cu, dtype=torch.int32))

    cu = [0, 5, 5, 16]  # rank 0 holds 8 tokens, rank 1 holds 8 (test_varlen_shards_are_chunk_major...)
    assert validate([packed(8, cu), packed(8, cu)], HEAD_DIMS) == 16
    with pytest.raises(ValueError, match="ranks disagree on cu_seqlens"):
        validate([packed(8, cu), packed(8, [0, 6, 6, 16])], HEAD_DIMS)
    with pytest.raises(ValueError, match="cu_seqlens ends at 16 but the ranks hold 17 tokens"):
        validate([packed(8, cu), packed(9, cu)], HEAD_DIMS)
    assert validate([packed(9, [0, 5, 5, 17]), packed(8, [0, 5, 5, 17])], HEAD_DIMS) == 17
    with pytest.raises(ValueError, match="rank 0 holds 8 tokens.*gives it 9"):
        validate([packed(8, [0, 5, 5, 17]), packed(9, [0, 5, 5, 17])], HEAD_DIMS)
    with pytest.raises(ValueError, match="cu_seqlens on rank 0 must be"):
        validate([packed(8, [0, 5, 3, 16]), packed(8, [0, 5, 3, 16])], HEAD_DIMS)
    with pytest.raises(ValueError, match=r"q on rank 1 must be \(tokens, heads, head_dim\)"):
        bad = describe(torch.empty((1, 8, 2, 64), dtype=torch.bfloat16), None, None, True, "fp8", None, "auto",
                       torch.tensor(cu, dtype=torch.int32))
        validate([packed(8, cu), bad], HEAD_DIMS)
