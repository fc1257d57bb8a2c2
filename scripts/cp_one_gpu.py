"""Context parallelism on one GPU: a world of 1, and the ring's overlap through a loop-back ring (GPU).

    python scripts/cp_one_gpu.py [--tokens 131072] [--worlds 2,4] [--reps 5]

Issue 26 asks for a multi-GPU scaling table; when no multi-GPU machine is lent, this measures what one GPU
can:

1. **A world of 1** (an NCCL process group of one rank): ``context_parallel_attention`` against
   ``leanfa.attention`` on the same sequence -- the error of both against float64 on a small case (they
   must match within the single call's error), and the time of both at ``--tokens`` (the wrapper's cost:
   the two chunks' calls and the fp32 LSE merge instead of one call).
2. **A loop-back ring**: rank r's schedule of a world of W (its two chunks against every rank's K/V block,
   W ring steps), with each step's K/V block sent and received over NCCL to itself on the ring's side stream
   (the transfers a real ring makes, over a local copy instead of NVLink), against the same schedule with no
   transfer, and the transfers alone, for every rank r. The output is not the attention of any sequence (every
   step attends the block it received, which is rank r's own); the work and the transfers are those of rank r
   in a world of W. The projected speedup of W GPUs is the single call's time over the slowest rank's.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import leanfa
import leanfa.distributed as cp
from leanfa.distributed import attention as cpa
from leanfa.distributed.layout import shard_of
from leanfa.distributed.ring import Ring, nbytes, pack
from leanfa.reference import attention_ref


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def inputs(tokens, hq, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, tokens, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, tokens, hkv, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v


def world_of_one(tokens, reps):
    print("== a world of 1 (NCCL, one rank) ==")
    q, k, v = inputs(2048, 8, 2, 128, 1)
    ref = attention_ref(q, k, v, causal=True)
    for precision in ("bf16", "fp8"):
        one = leanfa.attention(q, k, v, causal=True, precision=precision)
        ring = cp.unshard(cp.context_parallel_attention(cp.shard(q), cp.shard(k), cp.shard(v), causal=True,
                                                        precision=precision))
        print(f"  2048 tokens 8/2 d128 {precision}: error vs float64  single call {rel_err(one, ref):.3e}  "
              f"context_parallel {rel_err(ring, ref):.3e}")
    q, k, v = inputs(tokens, 32, 8, 128, 2)
    flops = 4 * tokens * tokens * 32 * 128 / 2
    for precision in ("bf16", "fp8"):
        t_one = timed(lambda: leanfa.attention(q, k, v, causal=True, precision=precision), reps)
        shards = [cp.shard(t) for t in (q, k, v)]
        t_cp = timed(lambda: cp.context_parallel_attention(*shards, causal=True, precision=precision), reps)
        print(f"  {tokens} tokens 32/8 d128 {precision}: single call {t_one:8.2f} ms ({flops / t_one / 1e9:5.0f} "
              f"TF/s)  context_parallel {t_cp:8.2f} ms  ratio {t_one / t_cp:.3f}")


def rank_schedule(world, rank, tokens, precision, transfers: bool):
    """A function running rank ``rank``'s ring schedule of a world of ``world`` (see the module docstring)."""
    q, k, v = inputs(tokens, 32, 8, 128, 3)
    qs, ks, vs = (shard_of(t, rank, world) for t in (q, k, v))
    del q, k, v
    if precision == "fp8":
        shard = cpa._ShardFP8(qs, ks, vs, tokens, world, rank, cpa._ShardFP8.sums(ks))
    else:
        shard = cpa._Shard16(qs, ks, vs, tokens, world, rank)
    block, pieces = pack(shard.payload())
    queries = [shard.queries(i) for i in range(2)]
    ring = Ring(None, qs.device)
    out = torch.zeros(qs.shape[:3] + (vs.shape[3],), dtype=torch.float32, device=qs.device)
    lse = torch.full((qs.shape[0], qs.shape[2], qs.shape[1]), float("-inf"), dtype=torch.float32, device=qs.device)
    first = shard.sizes[0]
    acc = [(out[:, :first], lse[:, :, :first]), (out[:, first:], lse[:, :, first:])]
    recvs = [torch.empty(nbytes(pieces), dtype=torch.uint8, device=qs.device) for _ in range(2)]

    def step_all(compute=True, send=transfers):
        cur = block
        for step in range(world):
            src = (rank - step) % world
            if send and step < world - 1:
                recv = recvs[step % 2]
                works = ring.start(cur, recv)
            if compute:
                keys = cpa.unpack(cur, pieces)
                for i, qc in enumerate(cpa.rank_chunks(rank, world)):
                    for j, kc in enumerate(cpa.rank_chunks(src, world)):
                        seen = cpa.visibility(qc, kc, True)
                        if seen == cpa.NONE:
                            continue
                        o, l = leanfa.flash_attn_func(**queries[i], **shard.keys(keys, src, j), causal=seen == cpa.DIAGONAL,
                                                      return_lse=True, out_dtype=torch.float32)
                        cpa.merge_into(*acc[i], o, l)
            if send and step < world - 1:
                ring.finish(works)
                cur = recv
    return step_all, nbytes(pieces)


def loopback(tokens, worlds, reps):
    print("== loop-back ring: rank r of a world of W, NCCL send/recv to itself on the ring's stream ==")
    print("  (projected = the single call's time / the slowest rank's ring time: the speedup of W GPUs if the ring's")
    print("   transfers over NVLink hide as the loop-back's do)")
    print(f"  {'W':>2s} {'r':>2s} {'prec':5s} {'tokens/rank':>11s} {'block MB':>8s} {'compute ms':>10s} "
          f"{'transfers ms':>12s} {'ring ms':>8s}")
    for precision in ("fp8", "bf16"):
        q, k, v = inputs(tokens, 32, 8, 128, 3)
        t_single = timed(lambda: leanfa.attention(q, k, v, causal=True, precision=precision), reps)
        del q, k, v
        for world in worlds:
            slowest = 0.0
            for rank in range(world):
                fn, size = rank_schedule(world, rank, tokens, precision, True)
                t_compute = timed(lambda: fn(compute=True, send=False), reps)
                t_send = timed(lambda: fn(compute=False, send=True), reps)
                t_ring = timed(lambda: fn(compute=True, send=True), reps)
                slowest = max(slowest, t_ring)
                print(f"  {world:2d} {rank:2d} {precision:5s} {tokens // world:11d} {size / 1e6:8.1f} {t_compute:10.2f} "
                      f"{t_send:12.2f} {t_ring:8.2f}", flush=True)
            print(f"  {world:2d} {precision}: single call {t_single:.2f} ms, slowest rank {slowest:.2f} ms, projected "
                  f"speedup {t_single / slowest:.2f}x", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(time.time()) % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  nccl {torch.cuda.nccl.version()}")
    try:
        world_of_one(args.tokens, args.reps)
        loopback(args.tokens, [int(w) for w in args.worlds.split(",")], args.reps)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
