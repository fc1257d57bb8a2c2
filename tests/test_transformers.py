"""Hugging Face transformers integration: a tiny random Llama (GQA 4/2 heads, head_dim 64,
2 layers) gives the same logits with attn_implementation "leanfa"/"leanfa_fp8"/"leanfa_fp8qk" as "eager"
(no padding) and "sdpa" (padded batches, which run leanfa's varlen kernel)."""

import inspect
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


# transformers 5.x renames forward's past_key_values to cache
CACHE_KW = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def calls(monkeypatch):
    """Count the calls that reach leanfa's kernels (not the SDPA fallback)."""
    class Seen(list):
        varlen: list  # per call: whether it was a packed (unpadded) call

    seen = Seen()
    seen.varlen = []
    real = leanfa.attention

    def spy(*args, **kwargs):
        seen.append(kwargs["precision"])
        seen.varlen.append(kwargs.get("cu_seqlens_q") is not None)
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
    assert calls.varlen == [False, False]  # the dense kernel, no unpadding


def _padded_batch(seed):
    """Three sequences of lengths 14, 9 and 5 in a (3, 14) batch: full, left-padded, right-padded."""
    ids = torch.randint(1, 100, (3, 14), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, 5:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("impl", ["leanfa", "leanfa_fp8", "leanfa_fp8qk"])
def test_padded_batch_runs_varlen_and_matches_sdpa(model, impl, calls, device):
    ids, mask = _padded_batch(3)
    ref = _logits(model, "sdpa", ids, mask, device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="leanfa attention")  # no SDPA fallback
        got = _logits(model, impl, ids, mask, device=device)
    assert calls == [lt.NAMES[impl]] * 2  # both layers ran leanfa
    assert calls.varlen == [True, True]
    keep = mask.bool()
    err = _rel(got[keep], ref[keep])
    assert err < TOL[impl], f"{impl}: relative L2 error {err:.2e} at the kept positions"
    assert err > 0  # really leanfa, not SDPA
    if impl == "leanfa":
        # the right-padded row alone (same positions, no padding: the dense kernel) gives the same logits
        alone = _logits(model, "leanfa", ids[2:, :5], device=device)
        assert _rel(got[2, :5], alone[0]) < 1e-4


def _continued_on_a_cache(model, impl, device, ids, mask, more, mask2, warns=None):
    """The logits of ``more`` (mask ``mask2``) after a prefill of ``ids`` (mask ``mask``) into a KV cache, with the
    ``impl`` attention; ``warns``: the warning the continuation must raise."""
    model.set_attn_implementation(impl)
    m = model.to(device)
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        m(ids.to(device), attention_mask=mask.to(device), **{CACHE_KW: cache}, use_cache=True)
        with pytest.warns(UserWarning, match=warns) if warns else warnings.catch_warnings():
            return m(more.to(device), attention_mask=mask2.to(device), **{CACHE_KW: cache}, use_cache=True).logits.cpu()


def test_padded_prefill_on_a_kv_cache_matches_sdpa(model, calls, device):
    """A prompt continued on a KV cache (q_len 4 < kv_len 18) with left and right padding: the kept
    queries are the mask's last columns, causal bottom-right per sequence (a top-left mask fails this)."""
    ids, mask = _padded_batch(4)
    more = torch.randint(1, 100, (3, 4), generator=torch.Generator().manual_seed(5))
    mask2 = torch.cat((mask, torch.ones(3, 4, dtype=torch.long)), 1)
    mask2[2, 14:16] = 0  # the right-padded row keeps padding in the new chunk too
    logits = {impl: _continued_on_a_cache(model, impl, device, ids, mask, more, mask2) for impl in ("sdpa", "leanfa")}
    assert calls == ["bf16"] * 4 and calls.varlen == [True] * 4
    keep = mask2[:, -4:].bool()
    err = _rel(logits["leanfa"][keep], logits["sdpa"][keep])
    assert err < TOL["leanfa"], f"relative L2 error {err:.2e}"


def test_padded_decoding_step_falls_back_to_sdpa_with_one_warning(model, calls, device, monkeypatch):
    monkeypatch.setattr(lt, "_warned_fallback", False)
    ids, mask = _padded_batch(6)
    step = torch.randint(1, 100, (3, 1), generator=torch.Generator().manual_seed(7))
    mask2 = torch.cat((mask, torch.ones(3, 1, dtype=torch.long)), 1)
    logits = {impl: _continued_on_a_cache(model, impl, device, ids, mask, step, mask2,
                                          warns="decoding step" if impl == "leanfa" else None)
              for impl in ("sdpa", "leanfa")}
    assert calls == ["bf16"] * 2  # the prefill ran leanfa, the decoding step SDPA
    assert _rel(logits["leanfa"], logits["sdpa"]) < TOL["leanfa"]


@pytest.mark.parametrize("where", ["left", "right", "middle", "none", "empty_row"])
def test_unpad_mask_and_pad_output(where):
    """unpad_mask's lengths, cu_seqlens and indices against a loop over the mask; pad_output inverts the
    gather with zeros at padded positions."""
    g = torch.Generator().manual_seed(8)
    mask = torch.ones(3, 9, dtype=torch.long)
    if where == "left":
        mask[0, :3] = 0; mask[2, :8] = 0  # noqa: E702
    elif where == "right":
        mask[1, 4:] = 0; mask[2, 1:] = 0  # noqa: E702
    elif where == "middle":
        mask[0, 2:5] = 0; mask[1, ::2] = 0  # noqa: E702
    elif where == "empty_row":
        mask[1] = 0
    for q_len in (9, 4, 1):
        u = lt.unpad_mask(mask, q_len)
        want_k = [b * 9 + j for b in range(3) for j in range(9) if mask[b, j]]
        want_q = [b * q_len + j - (9 - q_len) for b in range(3) for j in range(9 - q_len, 9) if mask[b, j]]
        assert u.indices_k.tolist() == want_k and u.indices_q.tolist() == want_q
        lens_k = mask.sum(1).tolist()
        lens_q = mask[:, 9 - q_len:].sum(1).tolist()
        assert u.cu_seqlens_k.tolist() == [0, *torch.tensor(lens_k).cumsum(0).tolist()]
        assert u.cu_seqlens_q.tolist() == [0, *torch.tensor(lens_q).cumsum(0).tolist()]
        assert u.cu_seqlens_q.dtype == u.cu_seqlens_k.dtype == torch.int32
        assert (u.max_seqlen_q, u.max_seqlen_k) == (max(lens_q), max(lens_k))
        x = torch.randn(3, 2, q_len, 5, generator=g)  # transformers' (B, H, S, D)
        packed = lt._gather(x, u.indices_q, q_len)
        assert packed.shape == (len(want_q), 2, 5)
        back = lt.pad_output(packed, u.indices_q, 3, q_len)
        keep = mask[:, 9 - q_len:].bool()
        assert torch.equal(back[keep], x.transpose(1, 2)[keep])
        assert torch.equal(back[~keep], torch.zeros_like(back[~keep]))


def test_unpad_is_cached_per_mask_object(monkeypatch):
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    monkeypatch.setattr(lt, "_cache", None)
    a = lt._unpad_cached(mask, 6)
    assert lt._unpad_cached(mask, 6) is a  # the other layers of the forward: no new sync
    assert lt._unpad_cached(mask, 3) is not a
    same_values = mask.clone()
    assert lt._unpad_cached(same_values, 6) is not a  # another mask object
    same_values[1, 0] = 0  # changed in place: recomputed
    b = lt._unpad_cached(same_values, 6)
    same_values[1, 1] = 0
    assert lt._unpad_cached(same_values, 6).cu_seqlens_k.tolist() == [0, 4, 8] != b.cu_seqlens_k.tolist()


def test_unpad_of_an_inference_mode_mask_is_not_cached(monkeypatch):
    """A mask made under torch.inference_mode has no version counter (an in-place edit could not be told): it is
    unpadded anew each time, and gives the same answer."""
    monkeypatch.setattr(lt, "_cache", None)
    with torch.inference_mode():
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[0, :2] = 0
        a = lt._unpad_cached(mask, 6)
        b = lt._unpad_cached(mask, 6)
        assert a is not b and a.cu_seqlens_k.tolist() == b.cu_seqlens_k.tolist() == [0, 4, 10]
        mask[1, 0] = 0
        assert lt._unpad_cached(mask, 6).cu_seqlens_k.tolist() == [0, 4, 9]


def test_4d_mask_falls_back_to_sdpa(monkeypatch, calls):
    monkeypatch.setattr(lt, "_warned_fallback", False)
    fn = lt.ATTENTION_FUNCTIONS["leanfa"]
    module = torch.nn.Module().eval()
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, h, 6, 64, generator=g) for h in (4, 2, 2))
    mask4 = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    module.num_key_value_groups = 2
    with pytest.warns(UserWarning, match="4-D"):
        out, _ = fn(module, q, k, v, mask4, is_causal=True)
    assert calls == [] and out.shape == (1, 6, 4, 64)


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


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["leanfa", "leanfa_fp8"])
def test_padded_layers_after_the_first_do_not_sync(impl):
    """One host sync per padded forward: the first layer's unpad_mask; a later layer's call (same mask
    object, cached) gathers, attends and re-pads without one."""
    fn = lt.ATTENTION_FUNCTIONS[impl]
    module = torch.nn.Module().eval()
    g = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = (torch.randn(2, h, 300, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
    mask = torch.ones(2, 300, dtype=torch.long, device="cuda")
    mask[0, :120] = 0
    fn(module, q, k, v, mask, is_causal=True)  # first layer: syncs once (and warms up the kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = fn(module, q, k, v, mask, is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out[0, :120], torch.zeros_like(out[0, :120])) and out[0, 120:].abs().sum() > 0


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@pytest.mark.parametrize("impl", ["leanfa", "leanfa_fp8"])
def test_sliding_window_and_softcap_models_match_eager(family, impl, calls, device):
    """Mistral's sliding window and Gemma-2's logit soft-capping (with its alternating local/global layers) reach
    leanfa's kernels as window_size and softcap and give eager's logits; the window (8 keys) is shorter than the
    prompt, so a call that dropped it would be far off."""
    if family == "mistral":
        cfg = transformers.MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                         num_hidden_layers=2, vocab_size=100, intermediate_size=128, sliding_window=8)
        cls = transformers.MistralForCausalLM
    else:
        cfg = transformers.Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                        num_hidden_layers=2, vocab_size=100, intermediate_size=128, sliding_window=8,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                        query_pre_attn_scalar=64)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    m = cls(cfg).eval()
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = _logits(m, "eager", ids, device=device)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="leanfa attention")  # no SDPA fallback
        got = _logits(m, impl, ids, device=device)
    assert calls == [lt.NAMES[impl]] * 2
    err = _rel(got, ref)
    assert 0 < err < TOL[impl], f"{family} {impl}: relative L2 error {err:.2e}"


def test_padded_decoding_with_a_sliding_window_is_refused():
    """The SDPA fallback of padded decoding steps has no window or softcap: such a call raises instead of
    attending every key."""
    fn = lt.ATTENTION_FUNCTIONS["leanfa"]
    module = torch.nn.Module().eval()
    q, kv = torch.zeros(2, 4, 1, 64), torch.zeros(2, 2, 9, 64)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 0] = 0
    with pytest.raises(NotImplementedError, match="sliding_window"):
        fn(module, q, kv, kv, mask, sliding_window=4)
