"""Hugging Face transformers integration: a tiny random Llama (GQA 4/2 heads, head_dim 64,
2 layers) gives the same logits with attn_implementation "leanfa"/"leanfa_fp8" as "eager"."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import leanfa  # noqa: E402
import leanfa.integrations.transformers as lt  # noqa: E402

# relative L2 error of the logits vs eager attention (float32 model): bf16 attention rounds
# Q/K/V/P to 8 mantissa bits (measured ~3.5e-3), FP8 e4m3 to 4 (measured ~3e-2)
TOL = {"leanfa": 1.5e-2, "leanfa_fp8": 8e-2, "leanfa_fp8qk": 8e-2}


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   num_hidden_layers=2, vocab_size=100, intermediate_size=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _logits(model, impl, ids, mask=None, device="cpu"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.to(device)(ids.to(device), attention_mask=None if mask is None else mask.to(device)).logits.cpu()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def calls(monkeypatch):
    """Count the calls that reach leanfa's kernels (not the SDPA fallback)."""
    seen = []
    real = leanfa.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["precision"])
        return real(*args, **kwargs)

    monkeypatch.setattr(leanfa, "attention", spy)
    return seen


@pytest.mark.parametrize("impl", ["leanfa", "leanfa_fp8", "leanfa_fp8qk"])
def test_logits_match_eager(model, impl, calls, device):
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, "eager", ids, device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="leanfa attention")  # no SDPA fallback
        got = _logits(model, impl, ids, device=device)
    assert calls == [lt.NAMES[impl]] * 2  # both layers ran leanfa, in the chosen precision
    err = _rel(got, ref)
    assert err < TOL[impl], f"{impl}: relative L2 error {err:.2e}"
    assert err > 0  # really a different attention than eager


def test_all_ones_mask_stays_on_leanfa(model, calls, device):
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    ref = _logits(model, "eager", ids, device=device)
    got = _logits(model, "leanfa", ids, torch.ones(2, 12, dtype=torch.long), device=device)
    assert len(calls) == 2 and _rel(got, ref) < TOL["leanfa"]


def test_padding_falls_back_to_sdpa_with_one_warning(model, calls, device, monkeypatch):
    monkeypatch.setattr(lt, "_warned_fallback", False)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    ref = _logits(model, "eager", ids, mask, device=device)
    with pytest.warns(UserWarning, match="falling back to SDPA") as rec:
        got = _logits(model, "leanfa", ids, mask, device=device)
    assert len([w for w in rec if "falling back" in str(w.message)]) == 1  # once, not per layer
    assert calls == []
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], rtol=1e-4, atol=1e-4)


def test_registered_names():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in ("leanfa", "leanfa_fp8", "leanfa_fp8qk"):
        assert name in AttentionInterface._global_mapping
        assert name in AttentionMaskInterface._global_mapping


def test_dropout_in_training_rejected():
    fn = lt.ATTENTION_FUNCTIONS["leanfa"]
    module = torch.nn.Module().train()
    q = torch.zeros(1, 4, 8, 64)
    with pytest.raises(NotImplementedError, match="dropout"):
        fn(module, q, q[:, :2], q[:, :2], None, dropout=0.1)
