"""``leanfa accuracy --model`` (leanfa/bench/model_accuracy.py): a tiny random Llama (2 layers, hidden 64, 4/2 heads
of 64) prefills 160 tokens with every attention implementation under the interpreter (on a GPU: the kernels); the
table's rows, their errors against the SDPA model, the levers reaching leanfa.attention, the model's Q/K statistics,
the FA3 FP8 attention function's plumbing (a stand-in FA3 module), and the errors for bad options."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanfa  # noqa: E402
from leanfa import cli  # noqa: E402
from leanfa.bench import fa3, model_accuracy as ma  # noqa: E402
from leanfa.bench.report import rerender  # noqa: E402

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
        "--intermediate", "128", "--vocab", "256"]
SEQLEN = 160  # past the 128 BF16 sink keys of leanfa_fp8_sink128, so some keys are FP8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``leanfa accuracy --model`` on the tiny model with every row; the leanfa.attention calls it made."""
    out = tmp_path_factory.mktemp("model-accuracy")
    calls = []
    real = leanfa.attention

    def spy(*args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k not in ("causal", "softmax_scale")})
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(leanfa, "attention", spy)
        rc = cli.main(["accuracy", "--model", "--seqlens", str(SEQLEN), "--reps", "1", "--out", str(out), *TINY])
    payload = json.loads((out / "model-accuracy.json").read_text())
    return rc, payload, calls, out


def _rows(payload):
    return {r["impl"]: r for r in payload["rows"]}


def test_every_row_is_in_the_table(run):
    rc, payload, _, out = run
    assert rc == 0
    assert payload["kind"] == "model-accuracy" and payload["seqlens"] == [SEQLEN]
    rows = _rows(payload)
    assert list(rows) == list(ma.ROW_NAMES)
    for name, r in rows.items():
        want = ("ok", "n/a") if name == "fa3_fp8" else ("ok",)
        assert r["status"] in want, r
    if not torch.cuda.is_available():
        assert rows["fa3_fp8"]["status"] == "n/a" and "GPU" in rows["fa3_fp8"]["reason"]
    md = (out / "model-accuracy.md").read_text()
    for name in ma.ROW_NAMES:
        assert f"| {SEQLEN} | {name} |" in md
    assert rerender(str(out / "model-accuracy.json")) == [str(out / "model-accuracy.md")]


def test_errors_are_finite_positive_and_ordered(run):
    rows = _rows(run[1])
    assert rows["sdpa"]["rel_l2_vs_sdpa_bf16"] == 0.0  # the reference itself
    assert "rel_l2_vs_sdpa_bf16" not in rows["identity"]  # not an attention: no error reported
    measured = [n for n, r in rows.items() if r["status"] == "ok" and n not in ("sdpa", "identity")]
    assert len(measured) >= 6
    for name in measured:
        for key in ("rel_l2_vs_sdpa_bf16", "rel_l2_vs_sdpa_fp32"):
            e = rows[name][key]
            assert math.isfinite(e) and 0 < e < 1, (name, key, e)
    # the BF16 model's own error against float32 is finite and positive, and BF16 leanfa is near it
    floor = rows["sdpa"]["rel_l2_vs_sdpa_fp32"]
    assert 0 < floor < 0.1
    assert rows["leanfa"]["rel_l2_vs_sdpa_fp32"] < 2 * floor
    for fp8 in ("leanfa_fp8", "leanfa_fp8qk", "leanfa_fp8_no_smooth_k", "leanfa_fp8_rotate"):
        assert rows["leanfa"]["rel_l2_vs_sdpa_bf16"] < rows[fp8]["rel_l2_vs_sdpa_bf16"] / 2, fp8
    # the massive Q/K pair is a K bias: without K smoothing FP8 loses much more (measured ~4x here)
    assert rows["leanfa_fp8_no_smooth_k"]["rel_l2_vs_sdpa_bf16"] > 1.5 * rows["leanfa_fp8"]["rel_l2_vs_sdpa_bf16"]


def test_times_only_on_a_gpu(run):
    rows = _rows(run[1])
    for name, r in rows.items():
        if r["status"] != "ok":
            continue
        if torch.cuda.is_available():
            assert r["prefill_ms"] > 0 and 0 <= r["attention_share"] < 1, r
        else:
            assert "prefill_ms" not in r and "attention_share" not in r and r["cpu_wall_s"] > 0
    if torch.cuda.is_available():
        assert rows["identity"]["attention_share"] < rows["sdpa"]["attention_share"]


def test_each_row_reaches_leanfa_with_its_levers(run):
    calls = run[2]
    # per row, 2 layers x (warm-up + reps on a GPU) + 1 error forward; the sdpa, fa3 and identity rows never call
    per_row = 2 * (1 + (2 if torch.cuda.is_available() else 0))
    want = [{"precision": "bf16"}, {"precision": "fp8"}, {"precision": "fp8qk"},
            {"precision": "fp8", "smooth_k": False}, {"precision": "fp8", "rotate": True},
            {"precision": "fp8", "rotate": "auto"}, {"precision": "fp8", "bf16_sink_keys": 128},
            {"precision": "fp8qk", "rotate": True}]
    assert calls == [w for w in want for _ in range(per_row)]


def test_model_has_the_presets_qk_statistics():
    """Per KV head, K's largest constant is the massive pair, in the slow RoPE pairs, of ~massive x k_std; the
    token std of Q and K in the first layer is the target; the same seed gives the same model."""
    spec = ma.ModelSpec.tiny()
    model = ma.build_model(spec, device="cpu", seed=3)
    seen = {}
    attn = model.model.layers[0].self_attn
    for n in ("q_proj", "k_proj"):
        getattr(attn, n).register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.float()[0]))
    ids = torch.randint(0, spec.vocab, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.model(ids)
    q = seen["q_proj"].view(256, spec.heads, spec.head_dim)
    k = seen["k_proj"].view(256, spec.kv_heads, spec.head_dim)
    assert q.std(0).median().item() == pytest.approx(0.75, rel=0.15)  # q_std with the massive pair
    assert k.std(0).median().item() == pytest.approx(1.3, rel=0.15)
    half = spec.head_dim // 2
    k_mean = k.mean(0)  # (kv_heads, head_dim)
    for h in range(spec.kv_heads):
        top = k_mean[h].abs().topk(2).indices.sort().values.tolist()
        assert top[1] == top[0] + half and 0.625 * half - 1 <= top[0] < 0.9375 * half, top  # one RoPE pair
        mag = k_mean[h, top].norm().item()
        assert mag == pytest.approx(spec.massive * spec.k_std, rel=0.2)
    again = ma.build_model(spec, device="cpu", seed=3)
    other = ma.build_model(spec, device="cpu", seed=4)
    w = model.model.layers[1].self_attn.k_proj.bias
    assert torch.equal(again.model.layers[1].self_attn.k_proj.bias, w)
    assert not torch.equal(other.model.layers[1].self_attn.k_proj.bias, w)


def test_calibration_sets_every_layers_token_std():
    """Past the first layer the random model's hidden states share a common component (token std below its RMS):
    _calibrate rescales each layer's Q/K/V so that on its sequence the median token std is the target."""
    spec = ma.ModelSpec.tiny(layers=3)
    model = ma.build_model(spec, device="cpu", seed=1).float()
    ids = torch.randint(0, spec.vocab, (1, 256), generator=torch.Generator().manual_seed(5))
    seen = {}
    for i, layer in enumerate(model.model.layers):
        for n in ("q_proj", "k_proj", "v_proj"):
            getattr(layer.self_attn, n).register_forward_hook(
                lambda m, inp, o, key=(i, n): seen.__setitem__(key, (o - m.bias)[0].std(0).median().item()))
    targets = {"q_proj": 0.75, "k_proj": 1.3, "v_proj": 1.0}
    with torch.no_grad():
        model.model(ids)
        before = dict(seen)
        ma._calibrate(model, spec, ids)
        model.model(ids)
    for (i, n), std in seen.items():
        assert std == pytest.approx(targets[n], rel=1e-3), (i, n, std)
    # built, it was calibrated on another sequence: past the first layer not exact on this one
    assert any(abs(before[(i, n)] / targets[n] - 1) > 0.02 for i in (1, 2) for n in targets)


def test_fp32_reference_attention_is_causal_sdpa():
    """The float32 reference's attention (K/V repeated; on CUDA the memory-efficient kernel, else blocks of
    queries on the math backend) equals transformers' SDPA attention in float64."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 70, 64, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    ref, _ = sdpa_attention_forward(module, q.double(), k.double(), v.double(), None, scaling=0.1)
    got, _ = ma.fp32_reference_attention(module, q, k, v, None, scaling=0.1)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-6
    rep = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    blocks = ma.causal_attention_in_blocks(q, *rep, 0.1, block=16).transpose(1, 2)
    assert ((blocks.double() - ref).norm() / ref.norm()).item() < 1e-6
    with pytest.raises(NotImplementedError, match="unpadded"):
        ma.fp32_reference_attention(module, q, k, v, torch.ones(1, 70))


class _FakeFA3:
    """Stands in for FA3's module: dequantizes the e4m3 inputs with the (batch, kv_heads) descales and runs
    float32 SDPA, so fa3_fp8_attention's layout and scales are checked without FA3."""

    __name__ = "fake_fa3"

    @staticmethod
    def flash_attn_func(q, k, v, causal, softmax_scale, q_descale, k_descale, v_descale):
        hk, group = k.shape[2], q.shape[2] // k.shape[2]
        dq = q_descale.repeat_interleave(group, 1)[:, None, :, None]
        dk, dv = (d[:, None, :, None] for d in (k_descale, v_descale))
        q, k, v = (t.float() * d for t, d in ((q, dq), (k, dk), (v, dv)))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale,
            enable_gqa=True)
        return out.transpose(1, 2).to(torch.bfloat16), None


def test_fa3_fp8_attention_function(monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(fa3, "module", lambda: _FakeFA3)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 48, 64, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    k[:, 1] += 3  # a K bias on the second KV head: its own scale
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    got, _ = ma.fa3_fp8_attention(module, q, k, v, None, scaling=0.125)
    ref, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), None, scaling=0.125)
    assert got.shape == ref.shape == (2, 48, 4, 64)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.1, err
    with pytest.raises(NotImplementedError, match="unpadded"):
        ma.fa3_fp8_attention(module, q, k, v, torch.ones(2, 48))


@pytest.mark.parametrize("args, message", [
    (["--model", "--seqlen", "100"], "--seqlen: not an option of --model (use --seqlens)"),
    (["--model", "--profiles", "gaussian"], "--profiles: not an option of --model"),
    (["--model", "--precision", "fp8"], "--precision: not an option of --model"),
    (["--layers", "3"], "--layers: only with --model"),
    (["--seqlens", "8k"], "--seqlens: only with --model"),
    (["--model", "--impl", "leanfa,nope*"], "--impl nope*: no such model row"),
    (["--model", "--heads", "5", "--kv-heads", "2"], "--heads 5 is not a multiple of --kv-heads 2"),
    (["--model", "--head-dim", "63"], "--head-dim must be even"),
    (["--model", "--layers", "0"], "--layers must be at least 1"),
    (["--model", "--massive", "-1"], "--massive must be >= 0"),
    (["--model", "--seqlens", "0"], "--seqlens must be positive"),
    (["--model", "--reps", "0"], "--reps must be at least 1"),
])
def test_bad_options_are_refused_naming_the_option(args, message, capsys, tmp_path):
    assert cli.main(["accuracy", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_list_names_every_row(capsys):
    assert cli.main(["accuracy", "--model", "--list"]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[0] for ln in out.strip().splitlines()] == list(ma.ROW_NAMES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path of the command")
def test_command_runs_under_the_interpreter_by_itself(tmp_path):
    """From a shell without TRITON_INTERPRET (the command sets it before Triton loads), on the CPU defaults."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "leanfa.cli", "accuracy", "--model", "--seqlens", "64", "--impl",
                        "leanfa", "--no-fp32-ref", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on CPU (Triton interpreter" in r.stdout and "| 64 | leanfa | - |" in r.stdout
    rows = json.loads((tmp_path / "model-accuracy.json").read_text())["rows"]
    assert [r["impl"] for r in rows] == ["sdpa", "leanfa"] and 0 < rows[1]["rel_l2_vs_sdpa_bf16"] < 0.05
    assert "rel_l2_vs_sdpa_fp32" not in rows[1]
