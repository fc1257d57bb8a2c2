"""``leanfa accuracy --model``: the model-level measurement. A Llama-shaped transformers model, built from a
config with random weights (fixed seed, no download), prefills one sequence with each attention implementation;
per implementation: the prefill time, attention's share of it, and the relative L2 error of the logits against
the same model with transformers' SDPA attention in BF16 (and in float32).

**The model** (:class:`ModelSpec`, :func:`build_model`): ``LlamaForCausalLM`` in BF16 with ``attention_bias=True``;
weights drawn with the config's ``initializer_range`` (0.02: embeddings, o_proj, the MLP, lm_head), except Q/K/V,
whose projections are drawn so that on RMS-normalized hidden states (unit RMS) every Q/K/V channel has the token
std of the activation presets (:mod:`leanfa.activations`: ``q_std``, ``k_std``, ``v_std``; an element of
``W x`` has std ``w_std * sqrt(hidden)``) and then rescaled, layer after layer, so that the median token std on a
random calibration sequence is that target (:func:`_calibrate`: past the first layer the random model's hidden
states share a large common component, which leaves ~0.6x the token std otherwise), and whose biases carry the
presets' constants: K gets a per-channel bias of std ``k_bias`` (times ``k_std``), and with ``massive > 0`` each
KV head gets a *massive Q/K pair* as the ``*-massive`` presets describe (Llama-3-8B's measured numbers): one
slow RoPE pair (pair index in [0.625, 0.9375) of the pairs) where K's bias has magnitude ``massive * k_std``
and the group's query heads' bias ``massive * q_std`` (+-10 % per head) at ``acos(massive_cos)`` from K's
direction. As in the presets, Q's token
std is 0.75 with the massive pair and 1.5 without. RoPE then rotates these constants with position (slowly: they
are in slow pairs), as in a real model. V and o_proj biases are zero. What the random model lacks: attention
sinks (no token is special), outlier-channel structure beyond the biases, heavy-tailed V, learned long-range
structure; its attention is diffuse except where the massive pair's distance term peaks.

**The rows** (:data:`ROWS`): ``sdpa`` (transformers' SDPA attention: the BF16 reference model), ``leanfa``
(BF16), ``leanfa_fp8``, ``leanfa_fp8qk`` (the registered names of :mod:`leanfa.integrations.transformers`), the
FP8 levers of :func:`leanfa.attention` registered here under names of their own (``smooth_k=False``,
``rotate=True``, ``rotate="auto"``, ``bf16_sink_keys=128``), ``fa3_fp8`` (FlashAttention-3 FP8 with one scale per (sequence, KV head),
:func:`leanfa.bench.fa3.quantize_per_kv_head`; "n/a" where FA3 is not importable) and ``identity`` (attention
replaced by passing Q through: the rest of the model's time; no error is reported for it).

**Timing** (CUDA only; on a CPU the kernels run under Triton's interpreter and no time is given): per row and
length, one warm-up forward (kernel compilation), then ``reps`` prefill forwards (``model(ids,
logits_to_keep=1)``, as generation's prefill), each timed with CUDA events around the whole forward; the
attention time of a forward is the sum of CUDA-event times around each attention call (the registered
attention function, quantization included), recorded inside the attention function. Medians over the reps are
reported, and ``attention_share = attention_ms / prefill_ms``. Cross-check: ``prefill_minus_identity_ms`` is a
row's prefill time minus the identity row's (attention's cost by subtraction).

**Errors**: one more forward gives the final hidden states; the logits (``lm_head``, in BF16, as the model
returns them) are computed in chunks of positions and compared with the reference model's over all positions
(relative L2 ``||x - ref|| / ||ref||``): against the BF16 SDPA model, and against the float32 SDPA model
(the same BF16 weights in float32, TF32 off; its attention: :func:`fp32_reference_attention`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import math
import statistics
import time
import warnings
from typing import Callable

import torch

#: the lever rows: (precision, leanfa.attention levers) (names registered with transformers by :func:`register_rows`)
LEVERS = {
    "leanfa_fp8_no_smooth_k": ("fp8", dict(smooth_k=False)),
    "leanfa_fp8_rotate": ("fp8", dict(rotate=True)),
    "leanfa_fp8_auto": ("fp8", dict(rotate="auto")),
    "leanfa_fp8_sink128": ("fp8", dict(bf16_sink_keys=128)),
    "leanfa_fp8qk_rotate": ("fp8qk", dict(rotate=True)),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One implementation: ``name`` (the table's), its precision and what it is."""

    name: str
    precision: str
    description: str


ROWS = (
    Row("sdpa", "bf16", "transformers' SDPA attention, BF16: the reference model"),
    Row("leanfa", "bf16", 'attn_implementation="leanfa"'),
    Row("leanfa_fp8", "fp8", 'attn_implementation="leanfa_fp8" (the default FP8 scheme)'),
    Row("leanfa_fp8qk", "fp8qk", 'attn_implementation="leanfa_fp8qk" (FP8 Q.K, BF16 P.V)'),
    Row("leanfa_fp8_no_smooth_k", "fp8", "leanfa FP8, smooth_k=False (no K smoothing)"),
    Row("leanfa_fp8_rotate", "fp8", "leanfa FP8, rotate=True (Hadamard rotation of Q and K)"),
    Row("leanfa_fp8_auto", "fp8", 'leanfa FP8, rotate="auto" (rotation of the KV heads whose Q and K share channels)'),
    Row("leanfa_fp8_sink128", "fp8", "leanfa FP8, bf16_sink_keys=128 (first 128 keys in BF16)"),
    Row("leanfa_fp8qk_rotate", "fp8qk", "leanfa fp8qk (FP8 Q.K, BF16 P.V), rotate=True"),
    Row("fa3_fp8", "fp8", "FlashAttention-3 FP8, one scale per (sequence, KV head), quantized in torch"),
    Row("identity", "-", "attention replaced by passing Q through: the rest of the model"),
)
ROW_NAMES = tuple(r.name for r in ROWS)
REFERENCE = "sdpa"
BENCH_PREFIX = "leanfa_bench_"  # transformers names of the wrapped (timed) attention functions


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The Llama-shaped model: shape, RoPE, and the Q/K/V statistics injected through the weights."""

    layers: int = 4
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    initializer_range: float = 0.02
    massive: float = 14.0  #: the massive pair's magnitude in units of the token std (0: none)
    massive_cos: float = -0.40  #: cosine between Q's and K's constants in the pair
    k_bias: float = 0.5 / 1.3  #: std over channels of K's bias, in units of k_std (the presets' 0.5 / 1.3)
    k_std: float = 1.3
    v_std: float = 1.0
    q_std: float | None = None  #: None: 0.75 with the massive pair, 1.5 without (the presets)

    @property
    def q_token_std(self) -> float:
        return self.q_std if self.q_std is not None else (0.75 if self.massive else 1.5)

    def check(self) -> None:
        """ValueError naming the option for a shape the model cannot have."""
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"--head-dim must be even (RoPE pairs), got {self.head_dim}")
        if self.massive < 0 or not math.isfinite(self.massive):
            raise ValueError(f"--massive must be >= 0 (0: no massive Q/K pair), got {self.massive}")
        if not -1.0 <= self.massive_cos <= 1.0:
            raise ValueError(f"massive_cos must be in [-1, 1], got {self.massive_cos}")

    @classmethod
    def tiny(cls, **kw) -> "ModelSpec":
        """The CPU (Triton interpreter) default: 2 layers, hidden 64, 4/2 heads of 64 (the smallest head dim
        leanfa's kernels take), vocab 256."""
        return cls(**{**dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=64, intermediate=128, vocab=256), **kw})


def llama_config(spec: ModelSpec):
    """The transformers ``LlamaConfig`` of ``spec`` (``attention_bias=True``: the Q/K constants live there)."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=spec.hidden, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, num_hidden_layers=spec.layers, intermediate_size=spec.intermediate,
        vocab_size=spec.vocab, rope_theta=spec.rope_theta, initializer_range=spec.initializer_range,
        attention_bias=True, max_position_embeddings=1 << 20, tie_word_embeddings=False)


@torch.no_grad()
def _qkv_weights(spec: ModelSpec, attn, g: torch.Generator) -> None:
    """Draw one layer's Q/K/V projections and biases (module docstring) with ``g`` (a CPU generator)."""
    h, hk, d = spec.heads, spec.kv_heads, spec.head_dim
    root = math.sqrt(spec.hidden)
    qs, ks = spec.q_token_std, spec.k_std
    for proj, std in ((attn.q_proj, qs), (attn.k_proj, ks), (attn.v_proj, spec.v_std)):
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=g).mul_(std / root))
        proj.bias.zero_()
    attn.o_proj.bias.zero_()
    k_bias = torch.randn(hk, d, generator=g) * (spec.k_bias * ks)
    q_bias = torch.zeros(h, d)
    if spec.massive:
        half = d // 2
        lo, hi = int(round(0.625 * half)), int(round(0.9375 * half))
        pair = torch.randint(lo, max(lo + 1, hi), (hk,), generator=g)
        ch = torch.stack((pair, pair + half), -1)  # rotate-half layout: channels i and i + d/2 rotate together
        phi = 2 * math.pi * torch.rand(hk, generator=g)
        side = torch.randint(0, 2, (hk,), generator=g) * 2 - 1
        psi = phi + side * math.acos(spec.massive_cos)
        group = h // hk
        mag_q = spec.massive * qs * (1 + 0.1 * torch.randn(h, generator=g))
        k_bias[torch.arange(hk)[:, None], ch] = spec.massive * ks * torch.stack((phi.cos(), phi.sin()), -1)
        q_dir = torch.stack((psi.cos(), psi.sin()), -1).repeat_interleave(group, 0)
        q_bias[torch.arange(h)[:, None], ch.repeat_interleave(group, 0)] = mag_q[:, None] * q_dir
    attn.q_proj.bias.copy_(q_bias.flatten())
    attn.k_proj.bias.copy_(k_bias.flatten())


@torch.no_grad()
def _calibrate(model, spec: ModelSpec, ids: torch.Tensor) -> None:
    """Rescale each layer's Q/K/V projection weights, first layer first, so that on ``ids`` the median over
    channels of the token std of ``W x`` is the target (``q_std``, ``k_std``, ``v_std``). Needed past the first
    layer: the random layers' hidden states share a large common component, which RMS normalization keeps, so
    the token-varying part of ``x`` is smaller than its RMS (about 0.6x here without this)."""
    model.set_attn_implementation("sdpa")
    targets = (("q_proj", spec.q_token_std), ("k_proj", spec.k_std), ("v_proj", spec.v_std))
    for layer in model.model.layers:
        attn, seen = layer.self_attn, {}
        hooks = [getattr(attn, n).register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o - m.bias))
                 for n, _ in targets]
        try:
            model.model(ids)
        finally:
            for h in hooks:
                h.remove()
        for n, target in targets:
            std = seen[n].reshape(-1, seen[n].shape[-1]).float().std(0).median().item()
            getattr(attn, n).weight.mul_(target / std)


#: tokens of the calibration sequence of :func:`build_model`
CALIBRATION_TOKENS = 512


def build_model(spec: ModelSpec, *, device="cuda", seed: int = 0, dtype=torch.bfloat16):
    """The random ``LlamaForCausalLM`` of ``spec`` on ``device`` in ``dtype``, in eval mode; the same weights for
    the same ``(spec, seed)`` (the Q/K/V draws come from a seeded CPU generator, the rest from ``torch``'s seed
    on ``device``). Built in float32, its Q/K/V projections calibrated on a random sequence of
    :data:`CALIBRATION_TOKENS` tokens (:func:`_calibrate`), then cast to ``dtype``."""
    import transformers

    spec.check()
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(llama_config(spec)).eval()
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        _qkv_weights(spec, layer.self_attn, g)
    calib = torch.randint(0, spec.vocab, (1, CALIBRATION_TOKENS), generator=g).to(device)
    _calibrate(model, spec, calib)
    return model.to(dtype)


# ------------------------------------------------------------------------------------------------ attention rows


class TimedAttention:
    """A transformers attention function that records CUDA events around each call of ``fn`` while
    :attr:`pairs` is a list (:meth:`start`), and just calls ``fn`` otherwise."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.pairs: list | None = None

    def start(self) -> None:
        self.pairs = []

    def stop_ms(self) -> float:
        """The summed event time of the calls since :meth:`start` (synchronizes)."""
        pairs, self.pairs = self.pairs or [], None
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in pairs)

    def __call__(self, *args, **kwargs):
        if self.pairs is None:
            return self.fn(*args, **kwargs)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = self.fn(*args, **kwargs)
        e.record()
        self.pairs.append((s, e))
        return out


def identity_attention(module, query, key, value, attention_mask, **kwargs):
    """No attention: Q passed through as the output ``(batch, seq, heads, head_dim)`` (the timing baseline)."""
    return query.transpose(1, 2), None


def fa3_fp8_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """FlashAttention-3 FP8 as a transformers attention function: Q/K/V quantized to e4m3 with one scale per
    (sequence, KV head) (:func:`leanfa.bench.fa3.quantize_per_kv_head`, in torch: its time is counted as
    attention's), then FA3's ``flash_attn_func``. Unpadded calls only (``NotImplementedError`` for a mask)."""
    from . import fa3

    if attention_mask is not None:
        raise NotImplementedError("the fa3_fp8 row runs unpadded prefill only (attention_mask given)")
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    kv_heads = k.shape[2]
    # contiguous (B, S, H, D) e4m3, the layout the bench's FA3 rows pass
    (q8, dq), (k8, dk), (v8, dv) = ((t8.contiguous(), d) for t8, d in
                                    (fa3.quantize_per_kv_head(t, kv_heads) for t in (q, k, v)))
    out = fa3.output_of(fa3.module().flash_attn_func(q8, k8, v8, causal=is_causal, softmax_scale=scaling,
                                                     q_descale=dq, k_descale=dk, v_descale=dv))
    return out.to(query.dtype), None


def fp32_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The float32 reference model's attention: causal SDPA with K/V repeated to the query heads. On CUDA the
    memory-efficient kernel is required (float32 accumulation, no ``S x S`` scores: SDPA's GQA path would take
    the math backend for float32, whose scores do not fit at 32K); where it refuses, the math backend runs on
    blocks of 1024 queries. Unpadded calls only."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if attention_mask is not None:
        raise NotImplementedError("the float32 reference runs unpadded prefill only (attention_mask given)")
    group = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (key, value))
    if not query.is_cuda:
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
        return out.transpose(1, 2), None
    try:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
    except RuntimeError:
        out = causal_attention_in_blocks(query, k, v, scaling)
    return out.transpose(1, 2), None


def causal_attention_in_blocks(q, k, v, scale=None, block: int = 1024):
    """Causal SDPA (bottom-right aligned) on SDPA's math backend, ``block`` queries at a time: ``(B, H, S, D)``
    in and out, K/V with as many heads as Q; scores ``block x S_k`` per head at a time."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q_len, kv_len = q.shape[2], k.shape[2]
    parts = []
    for i in range(0, q_len, block):
        rows = torch.arange(i, min(i + block, q_len), device=q.device)[:, None] + (kv_len - q_len)
        keep = torch.arange(kv_len, device=q.device)[None, :] <= rows
        with sdpa_kernel(SDPBackend.MATH):
            parts.append(F.scaled_dot_product_attention(q[:, :, i:i + block], k, v, attn_mask=keep, scale=scale))
    return torch.cat(parts, dim=2)


def _row_function(name: str) -> tuple[Callable, Callable]:
    """(attention function, mask function) of row ``name``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import flash_attention_mask, sdpa_mask

    import leanfa.integrations.transformers as lt

    if name == "sdpa":
        return sdpa_attention_forward, sdpa_mask
    if name in lt.ATTENTION_FUNCTIONS:
        return lt.ATTENTION_FUNCTIONS[name], flash_attention_mask
    if name in LEVERS:
        precision, levers = LEVERS[name]
        return lt.attention_function(precision, **levers), flash_attention_mask
    if name == "fa3_fp8":
        return fa3_fp8_attention, flash_attention_mask
    if name == "identity":
        return identity_attention, flash_attention_mask
    if name == "sdpa_fp32":
        return fp32_reference_attention, flash_attention_mask
    raise ValueError(f"unknown model row {name!r}; choose from {', '.join(ROW_NAMES)}")


def register_rows(names) -> dict[str, TimedAttention]:
    """Register each row's attention function, wrapped in a :class:`TimedAttention`, with transformers under
    ``BENCH_PREFIX + name`` (and its mask function); returns the wrappers by row name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    timed = {}
    for name in names:
        fn, mask_fn = _row_function(name)
        timed[name] = TimedAttention(fn)
        AttentionInterface.register(BENCH_PREFIX + name, timed[name])
        AttentionMaskInterface.register(BENCH_PREFIX + name, mask_fn)
    return timed


def select_rows(patterns: list[str] | None) -> list[str]:
    """Row names matching ``patterns`` (names or globs; None: all), in :data:`ROWS` order, the reference
    (``sdpa``) always first. ValueError for a pattern that matches nothing."""
    if not patterns:
        return list(ROW_NAMES)
    bad = [p for p in patterns if not fnmatch.filter(ROW_NAMES, p)]
    if bad:
        raise ValueError(f"--impl {','.join(bad)}: no such model row; choose from {', '.join(ROW_NAMES)}")
    chosen = {n for p in patterns for n in fnmatch.filter(ROW_NAMES, p)} | {REFERENCE}
    return [n for n in ROW_NAMES if n in chosen]


def row_available(name: str) -> tuple[bool, str]:
    if name == "fa3_fp8":
        from . import fa3

        if not torch.cuda.is_available():
            return False, "FlashAttention-3 needs a CUDA GPU"
        return fa3.available()
    return True, ""


# ------------------------------------------------------------------------------------------------ measurement


def _chunk_rows(vocab: int) -> int:
    return max(1, (1 << 26) // vocab)  # 64M logits per chunk (256 MB in float32)


@torch.no_grad()
def logits_errors(hidden: torch.Tensor, lm_head, refs: dict) -> dict[str, float]:
    """Relative L2 of ``lm_head(hidden)`` against each reference ``(ref_hidden, ref_lm_head)`` of ``refs``
    (by name), over all positions, the logits computed chunk by chunk (never all at once)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    step = _chunk_rows(lm_head.weight.shape[0])
    sums = {name: [0.0, 0.0] for name in refs}
    for i in range(0, h.shape[0], step):
        got = lm_head(h[i:i + step]).double()
        for name, (ref_h, ref_head) in refs.items():
            ref = ref_head(ref_h.reshape(-1, ref_h.shape[-1])[i:i + step]).double()
            sums[name][0] += (got - ref).pow(2).sum().item()
            sums[name][1] += ref.pow(2).sum().item()
    return {name: math.sqrt(num) / math.sqrt(den) if den else float("nan") for name, (num, den) in sums.items()}


@contextlib.contextmanager
def _fp32_matmuls():
    """float32 matmuls and convolutions without TF32 (restored afterwards)."""
    old = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cudnn.allow_tf32 = old[1]


def _time_prefill(model, ids, timer: TimedAttention, reps: int) -> tuple[float, float]:
    """(median prefill ms, median attention ms) of ``reps`` forwards after one warm-up forward."""
    model(ids, logits_to_keep=1)
    prefill, attention = [], []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        timer.start()
        s.record()
        model(ids, logits_to_keep=1)
        e.record()
        attention.append(timer.stop_ms())
        prefill.append(s.elapsed_time(e))
    return statistics.median(prefill), statistics.median(attention)


def _error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


@torch.no_grad()
def run_model_accuracy(spec: ModelSpec, seqlens: list[int], rows: list[str] | None = None, *, device="cuda",
                       seed: int = 0, reps: int = 3, fp32_reference: bool = True, log=print) -> list[dict]:
    """The rows of every implementation in ``rows`` (default: all; the reference ``sdpa`` always runs, first)
    at every length of ``seqlens`` (one sequence each); see the module docstring. Times only on CUDA."""
    if not seqlens or any(s < 1 for s in seqlens):
        raise ValueError(f"--seqlens must be positive token counts, got {seqlens}")
    if reps < 1:
        raise ValueError(f"--reps must be at least 1, got {reps}")
    spec.check()
    names = select_rows(rows)
    cuda = torch.device(device).type == "cuda"
    timed = register_rows(names + ["sdpa_fp32"])
    model = build_model(spec, device=device, seed=seed)
    ref32 = None
    if fp32_reference:
        ref32 = copy.deepcopy(model).float()  # the same (BF16-rounded) weights in float32
        ref32.set_attn_implementation(BENCH_PREFIX + "sdpa_fp32")
    out: list[dict] = []
    for seqlen in seqlens:
        ids = torch.randint(0, spec.vocab, (1, seqlen), generator=torch.Generator().manual_seed(seed + seqlen))
        ids = ids.to(device)
        refs = {}
        if ref32 is not None:
            with _fp32_matmuls():
                refs["fp32"] = (ref32.model(ids).last_hidden_state, ref32.lm_head)
        new = []
        for name in names:
            row = {"seqlen": seqlen, "impl": name, "precision": next(r.precision for r in ROWS if r.name == name),
                   "attn_implementation": name if name in ("sdpa", "leanfa", "leanfa_fp8", "leanfa_fp8qk") else
                   BENCH_PREFIX + name, "status": None}
            if name in LEVERS:
                row["levers"] = LEVERS[name][1]
            if name == "fa3_fp8":
                row["note"] = "its Q/K/V quantization runs in torch (unfused) and counts as attention time"
            ok, why = row_available(name)
            if not ok:
                row.update(status="n/a", reason=why[:500])
                new.append(row)
                continue
            model.set_attn_implementation(BENCH_PREFIX + name)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if cuda:
                        row["prefill_ms"], row["attention_ms"] = _time_prefill(model, ids, timed[name], reps)
                        row["attention_share"] = row["attention_ms"] / row["prefill_ms"]
                    start = time.perf_counter()
                    hidden = model.model(ids).last_hidden_state
                    if cuda:
                        torch.cuda.synchronize()
                    else:
                        row["cpu_wall_s"] = time.perf_counter() - start
                    if name == REFERENCE:
                        refs = {"sdpa_bf16": (hidden, model.lm_head), **refs}
                    if name != "identity":
                        with _fp32_matmuls():  # the float32 reference's lm_head
                            errs = logits_errors(hidden, model.lm_head, refs)
                        row["rel_l2_vs_sdpa_bf16"] = errs["sdpa_bf16"]
                        if "fp32" in errs:
                            row["rel_l2_vs_sdpa_fp32"] = errs["fp32"]
                    del hidden
                # leanfa's own (e.g. a call routed to a slower kernel); not numpy's under the interpreter
                notes = sorted({str(w.message).splitlines()[0][:200] for w in caught
                                if issubclass(w.category, UserWarning)})
                if notes:
                    row["warnings"] = notes
                row["status"] = "ok"
            except NotImplementedError as e:
                row.update(status="n/a", reason=_error_text(e))
            except Exception as e:
                row.update(status="FAILED", error=_error_text(e))
                if name == REFERENCE:
                    raise RuntimeError(f"the reference row (sdpa) failed at S={seqlen}: {_error_text(e)}") from e
            new.append(row)
        base = next((r for r in new if r["impl"] == "identity" and r["status"] == "ok"), None)
        if base and "prefill_ms" in base:
            for r in new:
                if r["status"] == "ok" and r["impl"] != "identity":
                    r["prefill_minus_identity_ms"] = r["prefill_ms"] - base["prefill_ms"]
        del refs
        if log:
            for r in new:
                log(_log_line(r))
        out += new
    return out


def _log_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"S={r['seqlen']:<7} {r['impl']:<24} {r['status']}: {r.get('reason') or r.get('error', '')}"
    t = f"{r['prefill_ms']:9.2f} ms, attention {r['attention_share']:6.1%}" if "prefill_ms" in r else "(no GPU times)"
    e = r.get("rel_l2_vs_sdpa_bf16")
    return f"S={r['seqlen']:<7} {r['impl']:<24} {t}   logits rel L2 vs SDPA BF16 " + (f"{e:.3e}" if e is not None
                                                                                           else "-")
