"""CPU safety net for the Hopper (Gluon) kernel: its own source run by the PyTorch emulator
(:mod:`leanfa.kernels.hopper.emulate`) through the real host plan (``launch.make_plan``).

Checks the numbers against the float64 reference, the key-block schedule of every tile, the
pointer/TMA/mbarrier/shared-memory rules, and -- by mutation -- that the emulator does catch
the classes of bug we care about (wrong scale strides, wrong phase parity, a slot released before
its readers are done or refilled before it was released, missing masks, wrong tile offsets).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import leanfa
from leanfa.reference import attention_ref
from helpers import cu_seqlens, poison_empty

emulate_mod = pytest.importorskip("leanfa.kernels.hopper.emulate")
from leanfa.kernels.hopper import launch as L  # noqa: E402
from leanfa.kernels.hopper import pipeline as P  # noqa: E402
from leanfa.kernels.hopper import schedule as S  # noqa: E402
from leanfa.kernels.hopper.emulate import EmulationError, emulate, reset_shadows, shadow  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU emulation test (runs where there is no GPU)")

BLOCK = 128


def _problem(q, k, v, causal, lse=True, **desc):
    from leanfa.api import _build_problem

    kw = dict(q_descale=None, k_descale=None, v_descale=None, k_mean=None)
    kw.update(desc)
    return _build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                          max_seqlen_k=None, softmax_scale=None, causal=causal, return_lse=lse,
                          out_dtype=None, **kw)


def _inputs(B, Sq, Sk, Hq, Hkv, dqk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, Hq, dqk, generator=g).to(torch.bfloat16)
    k = torch.randn(B, Sk, Hkv, dqk, generator=g)
    k[..., :4] = k[..., :4] * 4 + 2
    v = torch.randn(B, Sk, Hkv, dv, generator=g).to(torch.bfloat16)
    return q, k.to(torch.bfloat16), v


def _check(p, tol, ws_order="consumer-first", **ref_kw):
    """The emulated kernel's output within relative L2 error ``tol`` of the float64 reference (``ref_kw``: FP8
    descales), its LSE -inf exactly where the reference's is and within 2e-2 elsewhere."""
    out, lse, rep = emulate(p, ws_order=ws_order)
    ref, ref_lse = attention_ref(p.q, p.k, p.v, causal=p.causal, softmax_scale=p.softmax_scale,
                                 return_lse=True, **ref_kw)
    assert not torch.isnan(out).any(), "NaN (or never written) in out"
    if ref.norm() > 0:
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < tol, err
    else:
        assert out.abs().max() == 0
    if lse is not None:
        fin = torch.isfinite(ref_lse)
        assert torch.equal(torch.isinf(lse), ~fin), "LSE -inf pattern"
        if fin.any():
            assert float((lse.double() - ref_lse)[fin].abs().max()) < 2e-2
    return rep


SHAPES = [  # B, Sq, Sk, Hq, Hkv -- the shapes of the 2026-11-29 H200 failures, scaled down
    (1, 1, 1, 2, 2),
    (2, 100, 100, 4, 2),
    (1, 128, 128, 2, 2),
    (1, 1000, 1000, 2, 1),
    (1, 100, 1000, 2, 1),
    (1, 1000, 100, 2, 2),
    (1, 129, 700, 2, 1),
    (1, 700, 300, 2, 2),
    (1, 1, 1500, 2, 1),
    (1, 256, 384, 2, 2),
]


DIMS = [(128, 128), (192, 128), (64, 64), (256, 256)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_emulated_matches_reference(shape, dims, causal, monkeypatch):
    """On the one-tile grid, whose schedule (program = tile) :func:`_check_schedule` reads; the persistent grid
    that BF16 128/128 takes by default is checked by the test below."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    reset_shadows()
    p = _problem(*_inputs(*shape, *dims), causal)
    rep = _check(p, 1e-2)
    _check_schedule(p, rep)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_bf16_default_path_matches_reference(shape, causal, monkeypatch):
    """BF16 128/128's default: the persistent grid with the TMA-store epilogue, output and LSE against the
    float64 reference."""
    for name in ("LEANFA_HOPPER_PERSISTENT", "LEANFA_HOPPER_STORE_TMA"):
        monkeypatch.delenv(name, raising=False)
    reset_shadows()
    p = _problem(*_inputs(*shape, 128, 128), causal)
    plan = emulate_mod._make_plan_cpu(L, p, torch.empty(*p.q.shape[:3], 128, dtype=torch.bfloat16),
                                      torch.empty(p.q.shape[0], p.q.shape[2], p.q.shape[1]))
    assert plan.constexprs["PERSISTENT"] and plan.constexprs["STORE_TMA"]
    _check(p, 1e-2)


def _check_schedule(p, rep):
    """Each tile reads exactly the key blocks some real row of it can see, in order, once each
    (once per consumer partition: there are two, each reading every block of the tile). Head dim 256
    reads 64-key blocks in BF16 (``launch.wide_head``)."""
    B, Sq, Hq, dqk = p.q.shape
    Sk = p.k.shape[1]
    block_n = 64 if L.wide_head(p.v.shape[-1]) and p.q.dtype != torch.float8_e4m3fn else BLOCK
    chunks = 1 if dqk & (dqk - 1) == 0 else dqk // 64  # K boxes per key block (launch.qk_chunk)
    n_tiles = -(-Sq // BLOCK)
    assert len(rep.schedule) == B * Hq * n_tiles
    for (pid_bh, pid1), per_part in rep.schedule.items():
        m0 = (n_tiles - 1 - pid1) * BLOCK
        rows = torch.arange(m0, min(m0 + BLOCK, Sq))
        keys = torch.arange(Sk)
        vis = torch.ones(len(rows), Sk, dtype=torch.bool)
        if p.causal:
            vis = keys[None, :] <= rows[:, None] + (Sk - Sq)
        want = sorted({int(j) // block_n for j in keys[vis.any(0)]})
        assert per_part or not want, (pid_bh, pid1, want)
        for reads in per_part.values():
            got = [c[2] // block_n for c in reads]
            assert got == [j for j in want for _ in range(chunks)], (pid_bh, pid1, got, want)
            assert all(c[1] == (pid_bh % Hq) // (Hq // p.k.shape[2]) for c in reads)  # the right KV head


@pytest.mark.parametrize("shape", [(1, 300, 700, 2, 1), (1, 700, 300, 2, 2), (1, 1, 600, 2, 1)])
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_emulated_matches_reference(shape, dims, causal):
    reset_shadows()
    q, k, v = _inputs(*shape, *dims)
    qq = leanfa.quantize_fp8(q, k, v)
    kw = dict(q_descale=qq.q_descale, k_descale=qq.k_descale, v_descale=qq.v_descale, k_mean=qq.k_mean)
    _check(_problem(qq.q, qq.k, qq.v, causal, **kw), 4e-2, **kw)


def _fp8_block_scaled_error():
    """FP8 with keys whose magnitude changes 32x between 128-token blocks (so each block's K scale
    matters): relative L2 error of the emulated kernel against the float64 reference."""
    q, k, v = _inputs(1, 300, 700, 2, 1, 128, 128, seed=3)
    gain = torch.tensor([1.0, 8.0, 0.25, 4.0, 0.5, 2.0])[torch.arange(700) // 128]
    k = (k.float() * gain[None, :, None, None]).to(torch.bfloat16)
    qq = leanfa.quantize_fp8(q, k, v)
    kw = dict(q_descale=qq.q_descale, k_descale=qq.k_descale, v_descale=qq.v_descale, k_mean=qq.k_mean)
    p = _problem(qq.q, qq.k, qq.v, True, **kw)
    out, _, _ = emulate(p)
    ref = attention_ref(p.q, p.k, p.v, causal=True, **kw)
    return float((out.double() - ref).norm() / ref.norm())


def test_fp8_per_block_k_scales():
    reset_shadows()
    assert _fp8_block_scaled_error() < 4e-2


def _block_scaled_mutation_caught(jit_fn, old, new):
    """The kernel is accurate on block-scaled keys, and ``old -> new`` in ``jit_fn`` makes it > 10% wrong."""
    reset_shadows()
    try:
        assert _fp8_block_scaled_error() < 4e-2
        _mutated(jit_fn, old, new)
        assert _fp8_block_scaled_error() > 1e-1
    finally:
        reset_shadows()


def test_mutation_k_scale_of_wrong_block():
    """The kernel loads the K scale a block ahead; using the current block's index there is caught."""
    _block_scaled_mutation_caught(KP._consumer_tile, "_k_scale(k_scale_row, stride_ksblk, (j + 1) * BLOCK_N,",
                                  "_k_scale(k_scale_row, stride_ksblk, j * BLOCK_N,")


def test_ablation_knob(monkeypatch):
    """LEANFA_HOPPER_ABLATE (timing only): parts map to the kernel's ABLATE bits, unknown parts are refused and
    every plan that uses it warns that its answers are wrong."""
    from leanfa.kernels.hopper import launch

    monkeypatch.delenv("LEANFA_HOPPER_ABLATE", raising=False)
    assert launch._ablation() == 0
    monkeypatch.setenv("LEANFA_HOPPER_ABLATE", "exp, max")
    with pytest.warns(UserWarning, match="results are wrong"):
        assert launch._ablation() == 3
    monkeypatch.setenv("LEANFA_HOPPER_ABLATE", "exp,softmax")
    with pytest.raises(ValueError, match="softmax"):
        launch._ablation()


@pytest.mark.parametrize("order", ["consumer-first", "producer-first"])
def test_onewg_ablation_runs_one_warpgroup(order, monkeypatch):
    """``LEANFA_HOPPER_ABLATE=onewg`` (timing only): warpgroup 1 does nothing and the barriers count
    one consumer, so the kernel finishes in either partition order and warpgroup 0's rows (the
    first 64 of each 128-row tile) are still right against float64."""
    monkeypatch.setenv("LEANFA_HOPPER_ABLATE", "onewg")
    q, k, v = _inputs(1, 300, 300, 2, 1, 128, 128)
    p = _problem(q, k, v, True)
    with pytest.warns(UserWarning, match="results are wrong"):
        out, _, _ = emulate(p, ws_order=order)
    ref = attention_ref(p.q, p.k, p.v, causal=True)
    wg0 = (torch.arange(300) % BLOCK) < BLOCK // 2
    got, want = out[:, wg0].double(), ref[:, wg0]
    assert not torch.isnan(got).any()
    assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("form", ["scalar", "per_head"])
def test_fp8_broadcast_descales(form):
    """Per-tensor and per-(batch, kv head) descales become broadcast tables (a size-1 block dim)."""
    reset_shadows()
    B, Sq, Sk, Hq, Hkv = 1, 300, 500, 2, 1
    q, k, v = _inputs(B, Sq, Sk, Hq, Hkv, 128, 128)
    vq = leanfa.quantize_fp8(q, k, v)  # for the transposed FP8 V and its descale

    def quant(x, H):
        if form == "scalar":
            d = (x.float().abs().amax() / 448).reshape(1)
            return (x.float() / d).to(torch.float8_e4m3fn), d
        d = (x.float().abs().amax(dim=(1, 3)) / 448)  # (B, H)
        d = d.reshape(B, Hkv, H // Hkv).amax(-1)  # (B, Hkv): shared by a query-head group
        s = d.repeat_interleave(H // Hkv, 1)[:, None, :, None]
        return (x.float() / s).to(torch.float8_e4m3fn), d

    q8, qd = quant(q, Hq)
    k8, kd = quant(k, Hkv)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vq.v_descale)
    _check(_problem(q8, k8, vq.v, True, **kw), 4e-2, **kw)


# ----------------------------------------------------------------------------- mutations

def _mutated(jit_fn, old, new):
    """Shadow ``jit_fn`` with ``old`` replaced by ``new`` in its source (tuples: each pair in turn)."""
    src = inspect.getsource(jit_fn.fn)
    for o, n in zip(old, new) if isinstance(old, tuple) else [(old, new)]:
        assert o in src, o
        src = src.replace(o, n)
    shadow(jit_fn, source=src)


def _expect_caught(shape=(1, 600, 600, 2, 1), causal=True, ws_order="consumer-first"):
    p = _problem(*_inputs(*shape, 128, 128), causal)
    try:
        out, _, _ = emulate(p, ws_order=ws_order)
    except EmulationError as e:
        return str(e)
    ref = attention_ref(p.q, p.k, p.v, causal=causal)
    err = float((out.double() - ref).norm() / ref.norm())
    assert torch.isnan(out).any() or err > 1e-2, "mutation not caught"
    return f"numerics relL2={err}"


def test_mutation_raw_scale_strides(monkeypatch):
    """The 2026-11-29 bug: the block stride of a broadcast (size-1) scale table was passed as 1."""
    reset_shadows()
    monkeypatch.setattr(L, "broadcast_strides", lambda t: tuple(t.stride()))
    assert "out of its storage" in _expect_caught()


@pytest.mark.parametrize("old,new", [
    ("(block // STAGES) & 1)\n    return slot", "(block // STAGES + 1) & 1)\n    return slot"),  # K parity
    ("(block // STAGES) & 1)\n    v =", "block & 1)\n    v ="),  # V parity that ignores the ring size
    ("slot = block % STAGES\n    mbarrier.wait(k_bars", "slot = (block + 1) % STAGES\n    mbarrier.wait(k_bars"),
])
def test_mutation_pipeline(old, new):
    reset_shadows()
    fn = P.wait_k if "k_bars" in old or "return slot" in old else P.v_tile
    _mutated(fn, old, new)
    _expect_caught()
    reset_shadows()


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_depths(monkeypatch, stages, causal):
    """The ring arithmetic (slot = j % STAGES, parity = (j // STAGES) & 1) for every depth (on the one-tile grid
    with register stores, whose schedule :func:`_check_schedule` reads and whose shared memory any depth fits)."""
    reset_shadows()
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "0")
    monkeypatch.setattr(L, "stages_for", lambda *a: stages)
    p = _problem(*_inputs(1, 900, 1300, 2, 1, 128, 128), causal)
    _check_schedule(p, _check(p, 1e-2))


# ----------------------------------------------------------------------------- knobs, both partition orders


KNOB_SHAPES = [(1, 1, 1, 2, 2), (1, 129, 700, 2, 1), (1, 700, 300, 2, 2), (1, 1, 1500, 2, 1)]


@pytest.mark.parametrize("knob", ["LEANFA_HOPPER_PERSISTENT"])
@pytest.mark.parametrize("order", ["consumer-first", "producer-first"])
@pytest.mark.parametrize("flag", ["1", "0"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", KNOB_SHAPES)
def test_knobs_match_reference(shape, fp8, flag, order, knob, monkeypatch):
    """Each knob on and off (``flag``: persistent programs that run several tiles each): output and LSE
    against float64, whichever partition runs first."""
    monkeypatch.setenv(knob, flag)
    q, k, v = _inputs(*shape, 128, 128)
    kw = {}
    if fp8:
        qq = leanfa.quantize_fp8(q, k, v)
        q, k, v, kw = qq.q, qq.k, qq.v, qq.descales()
    _check(_problem(q, k, v, True, **kw), 4e-2 if fp8 else 1e-2, ws_order=order, **kw)


def _fp8_problem(shape, causal=True):
    """(problem, descales) of FP8-quantized random inputs."""
    qq = leanfa.quantize_fp8(*_inputs(*shape, 128, 128))
    return _problem(qq.q, qq.k, qq.v, causal, **qq.descales()), qq.descales()


def test_nan_row_gives_nan_lse():
    """NaN in one query row: that row's output *and* LSE are NaN (run 32 on the GPU: the Hopper
    kernels wrote LSE -inf, reading the NaN row sum as "no key"); every other row stays finite."""
    from leanfa.kernels.hopper import softmax as SM

    q, k, v = _inputs(1, 200, 200, 2, 1, 64, 64)
    q[0, 150, 1, 7] = float("nan")
    p = _problem(q, k, v, True)
    out, lse, _ = emulate(p)
    assert torch.isnan(out[0, 150, 1]).all() and torch.isnan(lse[0, 1, 150])
    assert int(torch.isnan(lse).sum()) == 1 and int(torch.isnan(out).any(-1).sum()) == 1
    reset_shadows()
    try:  # the old test of a row sum, `l > 0`, is caught
        _mutated(SM.finish_rows, "seen = l_i != 0.0", "seen = l_i > 0.0")
        _, lse_old, _ = emulate(p)
        assert not torch.isnan(lse_old[0, 1, 150])
    finally:
        reset_shadows()


# ----------------------------------------------------------------------------- v3 (two consumer partitions)

from leanfa.kernels.hopper import kernel_pingpong as KP  # noqa: E402


@pytest.mark.parametrize("mod,fn,old,new,knobs", [
    # a warpgroup releases a slot before all its warps are done with it
    (P, "release_slot", "    gl.thread_barrier()\n", "", ""),
    # one release per slot instead of one per consumer warpgroup: the slot is refilled while the
    # other warpgroup may still have to read it
    (KP, "attn_fwd_pingpong_kernel", "empty_bars = alloc_barriers(STAGES, CONSUMERS)", "empty_bars = alloc_barriers(STAGES)",
     ""),
    # the producer refills without waiting for the releases
    (P, "produce_kv", "            mbarrier.wait(empty_bars.index(g % STAGES), ((g // STAGES) - 1) & 1)\n",
     "            pass\n", ""),
    # warpgroup 1 computes with warpgroup 0's query rows
    (KP, "_issue_qk", "qk_async(q_smem, W * QK_CHUNKS,", "qk_async(q_smem, 0,", ""),
    # persistent: the next tile's Q is loaded without waiting for both warpgroups to release it
    (KP, "_producer", "                mbarrier.wait(q_empty.index(0), (qi - 1) & 1)\n", "                pass\n",
     "LEANFA_HOPPER_PERSISTENT"),
    # persistent: a tile's key blocks are looked up from ring position 0, not where the producer put them
    (KP, "_consumer_block", "v = v_tile(v_bufs, v_bars, ring + j,", "v = v_tile(v_bufs, v_bars, j,",
     "LEANFA_HOPPER_PERSISTENT"),
    # S_0 read by the softmax while its wgmma may still be writing it (no wait)
    (KP, "_consumer_tile", "s = warpgroup_mma_wait(0, deps=(s_acc, ))", "s = s_acc", ""),
    # the producer waits for the wrong phase of a slot's release
    (P, "produce_kv", "((g // STAGES) - 1) & 1", "(g // STAGES) & 1", ""),
    # a slot released while its PV may still be reading it (the release moved before the PV wait)
    (KP, "_consumer_block",
     ("    pv_acc = _issue_pv(p_op, v, acc, alpha_o, TWO_LEVEL)\n",
      "    release_slot(empty_bars, (ring + j) % STAGES)  # one release per warpgroup (empty counts 2)\n"),
     ("    pv_acc = _issue_pv(p_op, v, acc, alpha_o, TWO_LEVEL)\n    release_slot(empty_bars, (ring + j) % STAGES)\n",
      ""), ""),
    # no mask on the diagonal / tail blocks
    (KP, "_softmax_block", "    if j >= n_full:\n", "    if False:\n", ""),
    # O not rescaled when the row max grows
    (KP, "_softmax_block", "    alpha_o = gl.convert_layout(alpha,", "    alpha = alpha * 0 + 1\n    alpha_o = gl.convert_layout(alpha,",
     ""),
    # every tile computes the last query tile of its head
    (S, "tile_coords", "pid_m = num_m_tiles - 1 - t // num_bh", "pid_m = num_m_tiles - 1 + 0 * t", ""),
])
def test_v3_mutations_caught(mod, fn, old, new, knobs, monkeypatch):
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1" if "LEANFA_HOPPER_PERSISTENT" in knobs else "0")
    reset_shadows()
    try:
        _mutated(getattr(mod, fn), old, new)
        caught = [_expect_caught((1, 300, 700, 2, 1), ws_order=o) for o in
                  ("producer-first", "consumer-first")]
        assert all(caught)
    finally:
        reset_shadows()


# ----------------------------------------------------------------------------- varlen (v3)

VARLEN_LENS = [  # (q lengths, k lengths): empty and length-1 sequences, Sq < Sk and Sq > Sk,
    ([0, 1, 130, 300, 77], [5, 1, 300, 130, 77]),  # tiles straddling the next sequence's tokens
    ([257], [129]),
]
# FP8 V is stored transposed (tokens innermost): a sequence's boxes would start at cu_seqlens_k[b] + 128 j,
# which TMA accepts only on 16-byte boundaries; the plan re-packs V so that every sequence starts on one
# (launch.align_varlen_v). Both kinds of lengths: starts that are aligned already, and that are not.
VARLEN_LENS_FP8 = [([0, 1, 130, 300, 77], [16, 48, 304, 128, 77])] + VARLEN_LENS


@pytest.mark.parametrize("lens,fp8", [(x, False) for x in VARLEN_LENS] + [(x, True) for x in VARLEN_LENS_FP8])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["tile per program", "persistent", "head dim 256"])
def test_v3_varlen(lens, causal, fp8, mode, monkeypatch):
    """v3 on packed varlen inputs (GQA 2:1), one tile per program, persistent, or at head dim 256
    (BF16: 64-key blocks): every sequence against the float64 reference, every
    output row and LSE entry written (poisoned first)."""
    from leanfa.api import _build_problem

    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1" if mode == "persistent" else "0")
    lq, lk = lens
    g = torch.Generator().manual_seed(len(lq))
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    d = 256 if mode == "head dim 256" else 128
    q = torch.randn(int(cu_q[-1]), 2, d, generator=g).to(torch.bfloat16)
    k = (torch.randn(int(cu_k[-1]), 1, d, generator=g) + 1).to(torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), 1, d, generator=g).to(torch.bfloat16)
    cu = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    kw = dict(q_descale=None, k_descale=None, v_descale=None, k_mean=None)
    if fp8:
        qq = leanfa.quantize_fp8(q, k, v, **cu)
        q, k, v, kw = qq.q, qq.k, qq.v, qq.descales()
    p = _build_problem(q, k, v, varlen=True, **cu, softmax_scale=None, causal=causal, return_lse=True,
                       out_dtype=None, **kw)
    out, lse, _ = emulate(p)
    ref, ref_lse = attention_ref(p.q, p.k, p.v, causal=causal, return_lse=True, cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k, **{n: getattr(p, n) for n in ("k_mean", "cu_seqlens_v")},
                                 q_descale=p.q_scale if fp8 else None, k_descale=p.k_scale if fp8 else None,
                                 v_descale=p.v_scale if fp8 else None)
    assert not torch.isnan(out).any(), "NaN (or never written) in out"
    assert not torch.isnan(lse).any(), "NaN (or never written) in lse"
    for i in range(len(lq)):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        o, r = out[rows].double(), ref[rows]
        if r.numel() and r.norm() > 0:
            assert float((o - r).norm() / r.norm()) < (3e-2 if fp8 else 1e-2), f"sequence {i}"
        else:
            assert o.abs().max() == 0 if o.numel() else True, f"sequence {i}: rows that see no key are 0"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin), "LSE -inf pattern"
    assert float((lse.double() - ref_lse)[fin].abs().max()) < 2e-2


def test_v3_fp8_varlen_unaligned_is_flagged(monkeypatch):
    """What crashed the H200 in run 15: FP8 varlen with a sequence starting at an unaligned token (a packed
    FP8 V stored transposed without quantize_fp8's aligned starts). Without the plan's re-packed V
    (launch.align_varlen_v) the emulator refuses the TMA box."""
    from leanfa.api import _build_problem

    cu = torch.tensor([0, 5, 300], dtype=torch.int32)
    q, k, v = (torch.randn(300, 2, 128).to(torch.bfloat16) for _ in range(3))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=295, max_seqlen_k=295)
    qq = leanfa.quantize_fp8(q, k[:, :1], v[:, :1], **kw)
    rows = torch.zeros(1, 128, 304, dtype=torch.uint8)  # tokens innermost, no gaps, rows of 16-byte multiples
    rows[..., :300] = qq.packed_v(cu).view(torch.uint8).permute(1, 2, 0)
    v_packed = rows.view(qq.v.dtype).permute(2, 0, 1)[:300]
    desc = {n: d for n, d in qq.descales().items() if n != "cu_seqlens_v"}
    p = _build_problem(qq.q, qq.k, v_packed, varlen=True, **kw, softmax_scale=None, causal=True, return_lse=False,
                       out_dtype=None, **desc)
    out, _, _ = emulate(p)  # re-packed: runs
    assert not torch.isnan(out).any()
    monkeypatch.setattr(L, "align_varlen_v", lambda v, cu_k, *_: (v, cu_k))  # V as packed, K's starts
    with pytest.raises(EmulationError, match="16 bytes"):
        emulate(p)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("varlen", [False, True])
def test_v3_fp8_token_major_v(varlen, d):
    """FP8 V token-major (FA3's layout) instead of quantize_fp8's transposed one: the plan copies it
    into the transposed layout (launch.transpose_fp8_v; varlen: align_varlen_v) and the kernel gives
    the same output as with the transposed V, bitwise (head dim 256 too: its V box is 256 x 128)."""
    from leanfa.api import _build_problem

    lens = [130, 7, 300]
    if varlen:
        cu = cu_seqlens(lens)
        q, k, v = (torch.randn(int(cu[-1]), 2, d).to(torch.bfloat16) for _ in range(3))
        k, v = k[:, :1], v[:, :1]
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    else:
        q, k, v = _inputs(2, 200, 333, 2, 1, d, d)
        kw = {}
    qq = leanfa.quantize_fp8(q, k, v, **kw)
    token_major = qq.packed_v(kw["cu_seqlens_k"]) if varlen else qq.v.contiguous()  # (packed: without the gaps)
    assert not L.v_is_kmajor(L.as_bshd(token_major)) and L.v_is_kmajor(L.as_bshd(qq.v))
    outs = []
    for vv in (qq.v, token_major):
        desc = {n: d for n, d in qq.descales().items() if vv is qq.v or n != "cu_seqlens_v"}
        p = _build_problem(qq.q, qq.k, vv, varlen=varlen, **(kw or dict(cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None)), softmax_scale=None, causal=True,
                           return_lse=False, out_dtype=None, **desc)
        outs.append(emulate(p)[0])
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1])
    ref = attention_ref(p.q, p.k, p.v, causal=True, q_descale=p.q_scale, k_descale=p.k_scale, v_descale=p.v_scale,
                        k_mean=p.k_mean, **{n: kw[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in kw})
    assert float((outs[1].double() - ref).norm() / ref.norm()) < 3e-2  # FP8 inputs as given: P's rounding


def test_transpose_fp8_v():
    """Token-major FP8 V copied into the transposed layout: same values, token rows padded to 16
    (zeros), innermost stride 1."""
    store = torch.randint(1, 100, (2, 37, 3, 64), dtype=torch.uint8)
    v = store.view(torch.float8_e4m3fn)
    out = L.transpose_fp8_v(v)
    assert out.shape == v.shape and out.stride(1) == 1 and L.v_is_kmajor(out)
    assert torch.equal(out.view(torch.uint8), store)
    full = out.permute(0, 2, 3, 1)  # (B, H, D, S) view of the storage
    assert full.stride(2) % 16 == 0 and full.stride(2) >= 37
    padded = torch.as_strided(out.view(torch.uint8), (2, 3, 64, 48), (full.stride(0), full.stride(1), full.stride(2), 1))
    assert (padded[..., 37:] == 0).all()


@pytest.mark.parametrize("lens,layout,max_seqlen", [
    ([5, 295], "transposed", None), ([0, 16, 1, 17, 130], "transposed", 130), ([128], "transposed", 128),
    ([0, 16, 1, 17, 130], "token-major", 130),
    ([5, 295], "transposed", 40),  # a grid smaller than the longest sequence: its programs loop
    (list(torch.randint(0, 40, (300,), generator=torch.Generator().manual_seed(3))), "transposed", 40),  # > BLOCK_B
    ([], "transposed", 0),
    ([5, 295, 0, 17], "transposed-tile-32x16", 40),  # H x D = 64 rows in two row blocks, several column steps
    ([5, 295, 0, 17], "transposed-tile-128x16", 40)])  # one row block, half of it past the last row
def test_align_varlen_v(lens, layout, max_seqlen, monkeypatch):
    """Every sequence's V tokens land at its 16-aligned start, in order; the gaps and the rows after the last
    sequence are zeros. The re-pack's buffers come from a poisoned ``torch.empty`` (0xFF, an e4m3 NaN), so a
    byte it leaves unwritten fails."""
    lens = [int(n) for n in lens]
    cu = cu_seqlens(lens)
    total, H, D = int(cu[-1]), 2, 32
    store = torch.randint(1, 100, (H, D, total + 3), dtype=torch.uint8)  # tokens innermost, padded rows
    v = store.view(torch.float8_e4m3fn).permute(2, 0, 1)[:total]
    if layout == "token-major":
        v = v.contiguous()
    poison_empty(monkeypatch)
    out, cu_v = L.align_varlen_v(v, cu, max_seqlen, tile=tuple(map(int, layout.split("-")[-1].split("x"))) if "tile" in layout else None)
    got = out.view(torch.uint8).permute(1, 2, 0)  # (H, D, room)
    assert out.shape[1:] == (H, D) and out.stride(0) == 1 and out.shape[0] % 16 == 0
    assert cu_v.dtype == torch.int32 and cu_v.shape == (len(lens) + 1,) and int(cu_v[0]) == 0
    covered = torch.zeros(out.shape[0], dtype=torch.bool)
    for b, n in enumerate(lens):
        start = int(cu_v[b])
        assert start % 16 == 0 and start >= (int(cu_v[b - 1]) + lens[b - 1] if b else 0)
        assert torch.equal(got[:, :, start:start + n], store[:, :, int(cu[b]):int(cu[b]) + n])
        covered[start:start + n] = True
    assert int(cu_v[-1]) == sum(-(-n // 16) * 16 for n in lens)
    assert (got[:, :, ~covered] == 0).all()


# ----------------------------------------------------------------------------- knobs

@pytest.mark.parametrize("fp8", [False, True])
def test_head_dim_256_plan(fp8, monkeypatch):
    """Head dim 256: FP8 with PV in the wgmma accumulator at 128-key blocks, BF16 at 64-key blocks, the
    builds that fit the registers (launch.wide_head)."""
    monkeypatch.delenv("LEANFA_HOPPER_STAGES", raising=False)
    q, k, v = _inputs(1, 200, 200, 2, 1, 256, 256)
    kw = {}
    if fp8:
        qq = leanfa.quantize_fp8(q, k, v)
        q, k, v, kw = qq.q, qq.k, qq.v, qq.descales()
    p = _problem(q, k, v, True, **kw)
    out = torch.empty(1, 200, 2, 256, dtype=torch.bfloat16)
    plan = emulate_mod._make_plan_cpu(L, p, out, None)
    assert plan.args[1].block_shape[2:] == [128 if fp8 else 64, 256]  # K boxes: keys x 256 dims
    assert plan.constexprs["PV_IN_MMA"] is True
    # the deepest ring that fits 227 KB: BF16 Q 64 KB + 2 x 64 KB; FP8 Q 32 KB + 2 x 64 KB
    assert plan.constexprs["STAGES"] == 2


def test_hopper_knobs(monkeypatch):
    """The plan's defaults, and LEANFA_HOPPER_PERSISTENT overriding the grid."""
    for k in ("LEANFA_HOPPER_PERSISTENT", "LEANFA_HOPPER_ABLATE"):
        monkeypatch.delenv(k, raising=False)
    q, k, v = _inputs(1, 200, 200, 2, 1, 128, 128)
    qq = leanfa.quantize_fp8(q, k, v)
    p = _problem(qq.q, qq.k, qq.v, True, lse=False, **qq.descales())
    plan_kmean = emulate_mod._make_plan_cpu(L, _problem(qq.q, qq.k, qq.v, True, **qq.descales()),
                                            torch.empty(1, 200, 2, 128, dtype=torch.bfloat16),
                                            torch.empty(1, 2, 200))
    assert plan_kmean.constexprs["PERSISTENT"] is False  # the LSE's K-mean term reads Q late: the one-tile grid
    plan = emulate_mod._make_plan_cpu(L, p, torch.empty(1, 200, 2, 128, dtype=torch.bfloat16), None)
    assert plan.kernel is KP.attn_fwd_pingpong_kernel
    assert plan.constexprs["ABLATE"] == 0
    assert plan.constexprs["PV_IN_MMA"] is False and plan.constexprs["num_warps"] == 4
    # dense FP8 at head dim <= 128: persistent, output through TMA (run 48); BF16 at 128/128 too (runs 53-54);
    # BF16 at d64 and MLA the one-tile grid
    assert plan.constexprs["PERSISTENT"] is True and plan.grid == (3, )  # min(tiles = 4, "SMs" = 3)
    assert plan.constexprs["STORE_TMA"] is True
    plan16 = emulate_mod._make_plan_cpu(L, _problem(q, k, v, True), torch.empty(1, 200, 2, 128, dtype=torch.bfloat16),
                                        None)
    assert plan16.constexprs["PERSISTENT"] is True and plan16.grid == (3, ) and plan16.constexprs["STORE_TMA"]
    for dqk, dv in ((64, 64), (192, 128)):
        plan16 = emulate_mod._make_plan_cpu(L, _problem(*_inputs(1, 200, 200, 2, 1, dqk, dv), True),
                                            torch.empty(1, 200, 2, dv, dtype=torch.bfloat16), None)
        assert plan16.constexprs["PERSISTENT"] is False and len(plan16.grid) == 2, (dqk, dv)
        assert not plan16.constexprs["STORE_TMA"], (dqk, dv)
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "0")
    plan = emulate_mod._make_plan_cpu(L, p, torch.empty(1, 200, 2, 128, dtype=torch.bfloat16), None)
    assert plan.constexprs["PERSISTENT"] is False and len(plan.grid) == 2


# ----------------------------------------------------------------------------- BF16 sink keys (v3)

def _sink_problem(q, k, v, causal, **varlen):
    """The FP8 problem of ``attention(q, k, v, precision="fp8", bf16_sink_keys=128)`` (its in-kernel path)."""
    import dataclasses

    from leanfa.api import _build_problem

    qq = leanfa.quantize_fp8(q, k, v, **varlen)
    cu = varlen or dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)
    p = _build_problem(qq.q, qq.k, qq.v, varlen=bool(varlen), **cu, softmax_scale=None, causal=causal,
                       return_lse=True, out_dtype=q.dtype, **qq.descales())
    return dataclasses.replace(p, sink_keys=128, sink_q=q, sink_k=k, sink_v=v)


def _sink_errors(p, ref, ref_lse, **emulate_kw):
    """``(error of the v3 emulation, error of the portable kernel's in-kernel sink)`` against float64; the
    LSE's -inf pattern must match the reference's and its worst error be within 1.2x the portable one's."""
    from leanfa.kernels import portable

    out, lse, _ = emulate(p, **emulate_kw)
    out_p, lse_p = portable.run(p)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin), "LSE -inf pattern"
    d_v3, d_port = (float((x.double() - ref_lse)[fin].abs().max()) if fin.any() else 0.0 for x in (lse, lse_p))
    assert d_v3 < 1.2 * d_port + 1e-3, (d_v3, d_port)
    e = [float((o.double() - ref).norm() / ref.norm()) for o in (out, out_p)]
    return e[0], e[1]


SINK_CASES = [  # preset, sq, sk, causal, head dim: as tests/test_attention.py's, plus head dim 64
    ("llama3-8b", 300, 300, True, 128), ("llama3-8b", 150, 260, True, 128), ("llama3-8b", 260, 150, True, 128),
    ("llama3-8b", 192, 192, False, 128), ("qwen2.5-7b", 100, 100, True, 128), ("qwen2.5-7b", 300, 90, True, 128),
    ("gaussian", 200, 333, False, 64),
]


@pytest.mark.parametrize("mode", ["tile per program", "persistent"])
@pytest.mark.parametrize("preset,sq,sk,causal,d", SINK_CASES)
def test_v3_bf16_sink_keys(preset, sq, sk, causal, d, mode, monkeypatch):
    """FP8 with the first 128 keys attended from the 16-bit inputs inside the v3 kernel (sink.py): against
    float64 as accurate as the portable kernel's in-kernel sink (the same arithmetic up to block order),
    and more accurate than plain FP8; rows that see no key are 0 with LSE -inf; both partition orders."""
    from leanfa.activations import make_qkv

    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1" if mode == "persistent" else "0")
    q, k, v = make_qkv(preset, 1, sq, heads=2, kv_heads=1, seqlen_k=sk)
    if d != q.shape[-1]:
        q, k, v = (x[..., :d].contiguous() for x in (q, k, v))
    p = _sink_problem(q, k, v, causal)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, return_lse=True)
    plain, _, _ = emulate(_problem(p.q, p.k, p.v, causal, q_descale=p.q_scale, k_descale=p.k_scale,
                                   v_descale=p.v_scale, k_mean=p.k_mean))
    e_plain = float((plain.double() - ref).norm() / ref.norm())
    for order in ("consumer-first", "producer-first"):
        reset_shadows()
        e_v3, e_port = _sink_errors(p, ref, ref_lse, ws_order=order)
        assert e_v3 < 1.1 * e_port + 1e-3, (e_v3, e_port)
        assert e_v3 < e_plain or sk <= 128 and e_v3 < 1e-2, (e_v3, e_plain)


def test_v3_bf16_sink_keys_varlen():
    """Varlen: the first 128 keys of each sequence are its sink keys (lengths: longer and shorter than the
    sink, one token)."""
    from leanfa.activations import make_qkv

    lens = [300, 90, 1, 200]
    seqs = [make_qkv("llama3-8b", 1, n, heads=2, kv_heads=1, seed=i) for i, n in enumerate(lens)]
    q, k, v = (torch.cat([s[j][0] for s in seqs]) for j in range(3))
    cu = cu_seqlens(lens)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    p = _sink_problem(q, k, v, True, **kw)
    ref, ref_lse = attention_ref(q, k, v, causal=True, return_lse=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    e_v3, e_port = _sink_errors(p, ref, ref_lse)
    assert e_v3 < 1.1 * e_port + 1e-3, (e_v3, e_port)


def test_v3_sink_plan_and_dispatch(monkeypatch):
    """The plan: SINK = 2 with a smoothed K (1 without), a 3-slot ring next to the sink's 96 KB at d128; what
    v3 cannot run is refused with the reason; auto dispatch takes it (GPU-validated, run 45) unless
    LEANFA_HOPPER_SINK=0."""
    from leanfa.kernels import dispatch

    q, k, v = _inputs(1, 200, 200, 2, 1, 128, 128)
    p = _sink_problem(q, k, v, True)
    out = torch.empty(1, 200, 2, 128, dtype=torch.bfloat16)
    plan = emulate_mod._make_plan_cpu(L, p, out, None)
    assert plan.constexprs["SINK"] == 2 and plan.constexprs["STAGES"] == 3
    assert plan.args[-4].block_shape == [1, 1, 64, 128] and plan.args[-2].block_shape == [1, 1, 128, 128]
    assert plan.args[-1] is None and not plan.constexprs["STORE_TMA"]  # (the sink's buffers take that room)
    assert L.sink_problem(True, (128, 128), 256) and L.sink_problem(True, (192, 128), 128)
    assert L.sink_problem(False, (128, 128), 128)
    assert L.sink_problem(True, (64, 64), 128) is None
    monkeypatch.delenv("LEANFA_HOPPER_SINK", raising=False)
    assert dispatch.HOPPER_SINK_VALIDATED and dispatch.hopper_sink_enabled()  # GPU-validated: on by default (run 45)
    assert dispatch.hopper_sink_enabled((128, 128), 128) and not dispatch.hopper_sink_enabled((192, 128), 128)
    monkeypatch.setenv("LEANFA_HOPPER_SINK", "0")  # the escape hatch
    assert not dispatch.hopper_sink_enabled()
    ok, why = dispatch.hopper_applies(p)
    assert not ok and "LEANFA_HOPPER_SINK=0" in why


from leanfa.kernels.hopper import sink as SK  # noqa: E402


@pytest.mark.parametrize("mod,fn,old,new", [
    # the sink's scores not shifted by q . mean: they no longer match the smoothed K's FP8 scores
    (SK, "sink_block", "        s = s - q_shift[:, None]\n", ""),
    # the sink's P V added in real units to an accumulator in units of V's descale
    (SK, "sink_block", "pv * inv_v_scale[None, :]", "pv"),
    # the producer loads key block 0 into the ring too, and the consumers read it in FP8 as well
    (P, "produce_kv", "    for j in range(FIRST, n_end):", "    for j in range(0 * FIRST, n_end):"),
    # the producer refills the sink buffers without waiting for both warpgroups to release the tile
    (KP, "_producer", "                mbarrier.wait(q_empty.index(0), (qi - 1) & 1)\n", "                pass\n"),
])
def test_v3_sink_mutations_caught(mod, fn, old, new, monkeypatch):
    """Each mutation of the sink path is caught: a wrong answer (against the portable in-kernel sink's
    error) or an emulator error (a hang, a race)."""
    from leanfa.activations import make_qkv

    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1")
    q, k, v = make_qkv("llama3-8b", 1, 300, heads=2, kv_heads=1)
    p = _sink_problem(q, k, v, True)
    ref, ref_lse = attention_ref(q, k, v, causal=True, return_lse=True)
    reset_shadows()
    try:
        _mutated(getattr(mod, fn), old, new)
        caught = []
        for order in ("producer-first", "consumer-first"):
            try:
                e_v3, e_port = _sink_errors(p, ref, ref_lse, ws_order=order)
                caught.append(e_v3 > 1.1 * e_port + 1e-3)
            except (EmulationError, AssertionError):
                caught.append(True)
        assert any(caught), "mutation not caught"
    finally:
        reset_shadows()


# ----------------------------------------------------------------------------- TMA-store epilogue, early Q release (v3)

from leanfa.kernels.hopper import epilogue as EP  # noqa: E402

#: (shape, dims, causal): tiles past the sequence's end (Sq = 129, 100), Sq > Sk (rows with no key),
#: GQA, two batches, MLA and head dim 64
TMA_STORE_CASES = [
    ((1, 300, 700, 2, 1), (128, 128), True), ((2, 100, 100, 4, 2), (128, 128), False),
    ((1, 129, 129, 2, 2), (192, 128), True), ((1, 700, 300, 2, 1), (128, 128), True),
    ((1, 200, 200, 2, 1), (64, 64), True),
]


def _fp8(shape, dims, causal):
    qq = leanfa.quantize_fp8(*_inputs(*shape, *dims))
    return _problem(qq.q, qq.k, qq.v, causal, **qq.descales())


@pytest.mark.parametrize("persistent", ["0", "1"])
@pytest.mark.parametrize("shape,dims,causal", TMA_STORE_CASES)
def test_v3_store_tma_equals_register_stores(shape, dims, causal, persistent, monkeypatch):
    """LEANFA_HOPPER_STORE_TMA=1 (dense FP8): the output, poisoned first, equal bit for bit to the register
    stores' (the same arithmetic; rows past the sequence clipped by TMA), the LSE too, whichever partition runs
    first, one tile per program or persistent (a program's tiles reuse its staging buffers)."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", persistent)
    _store_tma_bit_for_bit(_fp8(shape, dims, causal), "0", "1", monkeypatch)


def _store_tma_bit_for_bit(p, off: str, on: str, monkeypatch):
    """With LEANFA_HOPPER_STORE_TMA=``on`` the plan stores through TMA, with ``off`` it does not, and output and
    LSE are the same bits, whichever partition runs first."""
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", off)
    o0, l0, _ = emulate(p)
    assert not torch.isnan(o0).any()
    assert not emulate_mod._make_plan_cpu(L, p, o0.clone(), l0.clone()).constexprs["STORE_TMA"]
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", on)
    assert emulate_mod._make_plan_cpu(L, p, o0.clone(), l0.clone()).constexprs["STORE_TMA"]
    for order in ("consumer-first", "producer-first"):
        o1, l1, _ = emulate(p, ws_order=order)
        assert torch.equal(o0, o1), order
        assert torch.equal(l0, l1), order


#: BF16 (by default at d128, LEANFA_HOPPER_STORE_TMA=2 at d64 too): the output boxes fit next to Q and the 2-slot
#: ring at d64 and d128, not at MLA
BF16_TMA_STORE_CASES = [c for c in TMA_STORE_CASES if c[1] != (192, 128)]


@pytest.mark.parametrize("persistent", ["0", "1"])
@pytest.mark.parametrize("shape,dims,causal", BF16_TMA_STORE_CASES)
def test_v3_bf16_store_tma_equals_register_stores(shape, dims, causal, persistent, monkeypatch):
    """LEANFA_HOPPER_STORE_TMA=2 (BF16 inputs, d64 and d128): the same bit-for-bit equality as FP8's, both
    partition orders, one tile per program or persistent."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", persistent)
    _store_tma_bit_for_bit(_problem(*_inputs(*shape, *dims), causal), "0", "2", monkeypatch)


def test_v3_store_tma_plan(monkeypatch):
    """Where the TMA store applies: dense FP8 with a 16-bit output of head dim <= 128, no sink, the knob on;
    everything else keeps the register stores (and its ring depth)."""
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "1")
    p = _fp8((1, 200, 200, 2, 1), (128, 128), True)
    out = torch.empty(1, 200, 2, 128, dtype=torch.bfloat16)
    plan = emulate_mod._make_plan_cpu(L, p, out, None)
    assert plan.constexprs["STORE_TMA"] and plan.args[-1].block_shape == [1, 1, 64, 128]
    assert plan.constexprs["STAGES"] == 4  # 32 KB of staging next to the 4-slot FP8 ring
    assert not emulate_mod._make_plan_cpu(L, p, out.float(), None).constexprs["STORE_TMA"]  # fp32 output
    assert emulate_mod._make_plan_cpu(L, _problem(*_inputs(1, 200, 200, 2, 1, 128, 128), True), out,
                                      None).constexprs["STORE_TMA"]  # BF16 inputs at 128/128 (runs 53-54)
    assert not emulate_mod._make_plan_cpu(L, _problem(*_inputs(1, 200, 200, 2, 1, 64, 64), True),
                                          torch.empty(1, 200, 2, 64, dtype=torch.bfloat16),
                                          None).constexprs["STORE_TMA"]  # BF16 at d64: =2 only
    assert not emulate_mod._make_plan_cpu(L, _fp8((1, 200, 200, 2, 1), (256, 256), True),
                                          torch.empty(1, 200, 2, 256, dtype=torch.bfloat16),
                                          None).constexprs["STORE_TMA"]  # head dim 256
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "0")
    assert not emulate_mod._make_plan_cpu(L, p, out, None).constexprs["STORE_TMA"]
    assert not emulate_mod._make_plan_cpu(L, _problem(*_inputs(1, 200, 200, 2, 1, 128, 128), True), out,
                                          None).constexprs["STORE_TMA"]  # (=0: BF16 off too)
    # =2: BF16 wherever the boxes fit (d128: two K/V slots, as without them; d64); not MLA's 192-wide Q
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "2")
    plan16 = emulate_mod._make_plan_cpu(L, _problem(*_inputs(1, 200, 200, 2, 1, 128, 128), True), out, None)
    assert plan16.constexprs["STORE_TMA"] and plan16.constexprs["STAGES"] == 2
    assert emulate_mod._make_plan_cpu(L, _problem(*_inputs(1, 200, 200, 2, 1, 64, 64), True),
                                      torch.empty(1, 200, 2, 64, dtype=torch.bfloat16), None).constexprs["STORE_TMA"]
    assert not emulate_mod._make_plan_cpu(L, _problem(*_inputs(1, 200, 200, 2, 1, 192, 128), True), out,
                                          None).constexprs["STORE_TMA"]


def _assert_caught(jit_fn, old, new, p, ref_out):
    """``jit_fn`` with ``old`` replaced by ``new`` is caught on ``p`` (see :func:`_caught_against`)."""
    reset_shadows()
    try:
        _mutated(jit_fn, old, new)
        assert _caught_against(p, ref_out), "mutation not caught"
    finally:
        reset_shadows()


def _caught_against(p, ref_out, orders=("producer-first", "consumer-first")):
    """True if every partition order raises an emulator error or gives an output unlike ``ref_out``."""
    caught = []
    for order in orders:
        try:
            o, _, _ = emulate(p, ws_order=order)
            caught.append(not torch.equal(o, ref_out))
        except EmulationError:
            caught.append(True)
    return all(caught)


@pytest.mark.parametrize("mod,fn,old,new", [
    # the staging buffer stored by TMA before its generic writes are fenced for the async proxy
    (EP, "stage_and_store", "    fence_async_shared()  # the generic writes, visible to the TMA unit ...\n", ""),
    # one thread issues the store before the other warps finished writing
    (EP, "stage_and_store", "    gl.thread_barrier()  # ... from every warp of the warpgroup, before one thread issues the store\n",
     ""),
    # the next tile overwrites the staging buffer while its previous store may still be reading it
    (EP, "stage_and_store", "    tma.store_wait(0)  # the previous tile's store has read o_buf (persistent programs)\n", ""),
    # the partition exits with its last store still reading shared memory
    (KP, "_consumer", "        tma.store_wait(0)  # the last tile's output store has read its shared memory\n",
     "        pass\n"),
    # both warpgroups store their rows at the tile's first row
    (KP, "_consumer_tile", "o_smem.index(W), b, h, row0)", "o_smem.index(W), b, h, m_start)"),
    # both warpgroups stage their rows in one buffer
    (KP, "_consumer_tile", "o_smem.index(W), b, h, row0)", "o_smem.index(0), b, h, row0)"),
])
def test_v3_store_tma_mutations_caught(mod, fn, old, new, monkeypatch):
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1")  # (programs run several tiles on the CPU's 3 "SMs")
    p = _fp8((1, 700, 700, 2, 1), (128, 128), True)
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "0")
    ref_out, _, _ = emulate(p)
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "1")
    _assert_caught(getattr(mod, fn), old, new, p, ref_out)


def _varlen_fp8_problem(lens, d=128):
    """A packed FP8 varlen problem (GQA 2:1) of sequences ``lens``."""
    from leanfa.api import _build_problem

    cu = cu_seqlens(lens)
    g = torch.Generator().manual_seed(len(lens))
    q = torch.randn(int(cu[-1]), 2, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(int(cu[-1]), 1, d, generator=g).to(torch.bfloat16) for _ in range(2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    qq = leanfa.quantize_fp8(q, k, v, **kw)
    return _build_problem(qq.q, qq.k, qq.v, varlen=True, **kw, softmax_scale=None, causal=True, return_lse=False,
                          out_dtype=None, **qq.descales())


STAGED_LENS = [70, 200, 1, 129]  # (a tile of 6 rows, a partial last tile, one token, 129 = 128 + 1)


def test_v3_staged_varlen_epilogue_equals_register_stores(monkeypatch):
    """Varlen output staged in shared memory and copied out 16 bytes per thread (STORE_STAGED, the default) gives the
    register stores' output bit for bit (every row written, no row of the next sequence touched)."""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1")
    p = _varlen_fp8_problem(STAGED_LENS)
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "0")
    off = emulate_mod._make_plan_cpu(L, p, torch.empty(p.q.shape[0], 2, 128, dtype=torch.bfloat16), None)
    ref_out, _, _ = emulate(p)
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "1")
    on = emulate_mod._make_plan_cpu(L, p, torch.empty(p.q.shape[0], 2, 128, dtype=torch.bfloat16), None)
    assert on.constexprs["STORE_STAGED"] and not off.constexprs["STORE_STAGED"] and not on.constexprs["STORE_TMA"]
    out, _, _ = emulate(p)
    assert not torch.isnan(out).any() and torch.equal(out, ref_out)


@pytest.mark.parametrize("fn,old,new", [
    # the rows read back before the other warps finished writing them
    ("stage_and_copy", "    gl.thread_barrier()\n    vals = o_buf.load(c_layout)", "    vals = o_buf.load(c_layout)"),
    # the rows past the sequence's end written (into the next sequence's rows)
    ("stage_and_copy", "vals, mask=offs_m[:, None] < seqlen_q)", "vals, mask=offs_m[:, None] < seqlen_q + 64)"),
])
def test_v3_staged_varlen_epilogue_mutations_caught(fn, old, new, monkeypatch):
    """(The barrier before the buffer is written again is not mutated here: between two tiles with key blocks the
    key loop's own barriers (``release_slot``) already order it; only a tile with no key block after one with keys
    relies on it.)"""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1")
    p = _varlen_fp8_problem(STAGED_LENS)
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "0")
    ref_out, _, _ = emulate(p)
    monkeypatch.setenv("LEANFA_HOPPER_STORE_TMA", "1")
    _assert_caught(getattr(EP, fn), old, new, p, ref_out)


def test_v3_early_q_release_mutation_caught(monkeypatch):
    """The Q box goes back to the producer after a warpgroup's last QK (persistent: the next tile's Q loads
    under this tile's last block). Released before the key loop instead, the next Q overwrites it while
    later QKs still read it: caught. (Released before the K-mean LSE term reads Q in the epilogue is not:
    the emulator runs the producer only when a consumer blocks, and none blocks in between; EARLY_Q
    excludes that case by construction.)"""
    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", "1")
    src = inspect.getsource(KP._consumer_tile.fn)
    ind = "    "  # (the key loop of _consumer_tile, one level in)
    early = (f"{ind}EARLY_Q: gl.constexpr = not SINK and not HAS_KMEAN\n{ind}if EARLY_Q:\n{ind}    if n_end > 0:\n"
             f"{ind}        release_slot(q_empty, 0)\n")
    loop = f"{ind}for j in range(first, n_end - 1):\n"
    assert early in src and loop in src
    qq = leanfa.quantize_fp8(*_inputs(1, 700, 700, 2, 1, 128, 128))
    p = _problem(qq.q, qq.k, qq.v, True, lse=False, **qq.descales())  # no LSE: the early release applies
    ref_out, _, _ = emulate(p)
    reset_shadows()
    try:
        shadow(KP._consumer_tile, source=src.replace(early, f"{ind}EARLY_Q: gl.constexpr = not SINK and not HAS_KMEAN\n")
               .replace(loop, f"{ind}if not SINK and not HAS_KMEAN:\n{ind}    if n_end > 0:\n"
                              f"{ind}        release_slot(q_empty, 0)\n" + loop))
        assert _caught_against(p, ref_out), "release before the loop not caught"
    finally:
        reset_shadows()


# ----------------------------------------------------------------------------- the mixed mode (FP8 QK, 16-bit PV)

def _mixed_diffuse(shape, dims, seed=0):
    """Diffuse attention (small queries), where FP8's error is the e4m3 rounding of P and V: the mixed mode's FP8 Q
    and K (quantize_fp8(quantize_v=False)) with the 16-bit V, and the 16-bit inputs."""
    B, Sq, Sk, Hq, Hkv = shape
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Sq, Hq, dims[0], generator=g) * 0.05).to(torch.bfloat16)
    k = (torch.randn(B, Sk, Hkv, dims[0], generator=g) + 0.5).to(torch.bfloat16)
    v = torch.randn(B, Sk, Hkv, dims[1], generator=g).to(torch.bfloat16)
    return q, k, v


MIXED_CASES = [((1, 300, 700, 2, 1), (128, 128), True), ((1, 700, 300, 2, 2), (192, 128), False),
               ((1, 1, 600, 2, 1), (64, 64), True), ((1, 300, 300, 2, 1), (256, 256), False)]


@pytest.mark.parametrize("shape,dims,causal", MIXED_CASES)
def test_v3_mixed_matches_reference(shape, dims, causal):
    """The mixed mode on the Hopper kernel's default plan (MIXED: P in bf16, a BF16 PV wgmma into O, V token-major):
    output and LSE against the float64 reference of its own (dequantized) inputs within a 16-bit kernel's error,
    and against the 16-bit inputs' reference well below the FP8 mode's error (a V or P still rounded to e4m3
    fails this)."""
    reset_shadows()
    q, k, v = _mixed_diffuse(shape, dims)
    qq = leanfa.quantize_fp8(q, k, v, quantize_v=False)
    kw = dict(q_descale=qq.q_descale, k_descale=qq.k_descale, k_mean=qq.k_mean)
    p = _problem(qq.q, qq.k, v, causal, **kw)
    assert p.is_mixed
    plan = emulate_mod._make_plan_cpu(L, p, torch.empty(*p.q.shape[:3], dims[1], dtype=torch.bfloat16), None)
    assert plan.constexprs["MIXED"] and plan.constexprs["IS_FP8"] and not plan.constexprs["V_KMAJOR"]
    _check(p, 1e-2, **kw)
    out, _, _ = emulate(p)
    ref16 = attention_ref(q, k, v, causal=causal)
    qf = leanfa.quantize_fp8(q, k, v)
    out8, _, _ = emulate(_problem(qf.q, qf.k, qf.v, causal, **qf.descales()))
    err, err8 = (float((o.double() - ref16).norm() / ref16.norm()) for o in (out, out8))
    assert err < 0.35 * err8, (err, err8)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("persistent", ["0", "1"])
def test_v3_mixed_varlen(causal, persistent, monkeypatch):
    """Packed varlen in the mixed mode: the 16-bit V is read as the BF16 path reads it (no re-pack), every sequence
    against the float64 reference, every output row written."""
    from leanfa.api import _build_problem

    monkeypatch.setenv("LEANFA_HOPPER_PERSISTENT", persistent)
    reset_shadows()
    lq, lk = [0, 1, 130, 300, 77], [16, 48, 304, 128, 77]
    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    q = (torch.randn(int(cu_q[-1]), 2, 128, generator=g) * 0.05).to(torch.bfloat16)
    k = (torch.randn(int(cu_k[-1]), 1, 128, generator=g) + 1).to(torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), 1, 128, generator=g).to(torch.bfloat16)
    cu = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    qq = leanfa.quantize_fp8(q, k, v, quantize_v=False, **cu)
    p = _build_problem(qq.q, qq.k, qq.v, varlen=True, **cu, softmax_scale=None, causal=causal, return_lse=True,
                       out_dtype=None, **qq.descales())
    out, lse, _ = emulate(p)
    ref, ref_lse = attention_ref(p.q, p.k, p.v, causal=causal, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                 q_descale=p.q_scale, k_descale=p.k_scale, k_mean=p.k_mean)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for i in range(len(lq)):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        o, r = out[rows].double(), ref[rows]
        if r.numel() and r.norm() > 0:
            assert float((o - r).norm() / r.norm()) < 1e-2, f"sequence {i}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert float((lse.double() - ref_lse)[fin].abs().max()) < 1e-2


def test_v3_mixed_plan():
    """The mixed mode's plan: FP8 Q/K descriptors, a token-major BF16 V, the ring sized for 1-byte K and 2-byte V
    rows, the FP8 grid and epilogue where the output boxes leave three slots (d128), register stores at MLA."""
    for dims, stages, tma_store in (((128, 128), 3, True), ((192, 128), 3, False), ((64, 64), 4, True)):
        q, k, v = _mixed_diffuse((1, 256, 256, 2, 1), dims)
        qq = leanfa.quantize_fp8(q, k, v, quantize_v=False)
        p = _problem(qq.q, qq.k, v, True, lse=False, q_descale=qq.q_descale, k_descale=qq.k_descale)
        plan = emulate_mod._make_plan_cpu(L, p, torch.empty(1, 256, 2, dims[1], dtype=torch.bfloat16), None)
        c = plan.constexprs
        assert c["MIXED"] and not c["V_KMAJOR"] and c["STAGES"] == stages and c["STORE_TMA"] == tma_store, (dims, c)
        assert c["PERSISTENT"] and plan.args[2].base.dtype == torch.bfloat16
        assert L._smem_bytes(dims[0], dims[1], 1, stages, extra=128 * dims[1] * 2 * tma_store, v_elt=2) <= L.SMEM_LIMIT


@pytest.mark.parametrize("old,new", [
    # P rounded to e4m3 (the FP8 path's P) instead of V's 16-bit dtype
    ("v_bufs.dtype, p_layout, o_layout", "k_bufs.dtype, p_layout, o_layout"),
])
def test_v3_mixed_mutation_caught(old, new):
    """A mixed kernel that still rounds P to e4m3 fails the mixed accuracy check."""
    reset_shadows()
    try:
        _mutated(KP._consumer_block, old, new)
        with pytest.raises(AssertionError) as caught:
            _mixed_check_mutated(*MIXED_CASES[0])
        assert not isinstance(caught.value, EmulationError)  # the numbers, not the protocol
    finally:
        reset_shadows()


def _mixed_check_mutated(shape, dims, causal):
    q, k, v = _mixed_diffuse(shape, dims)
    qq = leanfa.quantize_fp8(q, k, v, quantize_v=False)
    kw = dict(q_descale=qq.q_descale, k_descale=qq.k_descale, k_mean=qq.k_mean)
    _check(_problem(qq.q, qq.k, v, causal, **kw), 1e-2, **kw)
