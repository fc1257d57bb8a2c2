"""CPU tests of FlashAttention-3 as a peer in leanfa bench/accuracy (leanfa/bench/fa3.py, the
fa3-* rows of leanfa/bench/impls.py), of the best-peer ratio (leanfa/bench/peers.py) and its
tables, of the Llama-3.1-70B preset, and of the scripts that run them on the H200.

FA3 itself needs a Hopper GPU: here a fake ``fa3_fwd_interface`` module (the fa3-fwd wheel's
call signatures) computes float64 attention on the *dequantized* inputs it receives, so a wrong
descale (shape, batch or head order, Q's group amax) shows as a large error."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import types

import pytest
import torch

import leanfa
from leanfa.bench import fa3, impls, peers, report, shapes
from leanfa.bench.errors import error_metrics
from leanfa.bench.inputs import Inputs, make_inputs
from leanfa.bench.runner import BenchConfig, add_ratios, run_bench
from leanfa.bench.timing import Timing
from leanfa.reference import attention_ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------- a fake FA3 module


def _dequant(t, descale, cu_seqlens):
    """``t`` (FP8) times its (batch, kv head) descale, as FA3 applies it."""
    if t.dtype != FP8:
        assert descale is None
        return t.double()
    b, hkv = descale.shape
    group = t.shape[-2] // hkv
    per_head = descale.double().repeat_interleave(group, dim=1)  # (B, H)
    if cu_seqlens is None:
        assert t.shape[0] == b
        return t.double() * per_head[:, None, :, None]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return t.double() * per_head.repeat_interleave(lengths, dim=0)[:, :, None]


def _check_descales(q, k, kw, batch):
    hkv = k.shape[-2]
    for name in ("q_descale", "k_descale", "v_descale"):
        d = kw.get(name)
        if q.dtype == FP8:
            assert d is not None and tuple(d.shape) == (batch, hkv), (name, None if d is None else d.shape)
            assert d.dtype == torch.float32 and d.is_contiguous()
        else:
            assert d is None


def make_fake_fa3(calls: list, name: str = "fa3_fwd_interface") -> types.ModuleType:
    """A stand-in for the fa3-fwd wheel's module: same signatures, returns the output alone."""
    mod = types.ModuleType(name)
    mod.__file__ = f"/site-packages/{name}.py"

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        kw = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        _check_descales(q, k, kw, q.shape[0])
        calls.append({"fn": "flash_attn_func", "causal": causal, "dtype": q.dtype, **kw})
        out = attention_ref(_dequant(q, q_descale, None), _dequant(k, k_descale, None),
                            _dequant(v, v_descale, None), causal=causal).to(torch.bfloat16)
        return (out, None) if return_attn_probs else out

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                               softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                               return_attn_probs=False):
        kw = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        _check_descales(q, k, kw, cu_seqlens_q.numel() - 1)
        assert cu_seqlens_q.dtype == torch.int32 and max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        calls.append({"fn": "flash_attn_varlen_func", "causal": causal, "dtype": q.dtype,
                      "cu_seqlens": cu_seqlens_q.tolist(), "max_seqlen": (max_seqlen_q, max_seqlen_k), **kw})
        out = attention_ref(_dequant(q, q_descale, cu_seqlens_q), _dequant(k, k_descale, cu_seqlens_k),
                            _dequant(v, v_descale, cu_seqlens_k), causal=causal, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_k=cu_seqlens_k).to(torch.bfloat16)
        return (out, None) if return_attn_probs else out

    mod.flash_attn_func = flash_attn_func
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod


@pytest.fixture
def fake_fa3(monkeypatch):
    """The fake wheel module importable as fa3_fwd_interface, and a Hopper GPU 'present'."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", make_fake_fa3(calls))
    monkeypatch.setattr(impls, "cuda_capability", lambda: (9, 0))
    return calls


def _by_name(name):
    return next(i for i in impls.all_impls() if i.name == name)


def _uneven_inputs(case: shapes.Case, seed=0) -> Inputs:
    """Inputs whose magnitude differs by sequence (1, 10, 100) and by KV head (1, 4, ...), and
    across the query heads of a group, so that a descale applied to the wrong (sequence, head)
    gives a large error. Q gets the inverse gains of its K, so the logits stay O(1)."""
    x = make_inputs(case, device="cpu", seed=seed)
    g = case.heads // case.kv_heads
    kv_gain = torch.tensor([4.0 ** i for i in range(case.kv_heads)])
    q_gain = (1 / kv_gain).repeat_interleave(g) * torch.linspace(0.5, 2.0, case.heads)
    n = len(case.seqlens) if case.varlen else case.batch
    b_gain = torch.tensor([10.0 ** (i % 3) for i in range(n)])
    if case.varlen:
        b_gain = b_gain.repeat_interleave(torch.tensor(case.seqlens))

    def scale(t, per_seq, per_head):
        shape = (-1,) + (1,) * (t.dim() - 1)
        return (t.float() * per_seq.reshape(shape) * per_head[:, None]).to(torch.bfloat16)
    return Inputs(scale(x.q, 1 / b_gain, q_gain), scale(x.k, b_gain, kv_gain), scale(x.v, b_gain, kv_gain),
                  x.cu_seqlens, x.max_seqlen)


DENSE = shapes.Case("standard", "d64", "gaussian", 3, 40, 8, 2, 64, 64, True)
VARLEN = shapes.Case("varlen", "d64", "gaussian", 3, 40, 8, 2, 64, 64, True, (40, 17, 5))


# ------------------------------------------------------------------------- module resolution


def test_fa3_module_prefers_the_wheel_then_flash_attn_interface(monkeypatch):
    wheel, old = make_fake_fa3([]), make_fake_fa3([], "flash_attn_interface")
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", wheel)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", old)
    assert fa3.module() is wheel
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)  # not installed
    assert fa3.module() is old
    assert fa3.available() == (True, "flash_attn_interface")


def test_fa3_module_never_takes_leanfas_own_flash_attn_interface(monkeypatch):
    """leanfa/flash_attn_interface.py is leanfa's API, not FA3, even when it is what the name
    ``flash_attn_interface`` resolves to (e.g. leanfa/ on sys.path)."""
    import leanfa.flash_attn_interface as ours

    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", ours)
    with pytest.raises(ImportError, match="leanfa's own"):
        fa3.module()
    ok, why = fa3.available()
    assert not ok and "fa3_fwd_interface" in why and "leanfa's own" in why


def test_fa3_availability_needs_a_hopper_gpu_and_the_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", make_fake_fa3([]))
    for name in ("fa3-bf16", "fa3-fp8"):
        impl = _by_name(name)
        monkeypatch.setattr(impls, "cuda_capability", lambda: None)
        assert impl.available() == (False, "needs a CUDA GPU; none found")
        monkeypatch.setattr(impls, "cuda_capability", lambda: (8, 0))
        ok, why = impl.available()
        assert not ok and "Hopper" in why and "sm80" in why
        monkeypatch.setattr(impls, "cuda_capability", lambda: (9, 0))
        assert impl.available() == (True, "fa3_fwd_interface")
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    ok, why = _by_name("fa3-fp8").available()
    assert not ok and "not importable" in why


def test_gpu_rows_are_unavailable_without_a_gpu_and_portable_is_not(monkeypatch):
    monkeypatch.setattr(impls, "cuda_capability", lambda: None)
    for i in impls.all_impls():
        ok, why = i.available()
        if i.name.startswith("leanfa-portable"):
            assert ok, (i.name, why)
        else:  # Hopper, cuDNN, SDPA, FA3, FlashInfer, FA4
            assert not ok and "GPU" in why, (i.name, why)
    monkeypatch.setattr(impls, "cuda_capability", lambda: (10, 0))  # Blackwell: no wgmma kernels
    ok, why = _by_name("leanfa-hopper-fp8-kernel").available()
    assert not ok and "Hopper" in why


# ------------------------------------------------------------------------------ FP8 scaling


@pytest.mark.parametrize("case", [DENSE, VARLEN], ids=["dense", "varlen"])
def test_quantize_per_kv_head_scales_each_sequence_and_kv_head(case):
    x = _uneven_inputs(case)
    cu = x.cu_seqlens if case.varlen else None
    nb, g = len(case.seqlens) if case.varlen else case.batch, case.heads // case.kv_heads
    for t in (x.q, x.k):
        t8, d = fa3.quantize_per_kv_head(t, case.kv_heads, cu)
        assert t8.dtype == FP8 and t8.shape == t.shape
        assert d.shape == (nb, case.kv_heads) and d.dtype == torch.float32
        group = t.shape[-2] // case.kv_heads
        for b in range(nb):
            rows = t[cu[b]:cu[b + 1]] if cu is not None else t[b]
            for h in range(case.kv_heads):
                amax = rows[..., h * group:(h + 1) * group, :].float().abs().max()
                assert d[b, h].item() == pytest.approx(amax.item() / 448.0, rel=1e-6)
        deq = _dequant(t8, d, cu)
        assert error_metrics(deq, t.double())["rel_l2"] < 0.05
    assert g == 4  # Q's descale covers 4 query heads per KV head here


def test_quantize_per_kv_head_keeps_an_empty_sequence_finite():
    t = torch.randn(10, 4, 16).to(torch.bfloat16)
    cu = torch.tensor([0, 6, 6, 10], dtype=torch.int32)
    t8, d = fa3.quantize_per_kv_head(t, 2, cu)
    assert torch.isfinite(t8.float()).all() and torch.isfinite(d).all() and d.shape == (3, 2)


# ------------------------------------------------------------------------ the fa3-* rows


@pytest.mark.parametrize("case", [DENSE, VARLEN], ids=["dense", "varlen"])
@pytest.mark.parametrize("name", ["fa3-bf16", "fa3-fp8"])
def test_fa3_rows_call_the_wheel_with_its_signature(fake_fa3, case, name):
    x = _uneven_inputs(case)
    p = _by_name(name).prepare(case, x)
    assert fake_fa3 == []  # preparing (quantizing) calls nothing
    out = p.output(p.run())
    (call,) = fake_fa3
    assert call["fn"] == ("flash_attn_varlen_func" if case.varlen else "flash_attn_func")
    assert call["causal"] is True and call["dtype"] == (FP8 if name == "fa3-fp8" else torch.bfloat16)
    if case.varlen:
        assert call["cu_seqlens"] == [0, 40, 57, 62] and call["max_seqlen"] == (40, 40)
    assert out.shape == x.q.shape[:-1] + (case.head_dim_v,) and out.dtype == torch.bfloat16
    kw = dict(cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens) if case.varlen else {}
    ref = attention_ref(x.q, x.k, x.v, causal=True, **kw)
    err = error_metrics(out, ref)["rel_l2"]
    # FP8 with the right per-(sequence, KV head) descales: e4m3 rounding only (inputs span 10^4)
    assert err < (0.08 if name == "fa3-fp8" else 1e-2), err
    if name == "fa3-fp8":
        assert "per (sequence, KV head)" in p.note and "fa3_fwd_interface" in p.note


def test_fa3_output_of_takes_out_from_either_return_form():
    o = torch.ones(2)
    assert fa3.output_of(o) is o and fa3.output_of((o, torch.zeros(1))) is o


def test_fa3_unsupported_shape_is_not_applicable(monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("This flash attention build does not support varlen.")

    mod = make_fake_fa3([])
    mod.flash_attn_varlen_func = refuse
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", mod)
    p = _by_name("fa3-bf16").prepare(VARLEN, make_inputs(VARLEN, device="cpu"))
    with pytest.raises(impls.NotApplicable, match="does not support varlen"):
        p.run()


def test_bench_loop_with_fa3_and_best_peer(fake_fa3):
    """fa3-* rows go through the check-then-time loop; the ratios then name the best peer."""
    cases = [DENSE, VARLEN]
    rows = run_bench(cases, [_by_name("fa3-bf16"), _by_name("fa3-fp8")], BenchConfig(device="cpu", max_copies=1),
                     timer=lambda fns, **kw: Timing(2.0, 2.0, 2.0, 5, len(fns)),
                     sampler_factory=lambda: type("S", (), {"summary": lambda self: {}})(),
                     progress=False, log=None)
    assert [r["status"] for r in rows] == ["ok"] * 4, [r.get("error") for r in rows]
    rows = add_ratios(rows, {})
    for r in rows:
        assert r["best_peer"] == r["impl"] and r["ratio_best_peer"] == pytest.approx(1.0)


# ------------------------------------------------------------------------- best-peer ratio


def _row(case, impl, precision, tflops=None, status="ok", family=None):
    r = {**case.to_dict(), "case": case.name, "impl": impl, "family": family or impl.split("-")[0],
         "precision": precision, "variant": "kernel", "status": status}
    if tflops is not None:
        r.update(tflops=tflops, time_ms=1.0)
    return r


A = shapes.Case("standard", "d128", "gaussian", 4, 4096, 16, 16, 128, 128, True)
B = shapes.Case("standard", "d128", "gaussian", 1, 16384, 16, 16, 128, 128, True)


def _peer_rows():
    return [
        # case A: FA3 is the fastest FP8 peer, cuDNN the fastest BF16 one
        _row(A, "cudnn-fp8", "fp8", 800.0), _row(A, "fa3-fp8", "fp8", 900.0),
        _row(A, "leanfa-hopper-fp8-kernel", "fp8", 850.0), _row(A, "leanfa-hopper-fp8", "fp8", 700.0),
        _row(A, "cudnn-fp8-e2e", "fp8", 950.0),  # not a peer (end to end): never the best peer
        _row(A, "cudnn-bf16", "bf16", 600.0), _row(A, "fa3-bf16", "bf16", 500.0),
        _row(A, "leanfa-hopper-bf16", "bf16", 550.0),
        # case B: the FP8 peers did not run (FAILED, n/a); a fast BF16 peer must not count for FP8
        _row(B, "cudnn-fp8", "fp8", status="n/a"), _row(B, "fa3-fp8", "fp8", 2000.0, status="FAILED"),
        _row(B, "leanfa-hopper-fp8-kernel", "fp8", 820.0), _row(B, "cudnn-bf16", "bf16", 3000.0),
        _row(B, "leanfa-hopper-bf16", "bf16", 560.0),
    ]


def test_best_peer_is_the_fastest_same_precision_peer_of_the_same_case():
    by = {(r["case"], r["impl"]): r for r in add_ratios(_peer_rows(), {})}
    k = by[(A.name, "leanfa-hopper-fp8-kernel")]
    assert k["best_peer"] == "fa3-fp8" and k["best_peer_tflops"] == 900.0
    assert k["ratio_best_peer"] == pytest.approx(850 / 900)
    assert k["ratio_cudnn"] == pytest.approx(850 / 800)  # the per-cuDNN ratio is kept
    assert by[(A.name, "leanfa-hopper-fp8")]["ratio_best_peer"] == pytest.approx(700 / 900)
    bf = by[(A.name, "leanfa-hopper-bf16")]
    assert bf["best_peer"] == "cudnn-bf16" and bf["ratio_best_peer"] == pytest.approx(550 / 600)
    assert by[(A.name, "cudnn-fp8")]["ratio_best_peer"] == pytest.approx(800 / 900)
    none = by[(B.name, "leanfa-hopper-fp8-kernel")]
    assert none["best_peer"] is None and none["ratio_best_peer"] is None
    assert by[(B.name, "leanfa-hopper-bf16")]["best_peer"] == "cudnn-bf16"
    assert "best_peer" not in by[(B.name, "fa3-fp8")]  # a failed row gets no ratio


def test_best_peer_error_is_the_most_accurate_peer():
    rows = [{"profile": "llama3-8b", "impl": i, "precision": p, "status": s, "rel_l2": e}
            for i, p, s, e in (("cudnn-fp8", "fp8", "ok", 0.06), ("fa3-fp8", "fp8", "ok", 0.04),
                               ("leanfa-hopper-fp8", "fp8", "ok", 0.02), ("cudnn-bf16", "bf16", "ok", 0.004),
                               ("fa3-bf16", "bf16", "ok", 0.003), ("leanfa-hopper-bf16", "bf16", "ok", 0.003),
                               ("fa3-fp8", "fp8", "n/a", None))]
    rows.append({"profile": "gaussian", "impl": "leanfa-hopper-fp8", "precision": "fp8", "status": "ok",
                 "rel_l2": 0.03})
    by = {(r["profile"], r["impl"], r["status"]): r for r in peers.add_best_peer_error(rows)}
    r = by[("llama3-8b", "leanfa-hopper-fp8", "ok")]
    assert r["best_peer"] == "fa3-fp8" and r["ratio_best_peer"] == pytest.approx(0.5)
    assert by[("llama3-8b", "leanfa-hopper-bf16", "ok")]["best_peer"] == "fa3-bf16"
    assert by[("gaussian", "leanfa-hopper-fp8", "ok")]["best_peer"] is None


def test_bench_markdown_headline_names_the_best_peer(tmp_path):
    rows = add_ratios(_peer_rows(), {})
    payload = {"kind": "bench", "env": {"gpu": "NVIDIA H200"}, "rows": rows}
    md = report.bench_markdown(payload)
    assert "## leanfa against the best peer" in md
    assert ("| d128 | 4096 | B4 | 16/16 | 128/128 | causal | leanfa-hopper-fp8-kernel | 850 | fa3-fp8 | 900 "
            "| 0.94x |") in md
    assert "| d128 | 4096 | B4 | 16/16 | 128/128 | causal | leanfa-hopper-bf16 | 550 | cudnn-bf16 | 600 | 0.92x |" in md
    assert "| d128 | 16384 | B1 | 16/16 | 128/128 | causal | leanfa-hopper-fp8-kernel | 820 | no peer ran |  | no peer ran |" in md
    assert "850 (0.94x)" in md and "fa3-fp8 (900)" in md  # sweep grid cell and its best-peer column
    assert "best FP8 peer" in md and "best BF16 peer" in md
    assert "leanfa against the best peer" in md and peer_names_in(md) == {"fa3-fp8", "cudnn-bf16"}
    # an old file (no best-peer fields) re-renders with them, and its JSON is left as it was
    old = [{k: v for k, v in r.items() if "peer" not in k} for r in rows]
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**payload, "rows": old}))
    before = path.read_bytes()
    written = report.rerender(str(path), plots=False)
    assert [os.path.basename(w) for w in written] == ["old.md"]
    assert (tmp_path / "old.md").read_text().strip() == md.strip() and path.read_bytes() == before


def peer_names_in(md: str) -> set:
    head = md.split("## leanfa against the best peer")[1].split("\n## ")[0]
    return {m for m in re.findall(r"\| (cudnn-[a-z0-9]+|fa3-[a-z0-9]+) \|", head)}


def test_accuracy_markdown_has_best_peer_columns():
    rows = peers.add_best_peer_error([
        {"profile": "p", "impl": "fa3-fp8", "precision": "fp8", "status": "ok", "rel_l2": 0.04},
        {"profile": "p", "impl": "leanfa-hopper-fp8", "precision": "fp8", "status": "ok", "rel_l2": 0.02}])
    md = report.accuracy_markdown({"env": {}, "rows": rows})
    assert "x best peer" in md and "| p |  | leanfa-hopper-fp8 | ok | 2.000e-02 |" in md and "| 0.50 | fa3-fp8 |" in md


# ---------------------------------------------------------------------------- presets


def test_llama31_70b_preset_has_64_query_and_8_kv_heads():
    assert shapes.MODELS["llama3.1-70b"] == (64, 8, 128, 128)
    (c,) = shapes.build_cases(["models"], models=["llama3.1-70b"], seqlens=[4096])
    assert (c.heads, c.kv_heads, c.head_dim, c.batch) == (64, 8, 128, 4)
    assert c.preset == "llama3-8b"  # its activations: Llama-3's profile at 64/8 heads
    small = shapes.Case("models", c.label, c.preset, 1, 16, 64, 8, 128, 128, True)
    x = make_inputs(small, device="cpu")
    assert x.q.shape == (1, 16, 64, 128) and x.k.shape == (1, 16, 8, 128)


# ---------------------------------------------------------------------------- scripts


def _load_script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ncu_stalls_selects_each_attention_kernel():
    ncu = _load_script("ncu_stalls")
    assert ncu.kernel_filter("leanfa-hopper-fp8-kernel") == ["--kernel-name", "regex:attn_fwd"]
    f = ncu.kernel_filter("fa3-fp8")
    regex = f[f.index("--kernel-name") + 1]
    assert regex.startswith("regex:") and "demangled" in f
    pattern = re.compile(regex[len("regex:"):])
    fa3_kernel = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
                  "flash::CollectiveMainloopFwdSm90<2, cute::tuple<...>, true, false>>>>(T1::Params)")
    assert pattern.search(fa3_kernel)
    for before in ("void flash::prepare_varlen_num_blocks_kernel<1, false>(int, int, int, int const*)",
                   "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>>(int, T2, T3)"):
        assert not pattern.search(before), before
    assert ncu.kernel_filter("cudnn-fp8") == []


def test_gpu_session_fa3_steps_name_real_implementations():
    text = open(os.path.join(ROOT, "scripts", "gpu_session.sh")).read()
    names = {i.name for i in impls.all_impls()}
    (fa3_impls,) = re.findall(r"^FA3_IMPLS='([^']+)'", text, re.M)
    assert set(fa3_impls.split(",")) <= names and {"fa3-fp8", "fa3-bf16", "cudnn-fp8"} <= set(fa3_impls.split(","))
    for step in ("bench_fa3", "bench_fa3_causal", "bench_fa3_models", "accuracy_fa3", "stalls_fa3"):
        assert re.search(rf"^\s+{step}\) step {step} ", text, re.M), step
    assert "--target /tmp/site" in text and "export PYTHONPATH=/tmp/site:" in text
    assert leanfa.__version__


# ------------------------------------------------------------------ on a Hopper GPU with FA3


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_gpu_real_fa3_rows_match_the_reference(varlen):
    """The installed FA3 (fa3-fwd wheel) through the fa3-* rows: BF16 near exact, FP8 with the
    per-(sequence, KV head) descales at e4m3 rounding error, on uneven magnitudes and GQA."""
    for name in ("fa3-bf16", "fa3-fp8"):
        ok, why = _by_name(name).available()
        if not ok:
            pytest.skip(why)
    case = (shapes.Case("varlen", "d128", "gaussian", 3, 1000, 8, 2, 128, 128, True, (1000, 300, 77)) if varlen
            else shapes.Case("standard", "d128", "gaussian", 3, 512, 8, 2, 128, 128, True))
    cpu = _uneven_inputs(case)
    x = Inputs(cpu.q.cuda(), cpu.k.cuda(), cpu.v.cuda(),
               None if cpu.cu_seqlens is None else cpu.cu_seqlens.cuda(), cpu.max_seqlen)
    kw = dict(cu_seqlens_q=x.cu_seqlens, cu_seqlens_k=x.cu_seqlens) if varlen else {}
    ref = attention_ref(x.q, x.k, x.v, causal=True, **kw)
    for name, tol in (("fa3-bf16", 1e-2), ("fa3-fp8", 0.12)):  # FA3 also rounds P to e4m3; wrong descales: > 0.5
        p = _by_name(name).prepare(case, x)
        out = p.output(p.run())
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        err = error_metrics(out, ref)["rel_l2"]
        assert err < tol, (name, err)
