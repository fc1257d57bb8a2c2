"""CPU tests of the serving sweep's chunked-prefill batches (leanfa/bench, issue 22): packed batches whose
queries are chunks of Sq tokens attending causally, aligned bottom-right, to Sk >= Sq keys (the cached prefix
plus the chunk), as a serving engine's chunked prefill calls ``flash_attn_varlen_func`` (cu_seqlens_q !=
cu_seqlens_k). FLOP counts against a mask, inputs, the float64 check, every implementation's varlen call
(leanfa's portable kernel in Triton's interpreter; FA3, FlashAttention-2 and cuDNN through stand-ins that
record what they were given), and the dry-run listing."""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest
import torch

from leanfa.bench import commands, cudnn_graphs, errors, fa3, impls as impls_mod, report, shapes
from leanfa.bench.impls import Impl, NotApplicable, all_impls
from leanfa.bench.inputs import PAGE_FILL, chunk_query_index, gather_pages, input_bytes, make_inputs, paged_kv
from leanfa.bench.runner import BenchConfig, run_bench
from leanfa.bench.timing import Timing
from leanfa.reference import attention_ref

NO_GPU = not torch.cuda.is_available()
CPU_ONLY = pytest.mark.skipif(not NO_GPU, reason="runs the interpreter path on CPU tensors (CI)")

#: a tiny chunked batch: a chunk of 9 after 11 cached tokens, a fresh prompt of 4 (Sq == Sk), a chunk of 5
#: after 8; 4 query heads on 2 KV heads, d64 (the smallest head dim leanfa's kernels take)
TINY = shapes.Case("serving", "tiny", "gaussian", 3, 9, 4, 2, 64, 64, True, (9, 4, 5), (20, 4, 13))


def _direct(q, k, v, cu_q, cu_k, causal: bool, bottom_right: bool = True) -> torch.Tensor:
    """Float64 attention per sequence straight from the definition: query i of a sequence sees key j
    when j <= i + Sk - Sq (flash-attn's bottom-right alignment), or j <= i (top-left, cuDNN's plain
    causal mask)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    group = q.shape[1] // k.shape[1]
    outs = []
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].double()
        ks = k[ck[b]:ck[b + 1]].double().repeat_interleave(group, 1)
        vs = v[ck[b]:ck[b + 1]].double().repeat_interleave(group, 1)
        sq, sk = qs.shape[0], ks.shape[0]
        s = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])
        if causal:
            i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
            s = s.masked_fill(j > i + (sk - sq if bottom_right else 0), -math.inf)
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
    return torch.cat(outs)


# ------------------------------------------------------------------------------ the batches


def test_chunked_serving_batches():
    cases = [c for c in shapes.build_cases(["serving"]) if c.chunked]
    by = {c.label: c for c in cases}
    assert set(by) == {"chunk8x2k+prefix", "chunks+new"}
    for c in cases:
        assert c.varlen and c.causal and (c.heads, c.kv_heads, c.head_dim, c.head_dim_v) == (32, 8, 128, 128)
        assert len(c.seqlens_k) == len(c.seqlens) == c.batch
        assert all(k >= q for q, k in zip(c.seqlens, c.seqlens_k))
        assert 15000 <= c.tokens <= 17000 and c.tokens_k > 4 * c.tokens  # ~16K queries against long prefixes
        assert c.seqlen == max(c.seqlens) and c.seqlen_k == max(c.seqlens_k)
    a = by["chunk8x2k+prefix"]
    assert a.seqlens == (2048,) * 8 and all(1024 <= k - 2048 <= 12288 for k in a.seqlens_k)
    assert len(set(a.seqlens_k)) == 8  # prefixes of varying lengths
    b = by["chunks+new"]
    chunks = [(q, k) for q, k in zip(b.seqlens, b.seqlens_k) if k > q]
    fresh = [q for q, k in zip(b.seqlens, b.seqlens_k) if k == q]
    assert [q for q, _ in chunks] == [4096, 4096, 2048] and all(k - q >= 4096 for q, k in chunks)
    assert len(fresh) == 12 and all(100 <= q <= 900 for q in fresh)
    assert shapes.build_cases(["serving"]) == shapes.build_cases(["serving"])  # fixed lengths


def test_case_name_dict_and_validation():
    c = [c for c in shapes.serving_cases() if c.label == "chunk8x2k+prefix"][0]
    assert c.name == "serving/chunk8x2k+prefix/chunked8/S2048-Sk13765/H32-8/D128-128/causal"
    d = json.loads(json.dumps(c.to_dict()))
    assert d["seqlens_k"] == list(c.seqlens_k) and d["tokens_k"] == sum(c.seqlens_k) == 68689
    assert d["tokens"] == 16384 and d["flops"] == shapes.flops(c)
    plain = shapes.serving_cases(batches=["mix16k"])[0]
    assert "chunked" not in plain.name and plain.to_dict()["seqlens_k"] is None and not plain.chunked
    assert plain.key_seqlens == plain.seqlens and plain.tokens_k == plain.tokens
    # key lengths equal to the query lengths are a plain batch, spelled one way
    same = shapes.Case("serving", "x", "gaussian", 2, 5, 4, 2, 64, 64, True, (5, 3), (5, 3))
    assert same.seqlens_k is None and same == dataclasses.replace(same, seqlens_k=None)
    with pytest.raises(ValueError, match="shorter"):
        shapes.Case("serving", "x", "gaussian", 2, 5, 4, 2, 64, 64, True, (5, 3), (4, 3))
    with pytest.raises(ValueError, match="key lengths"):
        shapes.Case("serving", "x", "gaussian", 2, 5, 4, 2, 64, 64, True, (5, 3), (5,))
    with pytest.raises(ValueError, match="unknown serving batch"):
        shapes.serving_cases(batches=["nope"])
    # the report names the batch and the longest key sequence
    cell = report._case_cell({**c.to_dict(), "case": c.name})
    assert cell[1] == "2048 (Sk 13765)" and cell[2] == "chunked x8"


# ------------------------------------------------------------------------------ FLOPs


def _mask_pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs computed, counted from the mask itself."""
    if not causal:
        return sq * sk
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    return int((j <= i + sk - sq).sum())


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_flops_equal_the_mask_count(causal):
    """FLOPs = 2·Hq·(Dqk+Dv) x the pairs the bottom-right mask leaves, less Sq/2 per causal sequence
    (flash-attn's convention, which counts Sq²/2 for a square: the same numbers as before chunked batches)."""
    case = dataclasses.replace(TINY, causal=causal)
    per_pair = 2 * case.heads * (case.head_dim + case.head_dim_v)
    want = sum(per_pair * (_mask_pairs(sq, sk, causal) - (sq / 2 if causal else 0))
               for sq, sk in zip(case.seqlens, case.seqlens_k))
    assert shapes.flops(case) == want
    if causal:  # 9 queries after 11 keys: 9·11 + 9·10/2 pairs, less 9/2; 4 of 4: 4·5/2 - 2;
        # 5 after 8: 5·8 + 5·6/2 - 5/2
        assert shapes.flops(case) == per_pair * ((99 + 45 - 4.5) + (10 - 2) + (40 + 15 - 2.5))
    # a square sequence keeps the old halved count
    assert shapes.attention_flops(1, 4, 300, 300, 64, 64, causal) == 2 * 4 * 300 * 300 * 128 / (2 if causal else 1)


def test_serving_chunked_flops_count_every_row():
    """The committed chunked batches: the per-row count of keys seen (no closed form) gives the same FLOPs."""
    for c in shapes.serving_cases():
        if not c.chunked:
            continue
        pairs = 0.0
        for sq, sk in zip(c.seqlens, c.seqlens_k):
            seen = (torch.arange(sq, dtype=torch.float64) + (sk - sq + 1)).clamp(max=sk)  # row i sees Sk-Sq+i+1
            pairs += float(seen.sum()) - sq / 2
        assert shapes.flops(c) == pytest.approx(2 * c.heads * (c.head_dim + c.head_dim_v) * pairs, rel=1e-12)
        # more work than the chunks alone as square prompts, less than every chunk against all its keys
        alone = sum(shapes.attention_flops(1, c.heads, q, q, 128, 128, True) for q in c.seqlens)
        full = sum(shapes.attention_flops(1, c.heads, q, k, 128, 128, False) for q, k in zip(c.seqlens, c.seqlens_k))
        assert alone < shapes.flops(c) < full


# ------------------------------------------------------------------------------ inputs, reference


@pytest.mark.parametrize("preset", ["gaussian", "llama3-8b"])
def test_chunked_inputs(preset):
    d = 64 if preset == "gaussian" else 128  # the Llama-3-8B profile has its model's head dim
    case = dataclasses.replace(TINY, preset=preset, head_dim=d, head_dim_v=d)
    x = make_inputs(case, device="cpu", seed=2)
    assert x.q.shape == (18, 4, d) and x.k.shape == (37, 2, d) and x.v.shape == (37, 2, d)
    assert x.cu_seqlens.tolist() == [0, 9, 13, 18] and x.cu_seqlens_k.tolist() == [0, 20, 24, 37]
    assert x.cu_seqlens.dtype == x.cu_seqlens_k.dtype == torch.int32
    assert (x.max_seqlen, x.max_seqlen_k) == (9, 20) and x.cu_seqlens_q is x.cu_seqlens
    assert x.varlen_kw() == dict(cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens_k, max_seqlen_q=9,
                                 max_seqlen_k=20)
    assert x.nbytes() == input_bytes(case)
    # the chunk is the tail of its key sequence: the same tokens as the whole sequences made as one batch
    whole = make_inputs(dataclasses.replace(case, seqlens=case.seqlens_k, seqlens_k=None, seqlen=20),
                        device="cpu", seed=2)
    assert torch.equal(x.k, whole.k) and torch.equal(x.v, whole.v)
    idx = chunk_query_index(case.seqlens, case.seqlens_k, "cpu")
    assert idx.tolist() == list(range(11, 20)) + [20, 21, 22, 23] + list(range(32, 37))
    assert torch.equal(x.q, whole.q[idx])


def test_reference_check_uses_both_cu_seqlens():
    """The bench's float64 check (errors.reference_subset) equals attention from the definition with the
    bottom-right mask, and differs from what the chunk would give as a prompt of its own (top-left)."""
    x = make_inputs(TINY, device="cpu", seed=0)
    ref, q_heads, batch0 = errors.reference_subset(x, True)
    assert q_heads == [0, 3] and not batch0 and ref.shape == (18, 2, 64)
    direct = _direct(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens_k, True)[:, q_heads]
    assert (ref - direct).abs().max() < 1e-12
    # the ratio test: a reference that cut K by the query lengths is far off
    wrong = attention_ref(x.q[:, q_heads], x.k[:, [0, 1]], x.v[:, [0, 1]], causal=True,
                          cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens)
    assert errors.error_metrics(wrong, ref)["rel_l2"] > 0.1
    floor = errors.fp8_rounding_floor(x, True, ref)
    assert 0.005 < floor < 0.1


# ------------------------------------------------------------------------------ the implementations


def _dequant(t8, descale, cu, kv_heads):
    """FA3's FP8 inputs back to float: one descale per (sequence of ``cu``, KV head)."""
    total, heads, d = t8.shape
    lengths = (cu[1:] - cu[:-1]).long()
    per = torch.repeat_interleave(descale, lengths, dim=0, output_size=total)  # (total, kv_heads)
    return (t8.float().reshape(total, kv_heads, heads // kv_heads, d) * per[:, :, None, None]).reshape(t8.shape)


def _fake_fa3(calls):
    """A stand-in for FA3's module: checks the lengths it is given against the tensors, dequantizes FP8
    inputs with their descales, and answers with the float64 reference."""
    mod = types.ModuleType("fake_fa3")

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, q_descale=None, k_descale=None,
                               v_descale=None):
        calls.append(dict(cu_q=cu_q.tolist(), cu_k=cu_k.tolist(), max_q=max_q, max_k=max_k, fp8=q_descale is not None))
        assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0] == v.shape[0]
        if q_descale is not None:
            kv = k.shape[1]
            q, k, v = (_dequant(q, q_descale, cu_q, kv), _dequant(k, k_descale, cu_k, kv),
                       _dequant(v, v_descale, cu_k, kv))
        return attention_ref(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k).to(torch.bfloat16)

    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.flash_attn_func = None
    return mod


def _fake_varlen_attn(calls):
    """A stand-in for torch's varlen_attn (FlashAttention-2; its causal window (-1, 0) is bottom-right)."""
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1),
                    enable_gqa=False):
        calls.append(dict(cu_q=cu_seq_q.tolist(), cu_k=cu_seq_k.tolist(), max_q=max_q, max_k=max_k))
        assert enable_gqa and int(cu_seq_k[-1]) == key.shape[0]
        return attention_ref(query, key, value, causal=tuple(window_size) == (-1, 0), cu_seqlens_q=cu_seq_q,
                             cu_seqlens_k=cu_seq_k).to(torch.bfloat16)
    return varlen_attn


class _FakeCudnnGraph:
    """A stand-in for a cuDNN BF16 ragged graph: reads the sequences from the ragged offsets and lengths
    it is bound to, and masks as the graph was built (bottom-right or cuDNN's top-left causal)."""

    def __init__(self, kw):
        self.kw = kw

    def variant_pack(self, named):
        return named

    def execute(self, p):
        hq, hkv, d, dv = self.kw["heads"], self.kw["kv_heads"], self.kw["head_dim"], self.kw["head_dim_v"]
        cu_q, cu_k = p["off_q"].flatten() // (hq * d), p["off_k"].flatten() // (hkv * d)
        assert torch.equal(p["off_v"].flatten() // (hkv * dv), cu_k)
        assert torch.equal(p["off_o"].flatten() // (hq * dv), cu_q)
        assert torch.equal(p["seq_q"].flatten().long(), cu_q.diff())
        assert torch.equal(p["seq_kv"].flatten().long(), cu_k.diff())
        assert max(cu_q.diff()) <= self.kw["seqlen"] and max(cu_k.diff()) <= self.kw["seqlen_k"]
        out = _direct(p["q"], p["k"], p["v"], cu_q, cu_k, self.kw["causal"], self.kw["bottom_right"])
        p["o"].copy_(out)


class _Sampler:
    def start(self):
        return self

    def stop(self):
        pass

    def summary(self):
        return {"sm_clock_mhz": None, "power_w": None}


def _timer(fns, **kw):
    return Timing(1.0, 1.0, 1.0, 3, len(fns))


@CPU_ONLY
def test_chunked_batch_end_to_end_on_cpu(monkeypatch):
    """A tiny chunked batch through the check-then-time loop: leanfa's portable kernel (BF16, FP8 end to end,
    FP8 kernel alone) in the interpreter, FA3 BF16/FP8, FlashAttention-2 and a cuDNN BF16 graph through
    stand-ins that see each call's cu_seqlens_q/k (and cuDNN's mask alignment); every row passes the float64
    check. cuDNN FP8 gets "n/a" with the reason (its frontend refuses bottom-right FP8 before Blackwell)."""
    import torch.nn.attention.varlen as varlen_mod

    fa3_calls, fa2_calls, graphs = [], [], []
    monkeypatch.setattr(fa3, "module", lambda: _fake_fa3(fa3_calls))
    monkeypatch.setattr(varlen_mod, "varlen_attn", _fake_varlen_attn(fa2_calls))

    def get_graph(**kw):
        graphs.append(kw)
        if kw["fp8"]:
            raise cudnn_graphs.Unsupported("stand-in: sdpa fp8 bottom-right causal needs Blackwell")
        return _FakeCudnnGraph(kw)
    monkeypatch.setattr(cudnn_graphs, "get_graph", get_graph)
    monkeypatch.setattr(cudnn_graphs, "cudnn", lambda: types.SimpleNamespace(backend_version=lambda: 91300))

    anywhere = {"leanfa-portable-bf16", "leanfa-portable-fp8", "leanfa-portable-fp8-kernel", "fa3-bf16", "fa3-fp8",
                "sdpa-flash-bf16", "cudnn-bf16", "cudnn-fp8"}
    chosen = [dataclasses.replace(i, available=lambda: (True, "")) for i in all_impls() if i.name in anywhere]
    rows = run_bench([TINY], chosen, BenchConfig(device="cpu", max_copies=1), timer=_timer,
                     sampler_factory=_Sampler, progress=False, log=None)
    by = {r["impl"]: r for r in rows}
    for name in anywhere - {"cudnn-fp8"}:
        r = by[name]
        assert r["status"] == "ok", r
        tol = 2e-2 if r["precision"] == "bf16" else 0.12
        assert r["check_rel_l2"] < tol, r
        assert r["flops"] == shapes.flops(TINY) and r["seqlens_k"] == [20, 4, 13]
    want = dict(cu_q=[0, 9, 13, 18], cu_k=[0, 20, 24, 37], max_q=9, max_k=20)
    assert fa3_calls and all({k: c[k] for k in want} == want for c in fa3_calls)
    assert {c["fp8"] for c in fa3_calls} == {True, False}
    assert fa2_calls and all(c == want for c in fa2_calls)
    assert by["cudnn-fp8"]["status"] == "n/a" and "needs bottom-right causal" in by["cudnn-fp8"]["reason"]
    assert len(graphs) == 2
    for g in graphs:
        assert (g["seqlen"], g["seqlen_k"], g["bottom_right"], g["ragged"], g["batch"]) == (9, 20, True, True, 3)


def test_fa3_fp8_scales_keys_by_their_own_sequences():
    """FA3's FP8 inputs: K's and V's descales are per (sequence of keys, KV head)."""
    x = make_inputs(TINY, device="cpu", seed=1)
    k8, dk = fa3.quantize_per_kv_head(x.k, 2, x.cu_seqlens_k)
    assert dk.shape == (3, 2)
    for b, (a, e) in enumerate(zip(x.cu_seqlens_k.tolist(), x.cu_seqlens_k.tolist()[1:])):
        assert torch.allclose(dk[b], x.k[a:e].float().abs().amax(dim=(0, 2)) / fa3.FP8_MAX)
    assert errors.error_metrics(_dequant(k8, dk, x.cu_seqlens_k, 2), x.k.float())["rel_l2"] < 0.05
    with pytest.raises(RuntimeError):  # the query lengths do not cut the keys
        fa3.quantize_per_kv_head(x.k, 2, x.cu_seqlens)


def test_cudnn_ragged_offsets_cut_keys_by_their_lengths(monkeypatch):
    monkeypatch.setattr(cudnn_graphs, "cudnn", lambda: types.SimpleNamespace(backend_version=lambda: 91300))
    x = make_inputs(TINY, device="cpu")
    t = cudnn_graphs.ragged_tensors(x.cu_seqlens, 4, 2, 64, 64, cu_seqlens_k=x.cu_seqlens_k)
    assert t["seq_q"].flatten().tolist() == [9, 4, 5] and t["seq_kv"].flatten().tolist() == [20, 4, 13]
    assert t["off_q"].flatten().tolist() == [0, 9 * 256, 13 * 256, 18 * 256]
    assert t["off_o"].flatten().tolist() == t["off_q"].flatten().tolist()
    assert t["off_k"].flatten().tolist() == [0, 20 * 128, 24 * 128, 37 * 128] == t["off_v"].flatten().tolist()
    plain = cudnn_graphs.ragged_tensors(x.cu_seqlens, 4, 2, 64, 64)
    assert plain["seq_kv"].flatten().tolist() == [9, 4, 5]


# ------------------------------------------------------------------------------ paged K/V rows


@pytest.mark.parametrize("page_size", [4, 8, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_paged_inputs_hold_the_same_keys(page_size, dtype):
    """paged_kv copies the packed K/V into shuffled pages: gathering them through the table gives K/V back;
    every page but the spare one belongs to exactly one sequence; unused rows hold PAGE_FILL, not zeros."""
    x = make_inputs(TINY, device="cpu", seed=3)
    k, v = x.k.to(dtype), x.v.to(dtype)
    paged = paged_kv(k, v, TINY.seqlens_k, page_size, seed=5)
    need = [-(-n // page_size) for n in TINY.seqlens_k]
    assert paged.k_cache.shape == (sum(need) + 1, page_size, 2, 64) and paged.page_size == page_size
    assert paged.page_table.dtype == torch.int32 and paged.page_table.shape == (3, max(need))
    assert torch.equal(gather_pages(paged.k_cache, paged.page_table, TINY.seqlens_k).float(), k.float())
    assert torch.equal(gather_pages(paged.v_cache, paged.page_table, TINY.seqlens_k).float(), v.float())
    used = [int(p) for b, n in enumerate(need) for p in paged.page_table[b, :n]]
    assert sorted(used) == sorted(set(used)) and len(used) == sum(need)
    spare = ({*range(sum(need) + 1)} - set(used)).pop()
    assert (paged.k_cache[spare].float() == PAGE_FILL[dtype]).all()
    assert all(int(p) == spare for b, n in enumerate(need) for p in paged.page_table[b, n:])
    tail = TINY.seqlens_k[0] % page_size
    if tail:  # the rows past the first sequence's end in its last page
        last = int(paged.page_table[0, need[0] - 1])
        assert (paged.v_cache[last, tail:].float() == PAGE_FILL[dtype]).all()
    if page_size == 4:  # pages really shuffled
        assert used != sorted(used)
    with pytest.raises(ValueError, match="seqlens_k"):
        paged_kv(k, v, TINY.seqlens, page_size)


@CPU_ONLY
def test_paged_rows_run_on_cpu_and_match_contiguous(monkeypatch):
    """The paged rows in the check-then-time loop on a tiny chunked batch (portable kernel, interpreter): they
    pass the float64 check with the contiguous rows' FLOP count, and a paged call gives the contiguous call's
    output exactly (BF16 and FP8, also with 8-token pages: several pages per sequence)."""
    names = {"leanfa-portable-bf16", "leanfa-portable-bf16-paged64", "leanfa-portable-bf16-paged128",
             "leanfa-portable-fp8-kvhead-kernel", "leanfa-portable-fp8-paged64-kernel",
             "leanfa-portable-fp8-paged128-kernel"}
    chosen = [i for i in all_impls() if i.name in names]
    assert len(chosen) == len(names)
    rows = run_bench([TINY], chosen, BenchConfig(device="cpu", max_copies=1), timer=_timer,
                     sampler_factory=_Sampler, progress=False, log=None)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["check_rel_l2"] < (2e-2 if r["precision"] == "bf16" else 0.12), r
        assert r["flops"] == shapes.flops(TINY)
    assert "shuffled" in {r["impl"]: r for r in rows}["leanfa-portable-bf16-paged64"]["note"]
    x = make_inputs(TINY, device="cpu", seed=4)
    for contiguous, paged, vllm in ((impls_mod._leanfa_bf16("portable"), impls_mod._leanfa_bf16_paged("portable", 8),
                                     impls_mod._leanfa_bf16_paged("portable", 8, vllm=True)),
                                    (impls_mod._leanfa_fp8_kvhead_kernel("portable"),
                                     impls_mod._leanfa_fp8_kvhead_kernel("portable", 8),
                                     impls_mod._leanfa_fp8_kvhead_kernel("portable", 8, vllm=True))):
        want = contiguous(TINY, x).run()
        got = paged(TINY, x).run()
        assert torch.isfinite(got).all() and torch.equal(got, want)
        assert torch.equal(vllm(TINY, x).run(), want)  # vLLM's call: the lengths as seqused_k, cu_seqlens_k=None
    dense = dataclasses.replace(TINY, seqlens=None, seqlens_k=None, batch=2)
    with pytest.raises(NotApplicable, match="packed"):
        impls_mod._leanfa_bf16_paged("portable", 64)(dense, make_inputs(dense, device="cpu"))


def test_paged_rows_are_opt_in():
    """The default selection (no --impl) leaves the paged and per-KV-head FP8 rows out; a pattern takes them."""
    default = {i.name for i in impls_mod.select(all_impls())}
    assert not any("paged" in n or "kvhead" in n for n in default) and "leanfa-portable-bf16" in default
    named = {i.name for i in impls_mod.select(all_impls(), ["leanfa-*-paged*"])}
    assert named == ({f"leanfa-{b}-{p}" for b in ("hopper", "portable")
                      for ps in (64, 128)
                      for p in (f"bf16-paged{ps}", f"fp8-paged{ps}-kernel", f"bf16-paged{ps}-vllm", f"fp8-paged{ps}-vllm")}
                     | {f"leanfa-hopper-fp8-paged{ps}-launch" for ps in (64, 128)})


# ------------------------------------------------------------------------------ the CLI


def test_dry_run_lists_the_chunked_batches(capsys):
    assert commands.main("bench", ["--dry-run", "--sweep", "serving"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("8 cases x ")
    assert any(line.startswith("serving/chunk8x2k+prefix/chunked8/S2048-Sk13765/") for line in out)
    assert any(line.startswith("serving/chunks+new/chunked15/S4096-Sk30622/") for line in out)
    assert sum("/varlen" in line for line in out) == 6
    assert commands.main("bench", ["--help"]) == 0
    assert "chunked-prefill" in capsys.readouterr().out
    # the chunked batches alone, with the paged rows beside the contiguous ones and FA3
    impl = "leanfa-*-bf16*,leanfa-*-fp8-kernel,leanfa-*-kvhead*,leanfa-*-paged*,fa3-*"
    assert commands.main("bench", ["--dry-run", "--sweep", "chunked", "--quick", "--impl", impl]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 3 and out[-1].startswith("2 cases x 26 implementations")
    assert all("/chunked" in line for line in out[:2])
    assert "leanfa-portable-bf16-paged128" in out[-1] and "fa3-fp8" in out[-1]
    assert "leanfa-hopper-fp8-paged64-launch" in out[-1] and "leanfa-hopper-fp8-paged64-vllm" in out[-1]


@pytest.mark.parametrize("fp8", [False, True])
def test_cudnn_graph_asks_for_bottom_right_on_chunked_batches(monkeypatch, fp8):
    """What the graph builder asks the cuDNN frontend for (recorded by a mock): for a chunked batch K/V
    dims of the longest key sequence and ``use_causal_mask_bottom_right`` (never with top-left
    ``use_causal_mask``, which the frontend refuses); for a plain batch the top-left mask as before."""
    from unittest import mock

    mod = mock.MagicMock()
    mod.backend_version.return_value = 91300
    g = mod.pygraph.return_value
    g.sdpa.return_value = (mock.MagicMock(), mock.MagicMock())
    g.sdpa_fp8.return_value = tuple(mock.MagicMock() for _ in range(4))
    g.get_workspace_size.return_value = 0
    monkeypatch.setattr(cudnn_graphs, "cudnn", lambda: mod)
    monkeypatch.setattr(cudnn_graphs, "handle", lambda: None)
    monkeypatch.setattr(cudnn_graphs, "_graphs", {})  # these mock graphs stay out of the real cache
    common = dict(fp8=fp8, batch=3, heads=4, kv_heads=2, seqlen=9, head_dim=64, head_dim_v=64, causal=True,
                  softmax_scale=0.125, ragged=True, device="cpu")
    op = g.sdpa_fp8 if fp8 else g.sdpa
    cudnn_graphs.get_graph(**common, seqlen_k=20, bottom_right=True)
    kw = op.call_args.kwargs
    assert kw["use_causal_mask"] is False and kw["use_causal_mask_bottom_right"] is True
    assert kw["use_padding_mask"] is True
    dims = {c.kwargs["name"]: c.kwargs["dim"] for c in g.tensor.call_args_list if c.kwargs["name"] in ("q", "k", "v")}
    assert dims == {"q": [3, 4, 9, 64], "k": [3, 2, 20, 64], "v": [3, 2, 20, 64]}
    g.reset_mock()
    cudnn_graphs.get_graph(**common)  # a plain batch: Sk == Sq, the top-left mask (equal there)
    kw = op.call_args.kwargs
    assert kw["use_causal_mask"] is True and "use_causal_mask_bottom_right" not in kw
    dims = {c.kwargs["name"]: c.kwargs["dim"] for c in g.tensor.call_args_list if c.kwargs["name"] in ("q", "k", "v")}
    assert dims["k"] == [3, 2, 9, 64]
