"""The varlen tile table (leanfa/kernels/hopper/varlen_tiles.py), on the GPU or in the interpreter: every real (sequence, query tile)
pair exactly once, heaviest first, and nothing else."""

import dataclasses

import pytest
import torch

from leanfa.kernels.hopper import varlen_tiles

BM = 128


def _pairs(table):
    n, shift = int(table[0]), varlen_tiles.PAIR_SHIFT.value
    return n, [(int(p) >> shift, int(p) & ((1 << shift) - 1)) for p in table[1:1 + n]], table[1 + n:]


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
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU tensors run in the interpreter, set by conftest)
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=dev)
    table = varlen_tiles.build(cu_q, cu_k, sum(lq), max(lk), causal, BM).cpu()
    assert table.dtype == torch.int32
    n, pairs, rest = _pairs(table)
    unused = rest[:varlen_tiles.capacity(sum(lq), len(lq), BM) - n]
    assert bool((unused[1 if n == 0 else 0:] == -1).all())  # (the bytes follow from the batch: plans compare equal)
    expected = {(b, m) for b, length in enumerate(lq) for m in range(-(-length // BM))}
    assert n == len(expected) <= varlen_tiles.capacity(sum(lq), len(lq), BM)
    assert sorted(pairs) == sorted(expected)
    blocks = [-(-_seen(b, m, lq, lk, causal) // 128) for b, m in pairs]  # key blocks the tile's last row sees
    assert blocks == sorted(blocks, reverse=True)
    if n == 0:
        assert int(table[1]) == 0  # (read by the kernel as a tile with no rows)


def test_limits_are_refused():
    assert varlen_tiles.table_problem(1000, varlen_tiles.MAX_SEQUENCES, BM)
    assert varlen_tiles.table_problem(varlen_tiles.MAX_TILES_PER_SEQUENCE * BM, 2, BM)
    assert varlen_tiles.table_problem(10_000, 3, BM) is None


# ---- GPU: a captured varlen call replayed with new lengths ------------------------------------------------

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_replays_new_lengths(fp8, schedule):
    """The tile table is built on the GPU from cu_seqlens inside the captured call (or, ``schedule``, once by
    varlen_schedule and passed to two calls, as two layers of a step): a replay after new lengths (same batch
    size and token count) are copied into the captured cu_seqlens computes the new batch, each sequence
    against the float64 reference (the captured outputs are poisoned before each replay)."""
    import leanfa
    from leanfa.reference import attention_ref

    hq, hkv, d, total = 8, 2, 128, 1536
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, h, d, device="cuda", generator=gen).to(torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, 1000, 1001, 1400, total], dtype=torch.int32, device="cuda")

    def run():
        args = (leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=total, max_seqlen_k=total),
                None, None) if fp8 else (q, k, v)
        kw = dict(causal=True, backend="hopper")
        if schedule:
            kw["scheduler_metadata"] = leanfa.varlen_schedule(q, cu, cu, total, total, causal=True)
            first = leanfa.flash_attn_varlen_func(*args, cu, cu, total, total, **kw)
            return torch.stack([first, leanfa.flash_attn_varlen_func(*args, cu, cu, total, total, **kw)]), args
        return leanfa.flash_attn_varlen_func(*args, cu, cu, total, total, **kw)[None], args

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, args = run()
    for new in ([0, 7, 900, 1300, total], [0, 0, 128, 129, total]):
        cu.copy_(torch.tensor(new, dtype=torch.int32, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_args = args
        if fp8:  # the reference sizes the per-block descale tables by the true longest sequence, not max_seqlen
            blocks = -(-max(b - a for a, b in zip(new[:-1], new[1:])) // 128)
            ref_args = (dataclasses.replace(args[0], q_descale=args[0].q_descale[..., :blocks],
                                            k_descale=args[0].k_descale[..., :blocks]), None, None)
        ref = attention_ref(*ref_args, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
        for layer in out:
            for a, b in zip(new[:-1], new[1:]):
                if b > a:
                    err = float((layer[a:b].double() - ref[a:b]).norm() / ref[a:b].norm())
                    assert err < (0.08 if fp8 else 0.02), (new, a, b, err)


def test_schedule_is_the_calls_table_and_is_checked():
    """varlen_schedule makes the table the call would (one for the batch, reused by each layer's call: the plan
    takes it as it is); a table of another batch's size, of another dtype, or on a dense call is refused."""
    import leanfa
    from leanfa.api import _build_problem
    from leanfa.kernels import hopper

    lens = [300, 0, 1, 699]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cu = torch.tensor([0, 300, 300, 301, 1000], dtype=torch.int32, device=dev)
    q, k, v = (torch.randn(1000, h, 64, device=dev).to(torch.bfloat16) for h in (4, 2, 2))
    sched = leanfa.varlen_schedule(q, cu, cu, 699, 699, causal=True)
    assert torch.equal(sched, varlen_tiles.build(cu, cu, 1000, 699, True, BM))
    p = _build_problem(q, k, v, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=699, max_seqlen_k=699,
                       softmax_scale=None, causal=True, q_descale=None, k_descale=None, v_descale=None, k_mean=None,
                       return_lse=False, out_dtype=None, scheduler_metadata=sched)
    assert p.scheduler_metadata is sched
    if dev == "cpu":  # (the plan's checks only look at pointers: a CPU plan shows what the kernel would get)
        from leanfa.kernels.hopper import emulate as emulate_mod
        from leanfa.kernels.hopper import launch as L

        plan = emulate_mod._make_plan_cpu(L, p, torch.empty(1000, 4, 64, dtype=torch.bfloat16), None)
        assert not any(a is sched for a in plan.args)  # (make_plan alone builds its own) ...
        plan = hopper.plan(p)[0]
        assert any(a is sched for a in plan.args)  # ... the call's plan takes the given one
    for bad, err in ((sched[:-1], ValueError), (sched.to(torch.int64), TypeError),
                     (leanfa.varlen_schedule(q[:900], cu.clone().clamp(max=900), cu.clone().clamp(max=900), 600, 600),
                      ValueError)):
        with pytest.raises(err, match="scheduler_metadata"):
            leanfa.flash_attn_varlen_func(q, k, v, cu, cu, 699, 699, causal=True, scheduler_metadata=bad)
    with pytest.raises(TypeError, match="scheduler_metadata"):  # (dense calls have no such argument)
        leanfa.flash_attn_func(q[None], k[None], v[None], scheduler_metadata=sched)


_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from leanfa.kernels import triton_aot
from leanfa.kernels.hopper import varlen_tiles as vt
types = {"cu_q": "*i32", "cu_k": "*i32", "table": "*i32", "hist": "*i32", "batch": "i32", "slots": "i32", "NBUCKETS": "i32",
         "window_left": "i32", "window_right": "i32"}
consts = {"CAUSAL": sys.argv[1] != "0", "BLOCK_M": 128, "BLOCK_B": vt.BLOCK_B, "BLOCK_T": vt.BLOCK_T, "BLOCK_H": 1024,
          "WINDOW": sys.argv[1] == "window"}
if sys.argv[1] == "used":  # FA3's seqused_k (a pointer), else a constexpr None
    types["used_k"] = "*i32"
else:
    consts["used_k"] = None
ck = triton_aot._compile(vt._tile_table_kernel, types, consts, GPUTarget("cuda", 90, 32), num_warps=vt.WARPS)
print("usage", *triton_aot.ptxas_usage(ck.asm["ptx"]))
"""


@pytest.mark.parametrize("causal", [True, False, "window", "used"])
def test_table_kernel_compiles_for_sm90(causal):
    """The interpreter does not type-check loops (a loop-carried variable re-assigned with another type failed only
    on the H200, run 79): compile the launch for sm90 (in a process without the interpreter), without spills."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, causal if isinstance(causal, str) else "1" if causal else "0"],
                       env=env, capture_output=True,
                       text=True, timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr.lower() and "not found" in r.stderr.lower():
        pytest.skip("no ptxas for sm90 here")
    assert r.returncode == 0, r.stderr[-2000:]
    usage = [line for line in r.stdout.splitlines() if line.startswith("usage")][-1].split()
    assert usage[2:] == ["0", "0"], usage
