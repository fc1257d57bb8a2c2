"""CPU tests of the measurement system (leanfa/bench): CLI without a GPU, FLOP counting,
sweeps, report writers, the ncu CSV parser, and the check-then-time loop end to end with a
fake timer (leanfa's portable kernel runs in Triton's interpreter; see conftest.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from leanfa.bench import commands, errors, profile, report, shapes
from leanfa.bench.impls import Impl, NotApplicable, Prepared, all_impls, select
from leanfa.bench.inputs import Inputs, copies_for, input_bytes, make_inputs
from leanfa.bench.runner import BenchConfig, add_ratios, run_bench
from leanfa.bench.timing import Timing, quantile, summarize

NO_GPU = not torch.cuda.is_available()
# runs leanfa on CPU tensors through the interpreter: the CPU (CI) path only
CPU_ONLY = pytest.mark.skipif(not NO_GPU, reason="runs the interpreter path on CPU tensors (CI)")

# ------------------------------------------------------------------------------------- CLI


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU path")
@pytest.mark.parametrize("command", ["bench", "accuracy", "profile"])
def test_cli_without_gpu_exits_nonzero_with_one_line(command, capsys):
    assert commands.main(command, []) != 0
    err = capsys.readouterr().err.strip()
    assert err == f"leanfa {command} needs a CUDA GPU; none found"


def test_cli_help_unknown_and_bad_args(capsys):
    assert commands.main("bench", ["--help"]) == 0
    assert "--quick" in capsys.readouterr().out
    assert commands.main("frobnicate", []) == 2
    assert commands.main("bench", ["--no-such-flag"]) == 2
    assert commands.main("bench", ["--dry-run", "--sweep", "nope"]) == 2
    assert "unknown sweep" in capsys.readouterr().err


def test_cli_dry_run_quick_lists_cases(capsys):
    assert commands.main("bench", ["--dry-run", "--quick"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("28 cases x ")  # 12 standard + 5 models x 3 + 1 varlen
    assert sum("/S16384/" in line for line in out) == 9  # 4 standard + 5 models
    assert commands.main("bench", ["--dry-run", "--sweep", "standard", "--seqlens", "2k", "--causal", "true",
                              "--impl", "cudnn-*"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("2 cases x 3 implementations")


def test_cli_list(capsys):
    assert commands.main("bench", ["--list", "--precision", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "cudnn-fp8" in out and "cudnn-bf16" not in out


# ----------------------------------------------------------------------------- FLOPs/shapes


def test_flops_conventions():
    f = shapes.attention_flops
    assert f(2, 16, 1024, 1024, 128, 128, False) == 2 * 2 * 16 * 1024 * 1024 * 256
    assert f(2, 16, 1024, 1024, 128, 128, True) == 2 * 16 * 1024 * 1024 * 256
    assert f(1, 16, 4096, 4096, 192, 128, False) == 2 * 16 * 4096 * 4096 * 320  # MLA
    # Sq < Sk causal (bottom-right): the 200 keys before the chunk in full, the 100x100 square halved
    assert f(1, 8, 100, 300, 64, 64, True) == 2 * 8 * (100 * 200 + 100 * 100 / 2) * 128
    assert f(1, 8, 100, 300, 64, 64, False) == 2 * 8 * 100 * 300 * 128
    assert f(1, 8, 300, 100, 64, 64, True) == 2 * 8 * 100 * 100 / 2 * 128  # Sq > Sk: 200 rows see no key
    case = shapes.Case("varlen", "x", "gaussian", 3, 7, 4, 2, 128, 128, True, (7, 3, 5))
    assert shapes.flops(case) == sum(2 * 4 * s * s * 256 / 2 for s in (7, 3, 5))
    assert shapes.flops(case.__class__(**{**case.__dict__, "causal": False})) == sum(
        2 * 4 * s * s * 256 for s in (7, 3, 5))


def test_window_flops_and_sweep():
    """A causal sliding window counts the pairs of its band (less the half diagonal, as causal): against a
    brute-force count; the window sweep puts windows beside the plain causal cases it is compared with."""
    def brute(sq, sk, left):
        rows = [min(i + sk - sq, sk - 1) - max(0, i + sk - sq - left) + 1 for i in range(sq)]
        return sum(n - 0.5 for n in rows if n > 0)

    for sq, sk, left in ((100, 100, 10), (100, 300, 10), (100, 300, 250), (300, 100, 5), (64, 64, 0),
                         (50, 80, 1000)):
        assert shapes.attention_flops(1, 1, sq, sk, 1, 1, True, left) == 4 * brute(sq, sk, left)
    assert shapes.attention_flops(1, 1, 50, 80, 1, 1, True, 1000) == shapes.attention_flops(1, 1, 50, 80, 1, 1, True)
    cases = shapes.build_cases(["window"])
    assert [(c.seqlen, c.window_left) for c in cases] == [(4096, -1), (8192, -1), (16384, 4096), (32768, 4096)]
    assert all(c.causal and c.head_dim == 128 for c in cases)
    assert cases[-1].window_size == (4096, 0) and cases[0].window_size == (-1, -1)
    assert cases[-1].name.endswith("causal-w4096") and "window_left" not in cases[0].to_dict()
    with pytest.raises(ValueError, match="causal"):
        shapes.Case("window", "d128", "gaussian", 1, 64, 1, 1, 128, 128, False, window_left=8)


def test_standard_sweep_shapes():
    cases = shapes.standard_cases()
    assert len(cases) == 2 * 2 * 7
    for c in cases:
        assert c.heads == c.kv_heads == 16 and c.batch * c.seqlen == max(16384, c.seqlen)
        assert (c.head_dim, c.head_dim_v) in ((128, 128), (192, 128))
    assert {c.seqlen for c in cases} == {512, 1024, 2048, 4096, 8192, 16384, 32768}
    assert {c.causal for c in cases} == {True, False}


def test_model_and_varlen_shapes():
    cases = shapes.build_cases(["models", "varlen"])
    models = [c for c in cases if c.sweep == "models"]
    assert {(c.label, c.heads, c.kv_heads, c.head_dim, c.head_dim_v) for c in models} == {
        ("llama3-8b", 32, 8, 128, 128), ("llama3.1-70b", 64, 8, 128, 128), ("mistral-7b", 32, 8, 128, 128),
        ("qwen2.5-7b", 28, 4, 128, 128), ("deepseek-v3-mla", 128, 128, 192, 128)}
    assert all(c.causal for c in cases)
    (var,) = [c for c in cases if c.varlen]
    assert var.tokens == 16384 and len(set(var.seqlens)) == len(var.seqlens) > 4
    quick = shapes.build_cases(quick=True)
    assert {c.seqlen for c in quick if not c.varlen} == set(shapes.QUICK_SEQLENS)


def test_serving_batches():
    """The serving sweep: six packed causal batches on Llama-3-8B heads, each its own label, lengths fixed on every
    machine (a long prompt among 40 short ones, 64 and 256 chat prompts, equal lengths, a one-token prompt),
    then two chunked-prefill batches (tests/test_bench_serving.py)."""
    cases = shapes.build_cases(["serving"])
    assert len({c.label for c in cases}) == len(cases) == 8 and all(c.varlen and c.causal for c in cases)
    assert [c.label for c in cases if not c.chunked] == list(shapes.SERVING_BATCHES)
    assert [c.label for c in cases if c.chunked] == list(shapes.SERVING_CHUNKED_BATCHES)
    assert {(c.heads, c.kv_heads, c.head_dim) for c in cases} == {(32, 8, 128)}
    by = {c.label: c for c in cases}
    assert by["equal4x4k"].seqlens == (4096,) * 4 and min(by["mixed8"].seqlens) == 1
    assert len(by["chat64"].seqlens) == 64 and all(50 <= n <= 600 for n in by["chat64"].seqlens)
    assert by["long+short40"].seqlen == 12288 and len(by["long+short40"].seqlens) == 41
    assert shapes.build_cases(["serving"]) == cases  # the same lengths on every call
    assert len(shapes.build_cases(["standard"], causal="false", seqlens=[4096])) == 2
    d64 = shapes.build_cases(["standard"], causal="true", seqlens=[4096], dims=["d64", "mla"])
    assert [(c.head_dim, c.head_dim_v) for c in d64] == [(64, 64), (192, 128)]
    with pytest.raises(ValueError, match="d96"):
        shapes.build_cases(["standard"], dims=["d96"])
    with pytest.raises(ValueError):
        shapes.build_cases(["models"], models=["gpt-5"])


def test_gaussian_inputs_and_rotation_sizes():
    case = shapes.Case("standard", "mla", "gaussian", 2, 16, 4, 2, 192, 128, True)
    x = make_inputs(case, device="cpu", seed=1)
    assert x.q.shape == (2, 16, 4, 192) and x.v.shape == (2, 16, 2, 128)
    assert x.q.dtype == torch.bfloat16 and x.q.abs().sum() > 0
    assert x.nbytes() == input_bytes(case)
    assert torch.equal(make_inputs(case, device="cpu", seed=1).k, x.k)
    assert copies_for(192 << 20, l2_bytes=60 << 20) == 2
    assert copies_for(1 << 20, l2_bytes=60 << 20) == 4
    assert copies_for(1 << 34, l2_bytes=60 << 20) == 1


# ------------------------------------------------------------------------- metrics, timing


def test_error_metrics_and_head_subset():
    ref = torch.ones(1, 2, 2, 4, dtype=torch.float64)
    out = ref.clone()
    out[0, 0, 0, 0] = 2.0
    m = errors.error_metrics(out, ref)
    assert m["max_abs"] == 1.0
    assert m["rel_l2"] == pytest.approx(1.0 / 4.0)  # ||diff||=1, ||ref||=sqrt(16)
    assert m["worst_row_rel"] == pytest.approx(0.5)  # row norm 2
    assert errors.error_metrics(out * float("nan"), ref)["rel_l2"] == float("inf")
    assert errors.head_subset(32, 8) == ([0, 31], [0, 7])
    assert errors.head_subset(28, 4) == ([0, 27], [0, 3])
    assert errors.head_subset(1, 1) == ([0], [0])


def test_timing_summary():
    t = summarize([3.0, 1.0, 2.0, 10.0, 4.0], copies=2)
    assert t.median_ms == 3.0 and t.reps == 5 and t.copies == 2
    assert quantile([0.0, 10.0], 0.2) == pytest.approx(2.0)


def test_nvml_sampler_degrades_without_gpu():
    from leanfa.bench.power import NvmlSampler

    s = NvmlSampler()
    with s:
        pass
    summary = s.summary()
    if not s.available:
        assert summary["sm_clock_mhz"] is None and summary["nvml_samples"] == 0


def test_per_tensor_fp8_quantization():
    from leanfa.bench.cudnn_graphs import FP8_MAX, quantize_per_tensor

    x = torch.randn(2, 64, 4, 32).to(torch.bfloat16) * 3
    x8, d = quantize_per_tensor(x)
    assert x8.dtype == torch.float8_e4m3fn and d.shape == (1, 1, 1, 1)
    assert x8.float().abs().max() == FP8_MAX
    assert errors.error_metrics(x8.float() * d, x.float())["rel_l2"] < 0.05


def test_gpu_slug():
    from leanfa.bench.env import gpu_slug

    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"


def test_registry_selection():
    impls = all_impls()
    names = [i.name for i in impls]
    assert len(names) == len(set(names))
    assert {"leanfa-hopper-fp8", "leanfa-portable-fp8-kernel", "cudnn-fp8", "cudnn-bf16",
            "sdpa-flash-bf16"} <= set(names)
    assert [i.name for i in select(impls, ["cudnn"], ["fp8"])] == ["cudnn-fp8", "cudnn-fp8-e2e"]
    assert all(i.family == "leanfa" for i in select(impls, ["leanfa-*"]))
    assert {i.name for i in impls if i.baseline} == {"cudnn-fp8", "cudnn-bf16"}


# ------------------------------------------------------------------ the loop, end to end


class _FakeSampler:
    def start(self):
        return self

    def stop(self):
        pass

    def summary(self):
        return {"sm_clock_mhz": 1700.0, "power_w": 600.0}


def _fake_timer(ms_by_call):
    def timer(fns, **kw):
        assert all(callable(f) for f in fns)
        return Timing(ms_by_call, ms_by_call, ms_by_call, 7, len(fns))
    return timer


def _math_sdpa(name, precision):
    """A stand-in baseline: torch SDPA math on CPU (GQA by enable_gqa)."""
    def prepare(case, x: Inputs):
        if x.varlen:
            raise NotApplicable("dense only")
        q, k, v = (t.transpose(1, 2) for t in (x.q, x.k, x.v))
        return Prepared(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, enable_gqa=True), lambda o: o.transpose(1, 2))
    return Impl(name, "cudnn", precision, "kernel", "math SDPA stand-in", prepare, baseline=True)


def _zeros(case, x):
    return Prepared(lambda: torch.zeros(x.q.shape[:-1] + (case.head_dim_v,)))


def _not_applicable(case, x):
    raise NotApplicable("does not do this")


@CPU_ONLY
def test_run_bench_end_to_end_on_cpu(tmp_path):
    cases = [shapes.Case("standard", "d64", "gaussian", 1, 32, 4, 2, 64, 64, True),
             shapes.Case("varlen", "d64", "gaussian", 3, 24, 4, 2, 64, 64, True, (24, 9, 3))]
    impls = [i for i in all_impls() if i.name in ("leanfa-portable-bf16", "leanfa-portable-fp8")]
    impls += [_math_sdpa("cudnn-bf16", "bf16"),
              Impl("broken-bf16", "x", "bf16", "kernel", "all zeros", _zeros),
              Impl("never-bf16", "x", "bf16", "kernel", "n/a", _not_applicable)]
    cfg = BenchConfig(device="cpu", max_copies=2)
    rows = run_bench(cases, impls, cfg, timer=_fake_timer(2.0), sampler_factory=_FakeSampler,
                     progress=False, log=None)
    gemm = {"bf16": {"tflops": 700.0}, "fp8": {"tflops": 1300.0}}
    rows = add_ratios(rows, gemm)
    by = {(r["sweep"], r["impl"]): r for r in rows}
    assert len(rows) == len(cases) * len(impls)
    for sweep in ("standard", "varlen"):
        ok = by[(sweep, "leanfa-portable-bf16")]
        assert ok["status"] == "ok", ok
        assert ok["check_rel_l2"] < 2e-2 and ok["sm_clock_mhz"] == 1700.0
        assert ok["tflops"] == pytest.approx(ok["flops"] / 2e-3 / 1e12)
        if sweep == "standard":
            assert ok["ratio_cudnn"] == pytest.approx(1.0)
            assert by[(sweep, "cudnn-bf16")]["status"] == "ok"
        else:
            assert by[(sweep, "cudnn-bf16")]["status"] == "n/a" and "ratio_cudnn" not in ok
        assert ok["pct_gemm"] == pytest.approx(100 * ok["tflops"] / 700.0)
        fp8 = by[(sweep, "leanfa-portable-fp8")]
        assert fp8["status"] == "ok" and "ratio_cudnn" not in fp8  # no cudnn-fp8 row here
        assert by[(sweep, "broken-bf16")]["status"] == "FAILED"
        assert "check" in by[(sweep, "broken-bf16")]["error"]
        assert by[(sweep, "never-bf16")]["status"] == "n/a"
    files = report.write_bench(str(tmp_path), {"env": {"gpu": "cpu"}, "config": cfg.to_dict(),
                                               "gemm": gemm, "rows": rows}, stem="bench-test")
    assert json.loads((tmp_path / "bench-test.json").read_text())["rows"][0]["impl"]
    assert any(f.endswith("bench-test-standard.png") for f in files)


# -------------------------------------------------------------------------------- reports


def _synthetic_rows():
    rows = []
    for causal in (True, False):
        for s in (1024, 4096, 16384):
            case = shapes.Case("standard", "d128", "gaussian", 16384 // s, s, 16, 16, 128, 128, causal)
            for impl, prec, tf in (("leanfa-hopper-fp8", "fp8", 900.0), ("cudnn-fp8", "fp8", 800.0),
                                   ("leanfa-hopper-bf16", "bf16", 560.0), ("cudnn-bf16", "bf16", 550.0)):
                rows.append({**case.to_dict(), "case": case.name, "impl": impl, "family": impl.split("-")[0],
                             "precision": prec, "variant": "kernel", "status": "ok", "tflops": tf + s / 100,
                             "time_ms": 1.0, "sm_clock_mhz": 1700.0, "power_w": 650.0,
                             "check_rel_l2": 0.03})
            rows.append({**case.to_dict(), "case": case.name, "impl": "fa3-bf16", "family": "fa3",
                         "precision": "bf16", "variant": "kernel", "status": "n/a",
                         "reason": "python module 'flash_attn_interface' not installed"})
    vcase = shapes.varlen_cases()[0]
    rows.append({**vcase.to_dict(), "case": vcase.name, "impl": "cudnn-bf16", "family": "cudnn",
                 "precision": "bf16", "variant": "kernel", "status": "FAILED", "error": "boom | bad"})
    rows.append({**vcase.to_dict(), "case": vcase.name, "impl": "leanfa-hopper-bf16", "family": "leanfa",
                 "precision": "bf16", "variant": "kernel", "status": "ok", "tflops": 400.0,
                 "time_ms": 2.0, "sm_clock_mhz": 1650.0, "power_w": 600.0})
    return rows


def test_bench_writers(tmp_path):
    rows = add_ratios(_synthetic_rows(), {"fp8": {"tflops": 1200.0}, "bf16": {"tflops": 700.0},
                                          })
    payload = {"env": {"gpu": "NVIDIA H200", "torch": "2.11", "git_commit": "abc"},
               "gemm": {"bf16": {"tflops": 700.0, "sm_clock_mhz": 1470.0, "power_w": 690.0},
                        "fp8": {"error": "RuntimeError: no fp8"}}, "rows": rows,
               "config": BenchConfig.quick().to_dict()}
    files = report.write_bench(str(tmp_path), payload)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == len(rows)
    md = (tmp_path / "bench.md").read_text()
    assert "## standard" in md and "## varlen" in md and "## Not applicable" in md
    assert "| d128 | 1024 | B16 | 16/16 | 128/128 | causal |" in md
    assert "910 (1.12x)" in md  # (900+10.24)/(800+10.24)
    assert "boom \\| bad" in md  # pipes escaped
    for sweep in ("standard", "varlen"):
        png = tmp_path / f"bench-{sweep}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(files) == 4
    # `leanfa report` re-renders them from the JSON alone (e.g. after a run cut before its plots)
    payload["kind"] = "bench"
    report.write_json(str(tmp_path / "cut.json"), payload)
    written = report.rerender(str(tmp_path / "cut.json"))
    assert sorted(os.path.basename(w) for w in written) == ["cut-standard.png", "cut-varlen.png", "cut.md"]
    assert (tmp_path / "cut.md").read_text() == md
    with pytest.raises(ValueError, match="not a leanfa result"):
        report.write_json(str(tmp_path / "other.json"), {"rows": []})
        report.rerender(str(tmp_path / "other.json"))


def test_accuracy_and_profile_writers(tmp_path):
    rows = []
    for p, base in (("gaussian", 0.054), ("llama3-8b", 0.15)):
        rows += [{"profile": p, "shape": "B1 S2048", "impl": "cudnn-fp8", "precision": "fp8", "status": "ok",
                  "rel_l2": base, "max_abs": 0.1, "worst_row_rel": 0.3, "ratio_cudnn_fp8": 1.0},
                 {"profile": p, "shape": "B1 S2048", "impl": "leanfa-portable-fp8", "precision": "fp8",
                  "status": "ok", "rel_l2": base / 3, "max_abs": 0.05, "worst_row_rel": 0.1,
                  "ratio_cudnn_fp8": 1 / 3},
                 {"profile": p, "shape": "B1 S2048", "impl": "fa3-fp8", "precision": "fp8", "status": "n/a",
                  "reason": "not installed"}]
    files = report.write_accuracy(str(tmp_path), {"env": {"gpu": "H200"}, "rows": rows})
    assert json.loads((tmp_path / "accuracy.json").read_text())["rows"][1]["ratio_cudnn_fp8"] < 1
    md = (tmp_path / "accuracy.md").read_text()
    assert "| gaussian | 5.40e-02 | 1.80e-02 |" in md
    assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG" and len(files) == 3
    kernels = profile.summarize_kernels(profile.parse_ncu_csv(WIDE_CSV))
    files = report.write_profile(str(tmp_path), {"env": {}, "impl": "cudnn-fp8", "kernels": kernels,
                                                 "dropped_metrics": ["sm__pipe_xu_cycles_active.avg"]},
                                 stem="profile-x")
    md = (tmp_path / "profile-x.md").read_text()
    assert "attn_fwd" in md and "tensor_gmma_pct" in md and "sm__pipe_xu" in md


# ------------------------------------------------------------------------------- ncu CSV

WIDE_CSV = """==PROF== Connected to process 1234
some program output
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","gpu__time_duration.sum","smsp__cycles_elapsed.avg.per_second","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","launch__registers_per_thread","launch__shared_mem_per_block_dynamic","launch__grid_size"
"","","","","","","","msecond","Ghz","%","%","register/thread","Kbyte/block",""
"0","1234","python","h","quantize_kernel(float*, int)","1","7","0.0105","1.755","0","12.5","32","0","1,024"
"1","1234","python","h","attn_fwd<128, true>(Params)","1","7","1.234","1.7","71.25","40.1","168","200.704","132"
==PROF== Disconnected from process 1234
"""

LONG_CSV = """"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","sdpa_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","2,345.5"
"0","1","python","h","sdpa_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","sm__cycles_elapsed.avg.per_second","cycle/nsecond","1.65"
"0","1","python","h","sdpa_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","sm__warps_active.avg.pct_of_peak_sustained_active","%","18.7"
"""


def test_ncu_wide_csv_with_units_row():
    kernels = profile.parse_ncu_csv(WIDE_CSV)
    assert [k["id"] for k in kernels] == [0, 1]
    assert kernels[1]["metrics"]["gpu__time_duration.sum"] == (1.234, "msecond")
    s = profile.summarize_kernels(kernels)
    attn = s[1]["metrics"]
    assert s[1]["short_name"] == "attn_fwd<128, true>"
    assert attn["duration_us"] == pytest.approx(1234.0)
    assert attn["sm_clock_mhz"] == pytest.approx(1700.0)
    assert attn["tensor_gmma_pct"] == 71.25 and attn["xu_pct"] == 40.1
    assert attn["registers"] == 168 and attn["smem_dynamic_bytes"] == pytest.approx(200704)
    assert s[0]["metrics"]["grid_size"] == 1024  # thousands separator
    assert len(profile.summarize_kernels(kernels, skip_regex="quant")) == 1


def test_ncu_long_csv():
    (k,) = profile.summarize_kernels(profile.parse_ncu_csv(LONG_CSV))
    assert k["metrics"]["duration_us"] == pytest.approx(2345.5)
    assert k["metrics"]["sm_clock_mhz"] == pytest.approx(1650.0)  # second candidate
    assert k["metrics"]["occupancy_pct"] == 18.7


def test_ncu_metric_filtering_and_command():
    names = profile.candidate_metrics()
    keep, drop = profile.accepted(names, {"gpu__time_duration", "sm__inst_executed_pipe_xu"})
    assert "launch__registers_per_thread" in keep and "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active" in keep
    assert "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active" in drop
    assert profile.accepted(names, set()) == (names, [])
    msg = "==ERROR== Failed to find metric sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active"
    assert profile.rejected_metrics(msg) == ["sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active"]
    cmd = profile.ncu_command("ncu", ["--impl", "x"], "/tmp/r", ["a.sum", "b.avg"], kernel_regex="attn",
                              launch_skip=2, launch_count=1, python="python")
    assert cmd[:3] == ["ncu", "--clock-control", "none"] and "--profile-from-start" in cmd
    assert "a.sum,b.avg" in cmd and "regex:attn" in cmd
    assert cmd[-4:] == ["-m", "leanfa.bench.profile_child", "--impl", "x"]


def test_profile_child_args_round_trip():
    from leanfa.bench.profile_child import child_args, parse

    case = shapes.Case("profile", "llama3-8b", "llama3-8b", 2, 8192, 32, 8, 128, 128, False)
    a = parse(child_args(case, "cudnn-fp8", warmup=2, seed=5))
    assert (a.impl, a.preset, a.batch, a.seqlen, a.heads, a.kv_heads, a.head_dim, a.head_dim_v) == (
        "cudnn-fp8", "llama3-8b", 2, 8192, 32, 8, 128, 128)
    assert a.no_causal and a.warmup == 2 and a.seed == 5


FAKE_NCU = '''#!{python}
import sys
args = sys.argv[1:]
if "--query-metrics" in args:
    print('"Metric Name","Metric Description","Metric Unit"')
    for n in {bases!r}:
        print('"%s","d",""' % n)
    sys.exit(0)
if "--import" in args:
    sys.stdout.write(open({csv!r}).read())
    sys.exit(0)
metrics = args[args.index("--metrics") + 1].split(",")
bad = [m for m in metrics if m.startswith("sm__pipe_xu")]
if bad:
    print("==ERROR== Failed to find metric " + bad[0])
    sys.exit(1)
open(args[args.index("-o") + 1] + ".ncu-rep", "w").write("rep")
print("==PROF== Disconnected")
'''


def test_profile_orchestration_with_fake_ncu(tmp_path, monkeypatch):
    import sys

    csv_path = tmp_path / "export.csv"
    csv_path.write_text(WIDE_CSV)
    bases = ["gpu__time_duration", "smsp__cycles_elapsed", "sm__pipe_tensor_op_gmma_cycles_active",
             "sm__pipe_xu_cycles_active", "sm__warps_active"]
    ncu = tmp_path / "ncu"
    ncu.write_text(FAKE_NCU.format(python=sys.executable, bases=bases, csv=str(csv_path)))
    ncu.chmod(0o755)
    monkeypatch.setattr(profile, "find_ncu", lambda: str(ncu))
    payload, files = profile.profile(["--impl", "x"], out_dir=str(tmp_path / "out"), stem="prof",
                                     env={"gpu": "fake"}, case_name="c", impl="x", skip_regex="quant",
                                     log=None)
    assert "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active" in payload["dropped_metrics"]
    assert "sm__inst_issued.avg.pct_of_peak_sustained_active" in payload["dropped_metrics"]  # not queried
    assert payload["metric_names"]["xu_pct"] is None and payload["metric_names"]["duration_us"]
    (k,) = payload["kernels"]
    assert k["metrics"]["tensor_gmma_pct"] == 71.25
    assert payload["kind"] == "profile"  # leanfa report can render it
    assert (tmp_path / "out" / "prof.md").exists() and len(files) == 2


@CPU_ONLY
def test_sdpa_impl_and_accuracy_rows_on_cpu():
    from leanfa.bench import impls as impls_mod
    from leanfa.bench.accuracy import accuracy_rows

    case = shapes.Case("accuracy", "llama3-8b", "llama3-8b", 1, 48, 4, 2, 128, 128, True)
    x = make_inputs(case, device="cpu", seed=3)  # model-like activations from leanfa.activations
    assert x.q.shape == (1, 48, 4, 128) and x.k.shape == (1, 48, 2, 128)
    math_sdpa = Impl("cudnn-bf16", "cudnn", "bf16", "kernel", "SDPA math (CPU stand-in)",
                     impls_mod._sdpa("MATH"), baseline=True)
    fp8_fake = Impl("cudnn-fp8", "cudnn", "fp8", "kernel", "bf16 output posing as FP8",
                    impls_mod._sdpa("MATH"))
    leanfa_fp8 = next(i for i in all_impls() if i.name == "leanfa-portable-fp8")
    rows = accuracy_rows(case, x, [math_sdpa, fp8_fake, leanfa_fp8,
                                   Impl("never", "x", "bf16", "kernel", "", _not_applicable)])
    by = {r["impl"]: r for r in rows}
    assert by["cudnn-bf16"]["status"] == "ok" and by["cudnn-bf16"]["rel_l2"] < 1e-2
    assert by["leanfa-portable-fp8"]["status"] == "ok" and by["leanfa-portable-fp8"]["rel_l2"] < 0.25
    assert by["leanfa-portable-fp8"]["ratio_cudnn_fp8"] == pytest.approx(
        by["leanfa-portable-fp8"]["rel_l2"] / by["cudnn-fp8"]["rel_l2"])
    assert by["never"]["status"] == "n/a"


# ------------------------------------------------------- GPU smoke tests (skipped on CPU)


@pytest.mark.gpu
def test_gpu_bench_smoke(tmp_path):
    """The whole pipeline on one small case: every available implementation checks and times."""
    rc = commands.main("bench", ["--sweep", "standard", "--seqlens", "1024", "--causal", "true", "--quick",
                            "--rep-ms", "20", "--warmup-ms", "10", "--no-progress", "--out", str(tmp_path),
                            "--name", "smoke", "--impl", "leanfa-portable-*,cudnn-*,sdpa-flash-bf16"])
    assert rc == 0
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    by = {(r["label"], r["impl"]): r for r in rows}
    for label in ("d128", "mla"):
        assert by[(label, "leanfa-portable-bf16")]["status"] == "ok", by[(label, "leanfa-portable-bf16")]
        assert by[(label, "cudnn-bf16")]["status"] == "ok", by[(label, "cudnn-bf16")]
        assert by[(label, "leanfa-portable-bf16")]["sm_clock_mhz"]
    failed = [(r["case"], r["impl"], r.get("error")) for r in rows if r["status"] == "FAILED"]
    assert not failed, failed


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_cudnn_fp8_matches_reference(varlen):
    """cuDNN FP8 through the frontend graph: per-tensor scales, FP8 output dequantized."""
    from leanfa.bench import cudnn_graphs

    if not cudnn_graphs.available()[0]:
        pytest.skip(cudnn_graphs.available()[1])
    if varlen:
        case = shapes.Case("varlen", "llama3-8b", "llama3-8b", 3, 1000, 8, 2, 128, 128, True, (1000, 300, 77))
    else:
        case = shapes.Case("models", "llama3-8b", "llama3-8b", 2, 1024, 8, 2, 128, 128, True)
    x = make_inputs(case, device="cuda")
    ref, q_heads, batch0 = errors.reference_subset(x, case.causal)
    for impl in select(all_impls(), ["cudnn-*"]):
        try:
            p = impl.prepare(case, x)
        except NotApplicable as e:
            if varlen:
                continue  # ragged FP8 may be unsupported; the bench reports it n/a
            raise AssertionError(f"{impl.name}: {e}")
        out = p.output(p.run())
        err = errors.error_metrics(errors.subset_of(out, q_heads, batch0), ref)["rel_l2"]
        assert err < (0.2 if impl.precision == "fp8" else 1e-2), (impl.name, err)


def test_git_tree_names_the_working_tree(tmp_path):
    """The tree hash recorded in result files equals the tree of the commit holding the same
    files, whether or not they are committed yet (a copied checkout's HEAD can be stale)."""
    import subprocess

    from leanfa.bench.env import git_tree

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    assert git_tree(str(tmp_path)) == git("rev-parse", "HEAD^{tree}")
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    dirty = git_tree(str(tmp_path))
    assert dirty != git("rev-parse", "HEAD^{tree}")
    assert git("diff", "--cached", "--name-only") == ""  # the real index was left alone
    git("add", "-A")
    git("commit", "-qm", "two")
    assert dirty == git("rev-parse", "HEAD^{tree}")


def test_fp8_check_scales_with_the_rounding_floor():
    """The FP8 check bound follows the error of per-tensor e4m3 rounding of the inputs: Gaussian
    inputs keep the fixed bound, K-outlier presets (Qwen2.5) raise it (else every FP8 row,
    cuDNN's included, was rejected on them: H200 run 6)."""
    floors = {}
    for preset in ("gaussian", "qwen2.5-7b"):
        case = shapes.Case("accuracy", preset, preset, 1, 256, 4, 2, 128, 128, True)
        x = make_inputs(case, device="cpu", seed=0)
        floors[preset] = errors.fp8_rounding_floor(x, True, errors.reference_subset(x, True)[0])
    assert 0.01 < floors["gaussian"] < 0.1  # 3 mantissa bits on Q, K, V: ~4-5e-2
    assert floors["gaussian"] * errors.FP8_FLOOR_FACTOR < errors.CHECK_TOL["fp8"]
    assert floors["qwen2.5-7b"] * errors.FP8_FLOOR_FACTOR > errors.CHECK_TOL["fp8"]


def test_accuracy_profiles_include_every_preset_with_its_heads():
    from leanfa.activations import PRESETS
    from leanfa.bench.accuracy import list_profiles, profile_case

    assert list_profiles() == list(PRESETS)
    for name in ("llama3-8b-massive", "qwen2.5-7b-massive", "llama3-8b-heads"):
        c = profile_case(name, batch=1, seqlen=64, causal=True)
        p = PRESETS[name]
        assert (c.heads, c.kv_heads, c.head_dim, c.head_dim_v, c.preset) == (
            p.heads, p.kv_heads, p.head_dim_qk, p.head_dim_v, name)
