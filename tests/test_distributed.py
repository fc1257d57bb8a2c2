"""leanfa.distributed across processes: 1, 2 and 4 ranks with the gloo backend on CPU (kernels under Triton's
interpreter, as conftest.py sets up), against the single-process call and the float64 reference.

Each world size is one ``torch.multiprocessing`` spawn (module-scoped fixture) that runs every case of that
world and saves the unsharded results; the tests then compare. A spawn that outlives its deadline is
killed and fails the tests (a hang is a failure, never a stuck CI job).
"""

from __future__ import annotations

import functools
import os
import socket
import time
import traceback

import pytest
import torch

import leanfa
from leanfa.reference import attention_ref

from helpers import rel_l2

#: seconds a spawn may take, all its cases included
DEADLINE = 240

# (name, world sizes, batch, total tokens, q heads, kv heads, causal, precision). A world of 1 runs in the
# 2-process spawn, each rank alone in its own group; "x2" runs on 4 processes as two groups of 2 ranks
# (global ranks 2 and 3 form a ring whose peers are not their group ranks).
CASES = [
    ("bf16-causal", (2, "x2"), 1, 64, 2, 2, True, "bf16"),
    ("bf16-full", (2,), 1, 64, 2, 2, False, "bf16"),
    ("fp8-causal", (2, "x1"), 1, 96, 2, 2, True, "fp8"),
    ("fp8-full", (2,), 1, 64, 2, 2, False, "fp8"),
    ("bf16-causal-odd-gqa", (2,), 2, 67, 4, 2, True, "bf16"),
    ("fp8-causal-odd", (2, 4), 1, 101, 2, 1, True, "fp8"),
]
# packed batches: (name, world sizes, sequence lengths, q heads, kv heads, causal, precision); an empty
# sequence, and one shorter than 2W (empty chunks)
VARLEN_CASES = [
    ("varlen-bf16-causal", (2, 4), (37, 0, 3, 50), 2, 1, True, "bf16"),
    ("varlen-fp8-causal", (2,), (37, 0, 3, 50), 2, 2, True, "fp8"),
]
DIM = 64


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _inputs(batch, total, hq, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((batch, total, hq, DIM), generator=g).to(torch.bfloat16)
    k = (torch.randn((batch, total, hkv, DIM), generator=g) + 0.5 * torch.randn((DIM,), generator=g)).to(torch.bfloat16)
    v = torch.randn((batch, total, hkv, DIM), generator=g).to(torch.bfloat16)
    return q, k, v


def _worker(rank, world, port, folder):
    import torch.distributed as dist

    from leanfa.distributed import (context_parallel_attention, context_parallel_varlen_attention, shard,
                                    shard_varlen, unshard, unshard_varlen)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # every rank creates every group, in one order; each rank keeps its own
    groups = {world: None}
    for size, key in ((1, "x1"), (2, "x2")):
        if world == 2 * size:
            for first in range(0, world, size):
                group = dist.new_group(list(range(first, first + size)))
                if first <= rank < first + size:
                    groups[key] = group
    results = {}
    try:
        for seed, (name, worlds, batch, total, hq, hkv, causal, precision) in enumerate(CASES):
            q, k, v = _inputs(batch, total, hq, hkv, seed)
            for key in worlds:
                if key not in groups:
                    continue
                g = groups[key]
                out, lse = context_parallel_attention(shard(q, g), shard(k, g), shard(v, g), group=g, causal=causal,
                                                      precision=precision, return_lse=True)
                results[(name, key)] = (unshard(out, g), unshard(lse, g, dim=2))
        for seed, (name, worlds, lengths, hq, hkv, causal, precision) in enumerate(VARLEN_CASES, start=len(CASES)):
            if world not in worlds:
                continue
            q, k, v = (x[0] for x in _inputs(1, sum(lengths), hq, hkv, seed))
            cu = _cu(lengths)
            out, lse = context_parallel_varlen_attention(shard_varlen(q, cu), shard_varlen(k, cu), shard_varlen(v, cu),
                                                         cu, causal=causal, precision=precision, return_lse=True)
            results[(name, world)] = (unshard_varlen(out, cu), unshard_varlen(lse, cu, dim=1))
        # ranks that disagree: rank 1 has one head fewer (each rank's own arguments valid), the last rank
        # another causal flag
        q, k, v = _inputs(1, 8 * world, 2, 2, 0)
        q, k, v = shard(q), shard(k), shard(v)
        one_head = dict(q=q[:, :, :1], k=k[:, :, :1], v=v[:, :, :1]) if rank == 1 else {}
        bad = [one_head, dict(causal=rank != world - 1)] if world > 1 else []
        results["errors"] = []
        for change in bad:
            args = dict(q=q, k=k, v=v, causal=True, precision="bf16") | change
            try:
                context_parallel_attention(**args)
                results["errors"].append(None)
            except (ValueError, TypeError) as e:
                results["errors"].append(str(e))
        dist.barrier()
    except Exception:
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, folder):
    import torch.multiprocessing as mp

    start = time.time()
    ctx = mp.start_processes(_worker, args=(world, _free_port(), str(folder)), nprocs=world, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=2):
        if time.time() - start > DEADLINE:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{world} ranks did not finish within {DEADLINE} s (a hang?)")
    ranks = [torch.load(folder / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(ranks):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return ranks, time.time() - start


@pytest.fixture(scope="module", params=[2, 4])
def world_results(request, tmp_path_factory):
    ranks, seconds = _spawn(request.param, tmp_path_factory.mktemp(f"w{request.param}"))
    print(f"\n{request.param} ranks: {seconds:.1f} s")
    return request.param, ranks


@functools.lru_cache(maxsize=None)
def _single(name):
    names = [c[0] for c in CASES + VARLEN_CASES]
    seed = names.index(name)
    if seed < len(CASES):
        _, _, batch, total, hq, hkv, causal, precision = CASES[seed]
        q, k, v = _inputs(batch, total, hq, hkv, seed)
        out, lse = leanfa.attention(q, k, v, causal=causal, precision=precision, return_lse=True)
        ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True)
        return out, lse, ref, ref_lse
    _, _, lengths, hq, hkv, causal, precision = VARLEN_CASES[seed - len(CASES)]
    q, k, v = (x[0] for x in _inputs(1, sum(lengths), hq, hkv, seed))
    cu, longest = _cu(lengths), max(lengths)
    out, lse = leanfa.attention(q, k, v, causal=causal, precision=precision, return_lse=True, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    return out, lse, ref, ref_lse


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("case", [c[0] for c in CASES + VARLEN_CASES])
def test_matches_single_process(world_results, case):
    world, ranks = world_results
    keys = [key for key in ranks[0] if key[0] == case]
    if not keys:
        pytest.skip(f"{case} does not run in the {world}-process spawn")
    out, lse, ref, ref_lse = _single(case)
    err_single, lse_err_single = rel_l2(out, ref), _rms(lse.double() - ref_lse)
    for key in keys:
        for r, res in enumerate(ranks):  # every rank unsharded the same full result
            d_out, d_lse = res[key]
            assert d_out.shape == out.shape and d_out.dtype == out.dtype and d_lse.shape == lse.shape
            err, lse_err = rel_l2(d_out, ref), _rms(d_lse.double() - ref_lse)
            print(f"{case} {key[1]} rank {r}: out {err:.3e} (single {err_single:.3e}), "
                  f"lse rms {lse_err:.3e} (single {lse_err_single:.3e})")
            assert err <= 1.25 * err_single + 1e-4, (key, r, err, err_single)
            assert lse_err <= 1.25 * lse_err_single + 2e-5, (key, r, lse_err, lse_err_single)


def test_disagreeing_ranks_raise_one_error_everywhere(world_results):
    world, ranks = world_results
    if world == 1:
        pytest.skip("one rank cannot disagree")
    for i, what in enumerate(("q (shape", "causal")):
        messages = [res["errors"][i] for res in ranks]
        assert all(m is not None for m in messages), messages
        assert len(set(messages)) == 1, messages  # the same error on every rank
        assert f"ranks disagree on {what}" in messages[0], messages[0]
