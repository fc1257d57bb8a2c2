"""Model-like Q/K/V for benchmarks and accuracy tests, and capture of real ones.

Attention kernels, FP8 ones above all, are stressed by features of real activations that
Gaussian test data lacks. :func:`make_qkv` generates them synthetically for named model
shapes; :func:`capture` records the real post-RoPE Q/K/V of any Hugging Face causal LM.

Generation model (per head, before RoPE; ``z`` are fresh N(0, 1) draws per element)::

    q = q_scale * s_h * z + q_bias                (s_h: per-head temperature)
    k = k_scale * z + k_bias  (+ a * u on sink tokens)
    v = v_scale * c * t_df                        (c: per-channel scale, t_df: Student-t row)

then RoPE (rotate-half convention, as HF Llama) on the trailing ``rope_dims`` channels of Q
and K, with positions ``0..Sk-1`` for K and the last ``Sq`` of them for Q (flash-attn's
bottom-right alignment when ``Sq < Sk``). The features:

* **K bias and outlier channels** -- ``k_bias`` is a per-channel constant (std
  ``k_bias_scale``) plus ``n_outlier_channels`` channels of magnitude ``outlier_scale``,
  placed in *slow* channels: the non-RoPE channels and the lowest-frequency eighth of the
  RoPE pairs, which barely rotate, so they stay large and near-constant after RoPE. A
  constant in a non-rotating K channel shifts all scores of a query equally: it leaves the
  attention output alone and only widens the range a quantizer must cover (in rotating
  channels it turns into a slowly varying function of distance).
* **Attention sinks** -- the first ``sink_tokens`` keys get ``a * u`` added, ``u`` a unit
  vector over 8 no-RoPE channels (else the 4 slowest RoPE pairs) and ``a = sink_scale *
  (typical key norm)``, and every query's bias gets a component along the ``u`` of its KV
  head (its own component there replaced), so that an average query scores a sink
  ``sink_logit`` logits above an ordinary key (queries' token noise along ``u`` is damped to
  ``SINK_Q_NOISE`` of its std). Sink values are multiplied by ``sink_v_scale`` (real sinks
  carry near-zero values).
* **Heavy-tailed V** -- each (token, head) row is multivariate Student-t with ``v_tail_df``
  degrees of freedom (normals divided by one ``sqrt(chi2 / df)`` per row): every element is
  Student-t and some tokens have a large V norm. Per-channel scales ``exp(0.3 N(0, 1))``.
* **Peaky softmax** -- scores ``q.k / sqrt(Dqk)`` of ordinary keys have a per-row std of about
  ``sqrt((q_scale^2 + q_bias_scale^2)) * k_scale`` logits (times the per-head temperature
  ``s_h = exp(q_head_spread N(0, 1))``), so a few keys dominate, and the sink takes a large
  share of the mass on most rows. Calibrated for the default softmax scale ``Dqk**-0.5``.
* **MLA** (``shared_rope_k``) -- the RoPE part of K is one vector shared by all heads, as
  DeepSeek's ``k_pe``; the outlier channels are then among the no-RoPE channels.

Presets (``PRESETS``; fields documented on :class:`Profile`). The magnitudes follow
published observations qualitatively; they are not fitted to a checkpoint (use
:func:`capture` for the real thing)::

    name            heads kv  Dqk Dv  rope theta (dims)  outliers k_bias sink (scale, logit) V df
    gaussian         16   16  128 128 none               -        0      -                   normal
    llama3-8b        32    8  128 128 500000 (128)       4 x 8    0.5    1 token (4, 10)     5
    mistral-7b       32    8  128 128 10000 (128)        4 x 6    0.5    1 token (4, 10)     5
    qwen2.5-7b       28    4  128 128 1000000 (128)      6 x 40   1.0    1 token (3, 11)     4
    deepseek-v3-mla 128  128  192 128 10000 (64 of 192)  4 x 6    0.5    1 token (4, 10)     5
    llama3-8b-massive, mistral-7b-massive, qwen2.5-7b-massive: the base model's row plus a
        massive Q/K pair per KV head (below); llama3-8b-heads: llama3-8b with per-head factors

All but ``gaussian`` share q_scale 1.5, k_scale 1.3, q_bias_scale 0.5, sink_v_scale 0.05,
q_head_spread 0.25, v_scale 1; ``gaussian`` has q/k/v scales 1 and everything else off.
At 2K tokens their ordinary-key scores have a per-row std of 1-3 logits, and the sink takes
a median 0-0.95 of a row's attention depending on the head (less at longer contexts).

``mistral-7b`` is Mistral-7B
v0.1 (theta 10000; v0.2/v0.3 use 1e6 like Qwen): its fast-rotating RoPE makes the outlier
channels and the sink fade at long distances, a regime the other presets lack; its 4096-token
sliding window is not modelled (the generator only makes Q/K/V). ``deepseek-v3-mla`` is MLA
prefill with the latent expanded: 128 KV heads, Q/K = 128 no-RoPE + 64 RoPE channels
(trailing), V 128; its real softmax scale includes a YaRN factor, the preset assumes
``192**-0.5``.

Massive Q/K pairs (``massive_qk``; presets ``*-massive``). Published observation: Jin et al.
2025, "Massive Values in Self-Attention Modules are the Key to Contextual Knowledge
Understanding" (arXiv 2502.01563, Fig. 1 and the appendix heat maps) find large values
concentrated in a few low-frequency RoPE dimensions of Q and K, not of V, in Llama-2/3, Qwen2.5
and Mistral. Sun et al. 2024, "Massive Activations in Large Language Models" (arXiv
2402.17762) find the related hidden-state activations (Llama-2-7B dims 1415 and 2533, on the
first token and the first "." or newline), near-constant across inputs, acting as biases that
make attention sinks; they give hidden-state values, not per-channel Q/K numbers. The numbers
used here were computed by this project (not quoted from a paper) from the layer-10
post-RoPE Q/K tensors that Jin et al.'s public repository (MingyuJ666/Rope_with_LLM,
``saved_attn_scores/``) ships: Llama-2-7b-chat (66 tokens, 32 heads) and
Llama-3-8B-Instruct (45 tokens, 32/8 heads), BOS token left out:

* 78 % of heads (both models) have Q's and K's largest mean pair in the *same* RoPE pair,
  pair index 41-55 of 64 (slow half; not the slowest four);
* that pair's mean vector is 11.1 (Q) / 10.9 (K) times the mean per-channel token std on
  Llama-2 and 14.3 / 13.5 on Llama-3, and holds 40-48 % of the energy of Q's and K's means;
* cosine between Q's and K's mean vectors in the pair: median -0.44 (Llama-2), -0.40
  (Llama-3), range -1.0 to 0.1; their score contribution is -2.8 / -2.9 logits (median);
* token std in the pair / the mean's magnitude: 0.15-0.21 (Llama-2), 0.09-0.12 (Llama-3);
* resulting top channel RMS / mean channel RMS per head (median): Q 8.4, K 8.7 (Llama-2),
  Q 8.0, K 8.7 (Llama-3); at most 3 channels per head exceed 5x the mean.

For Qwen2.5-7B and Mistral-7B only the appendix heat maps were found (layer 10, the L2 norm
over the sequence of 64 plotted dims per head, colour scale 0-70): the largest dim over the
head's mean, median over heads, is Q 3.7 / K 3.1 for Qwen2.5 and Q 4.7 / K 3.4 for Mistral
(Llama-3 in the same plots: 4.1 / 3.4), argmax in the slowest quarter of dims in 25 / 28
(Qwen, Q) and 30 / 32 (Mistral, Q) heads; Qwen's Q map saturates the scale in 42 cells, so its
ratios are lower bounds. No per-channel Q/K magnitude for these two was found, so
``qwen2.5-7b-massive`` uses the Llama-3 numbers and ``mistral-7b-massive`` the Llama-2 ones
(Mistral-7B v0.1 shares Llama-2's theta 10000); both say so here rather than invent values.

The model: per KV head one pair drawn from pair indices ``massive_pairs`` (default
[0.625, 0.9375) of the pairs: 40-59 of 64) gets a constant of magnitude ``massive_qk * k_scale``
in K (random direction in the pair, replacing the K bias there) and ``massive_qk * q_scale``
(+-10 % per query head) in the group's queries at the angle ``acos(massive_cos)`` from K's;
token noise in the pair is ``massive_jitter`` times the magnitude. Presets (on top of the base
model preset): ``llama3-8b-massive`` 14 / -0.40 / 0.10, ``mistral-7b-massive`` 11 / -0.44 /
0.18, ``qwen2.5-7b-massive`` 14 / -0.40 / 0.10 (with Qwen's K outliers of 40, which stay K's
largest channels), each with ``q_scale`` 0.75 instead of 1.5: the pair's constant times K's
token noise adds score variance (as in the real tensors, where it is about twice the
noise-noise part), and halving Q keeps ordinary-key scores at a per-row std of ~2 logits, as the
base presets (generated at S=1024, 8 heads: top-channel/mean RMS Q 7.2 / K 7.6 llama3, Q 7.8 /
K 7.9 mistral). What is not modelled: the real sink key has a *small* norm (0.2x the median key
norm in both tensors) and wins by the negative constant score of the others; the presets keep
the base presets' large-norm sink key.

Per-head variety (``head_temperature``; preset ``llama3-8b-heads``): the whole query of head
``i`` (noise and bias, so the sink's advantage too) is multiplied by
``head_temperature[i % len]``; llama3-8b with factors (0.05, 0.5, 1, 4): at 512 tokens the
normalized attention entropy of the heads is ~1.0 / 0.84 / 0.3 / 0.02 (diffuse to near
one-hot, the latter mostly on the sink). The Llama-3-8B-Instruct layer-10 tensors above show
the same spread: normalized entropy 0.03-0.55 and sink share 0.52-0.99 across heads.

Reproducibility: values depend only on (profile, shapes, seed), never on the device or the
thread count. They are drawn on the CPU in float32 by blocks of ``BLOCK`` rows, each block
with its own ``torch.Generator`` seeded from (seed, tensor, batch, block), blocks in parallel
threads, then cast to ``dtype`` and moved to ``device``. Rows are prefix-stable: a longer
``seqlen`` extends a shorter one. Throughput is about 70M elements/s per core: llama3-8b at
16K tokens (100M elements) takes ~1.5 core-seconds, deepseek-v3-mla at 16K tokens (1.07G
elements, 2 GiB in BF16) ~15, i.e. a second or two on a 16-core host.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

__all__ = [
    "BLOCK",
    "PRESETS",
    "Profile",
    "apply_rope",
    "capture",
    "list_presets",
    "load_captured",
    "make_qkv",
]

#: rows (tokens) per random-number block; blocks are drawn independently and in parallel
BLOCK = 512
#: std of a query's token noise along its sink direction, relative to its other channels
SINK_Q_NOISE = 0.1
#: name under which :func:`capture` registers its attention function with transformers
CAPTURE_IMPL = "leanfa_capture"
#: ``format`` value of the metadata of capture files
CAPTURE_FORMAT = "leanfa-capture-v1"


@dataclass(frozen=True)
class Profile:
    """Statistics of one model's attention inputs; see the module docstring for the model."""

    name: str
    heads: int  #: query heads
    kv_heads: int  #: key/value heads (GQA: ``heads % kv_heads == 0``)
    head_dim_qk: int = 128  #: channels of Q and K
    head_dim_v: int = 128  #: channels of V
    rope_theta: float = 10000.0  #: RoPE base
    rope_dims: int = 128  #: trailing Q/K channels that RoPE rotates (0: none)
    q_scale: float = 1.0  #: std of Q's token-dependent part
    k_scale: float = 1.0  #: std of K's token-dependent part
    q_bias_scale: float = 0.0  #: std over channels of Q's per-channel constant
    k_bias_scale: float = 0.0  #: std over channels of K's per-channel constant
    n_outlier_channels: int = 0  #: K channels per KV head with a large constant (slow channels)
    outlier_scale: float = 0.0  #: magnitude of those constants (random sign, +-10 %)
    sink_tokens: int = 0  #: leading attention-sink tokens
    sink_scale: float = 0.0  #: a sink key's extra norm, in units of a typical key's norm
    sink_logit: float = 0.0  #: mean score advantage (logits) of a sink key over an ordinary one
    sink_v_scale: float = 1.0  #: factor on the values of sink tokens
    v_scale: float = 1.0  #: scale of V
    v_tail_df: float | None = None  #: Student-t degrees of freedom of V (None: Gaussian)
    q_head_spread: float = 0.0  #: std of log per-head Q temperature (heads differ in peakiness)
    shared_rope_k: bool = False  #: MLA: K's RoPE channels are shared by all heads
    #: massive Q/K pair: magnitude of Q's and K's constant in one slow RoPE pair per KV head, in
    #: units of ``q_scale`` / ``k_scale`` (0: none); see "Massive Q/K pairs" in the module docstring
    massive_qk: float = 0.0
    massive_cos: float = 0.0  #: cosine between Q's and K's constant vectors in that pair
    massive_jitter: float = 0.0  #: token std in that pair, relative to the constant's magnitude
    #: range of pair indices (fractions of the RoPE pairs) the massive pair is drawn from; the
    #: default [0.625, 0.9375) keeps it off the 4 slowest pairs, the sink's direction
    massive_pairs: tuple[float, float] = (0.625, 0.9375)
    #: per-query-head factors on the whole query (bias included), cycled over the heads
    #: (``()``: all 1); large factors make near-one-hot heads, small ones diffuse heads
    head_temperature: tuple[float, ...] = ()
    seed: int = 0  #: default seed

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if not 0 <= self.rope_dims <= self.head_dim_qk or self.rope_dims % 2:
            raise ValueError(f"rope_dims must be even, in [0, head_dim_qk]: {self.rope_dims}")
        if self.massive_qk and (not self.rope_dims or self.shared_rope_k):
            raise ValueError("massive_qk needs RoPE channels that are not shared (no MLA)")
        if any(t <= 0 for t in self.head_temperature):
            raise ValueError(f"head_temperature must be positive: {self.head_temperature}")


_MODEL_LIKE = dict(
    q_scale=1.5, k_scale=1.3, q_bias_scale=0.5, k_bias_scale=0.5, n_outlier_channels=4,
    outlier_scale=8.0, sink_tokens=1, sink_scale=4.0, sink_logit=10.0, sink_v_scale=0.05,
    v_tail_df=5.0, q_head_spread=0.25,
)

#: the massive pair measured on Llama-3-8B-Instruct's layer-10 Q/K (module docstring)
_MASSIVE_LLAMA3 = dict(massive_qk=14.0, massive_cos=-0.40, massive_jitter=0.10, q_scale=0.75)
#: the same measured on Llama-2-7B-chat (theta 10000, like Mistral-7B v0.1)
_MASSIVE_LLAMA2 = dict(massive_qk=11.0, massive_cos=-0.44, massive_jitter=0.18, q_scale=0.75)
#: per-head factors of ``llama3-8b-heads``: a quarter each of diffuse, mild, model-like and
#: near-one-hot heads (cycled; with 8 query heads: two of each)
HEAD_TEMPERATURES = (0.05, 0.5, 1.0, 4.0)

PRESETS: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("gaussian", 16, 16, rope_dims=0),
        Profile("llama3-8b", 32, 8, rope_theta=500000.0, **_MODEL_LIKE),
        Profile("mistral-7b", 32, 8, rope_theta=10000.0, **{**_MODEL_LIKE, "outlier_scale": 6.0}),
        Profile(
            "qwen2.5-7b", 28, 4, rope_theta=1000000.0,
            **{**_MODEL_LIKE, "k_bias_scale": 1.0, "n_outlier_channels": 6, "outlier_scale": 40.0,
               "sink_scale": 3.0, "sink_logit": 11.0, "v_tail_df": 4.0},
        ),
        Profile(
            "deepseek-v3-mla", 128, 128, head_dim_qk=192, head_dim_v=128, rope_theta=10000.0,
            rope_dims=64, shared_rope_k=True, **{**_MODEL_LIKE, "outlier_scale": 6.0},
        ),
        # massive Q/K pairs and per-head variety: see the module docstring for the sources
        Profile("llama3-8b-massive", 32, 8, rope_theta=500000.0,
                **{**_MODEL_LIKE, **_MASSIVE_LLAMA3}),
        Profile("mistral-7b-massive", 32, 8, rope_theta=10000.0,
                **{**_MODEL_LIKE, "outlier_scale": 6.0, **_MASSIVE_LLAMA2}),
        Profile(
            "qwen2.5-7b-massive", 28, 4, rope_theta=1000000.0,
            **{**_MODEL_LIKE, "k_bias_scale": 1.0, "n_outlier_channels": 6, "outlier_scale": 40.0,
               "sink_scale": 3.0, "sink_logit": 11.0, "v_tail_df": 4.0, **_MASSIVE_LLAMA3},
        ),
        Profile("llama3-8b-heads", 32, 8, rope_theta=500000.0,
                **{**_MODEL_LIKE, "head_temperature": HEAD_TEMPERATURES}),
    )
}


def list_presets() -> list[str]:
    """Names of the built-in presets."""
    return list(PRESETS)


# ----------------------------------------------------------------------------------- RoPE


def rope_inv_freq(rope_dims: int, theta: float) -> torch.Tensor:
    """Angular frequency of each RoPE pair, ``theta ** (-2i / rope_dims)`` (float64)."""
    return theta ** (-torch.arange(0, rope_dims, 2, dtype=torch.float64) / rope_dims)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rope_dims: int | None = None
) -> torch.Tensor:
    """Rotate the trailing ``rope_dims`` channels of ``x`` (``(..., S, H, D)``) as HF Llama does.

    Rotate-half convention: pair ``i`` is channels ``(i, i + rope_dims/2)`` of the RoPE part,
    turned by ``positions[s] * theta ** (-2i / rope_dims)``. Leading channels are unchanged.
    Returns a new tensor of ``x``'s dtype; the arithmetic is float32 (angles float64).
    """
    r = x.shape[-1] if rope_dims is None else rope_dims
    y = x.to(torch.float32, copy=True)
    if r:
        _rope_(y, positions, theta, r)
    return y.to(x.dtype)


def _slow_pairs(d: int, r: int, n: int) -> torch.Tensor:
    """Both channels of the ``n`` slowest RoPE pairs of a ``d``-channel head rotating ``r``."""
    pairs = torch.arange(r // 2 - 1, r // 2 - 1 - n, -1)
    return torch.cat((d - r + pairs, d - r // 2 + pairs))


def _slow_channels(p: Profile) -> torch.Tensor:
    """Channels that (almost) do not rotate: the no-RoPE ones and the slowest eighth of pairs."""
    d, r = p.head_dim_qk, p.rope_dims
    slow = [torch.arange(d - r)]
    if r:
        slow.append(_slow_pairs(d, r, max(1, r // 16)))
    return torch.cat(slow)


# ----------------------------------------------------------------------------- generation


def _seed(*tags) -> int:
    """A 63-bit seed hashed from ``tags`` (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(repr(tags).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generator(*tags) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*tags))


@dataclass
class _Params:
    """Per-head constants of one (profile, heads, seed), all float32 on the CPU."""

    q_bias: torch.Tensor  # (H, Dqk), includes the sink alignment
    head_scale: torch.Tensor  # (H, 1)
    u_q: torch.Tensor | None  # (H, Dqk) sink direction of each query head's KV head
    sink_ch: torch.Tensor | None  # channels where the sink directions are non-zero
    k_bias: torch.Tensor  # (Hk, Dqk)
    sink_k: torch.Tensor | None  # (Hk, Dqk), added to sink keys
    v_chan: torch.Tensor  # (Hk, Dv)
    massive_ch: torch.Tensor | None = None  # (Hk, 2) channels of each KV head's massive pair
    q_noise: torch.Tensor | None = None  # (H, Dqk) factor on Q's token noise (massive pair)
    k_noise: torch.Tensor | None = None  # (Hk, Dqk) factor on K's token noise (massive pair)


def _make_params(p: Profile, seed: int) -> _Params:
    """Draw the per-head constants (biases, outliers, sink directions, scales) of ``p``."""
    g = _generator(seed, p.name, "params", p.heads, p.kv_heads)
    h, hk, d, r = p.heads, p.kv_heads, p.head_dim_qk, p.rope_dims
    group = h // hk
    q_bias = p.q_bias_scale * torch.randn(h, d, generator=g)
    head_scale = torch.exp(p.q_head_spread * torch.randn(h, 1, generator=g))
    k_bias = p.k_bias_scale * torch.randn(hk, d, generator=g)
    if p.shared_rope_k and r:
        k_bias[:, d - r :] = k_bias[:1, d - r :]
    slow = _slow_channels(p)
    if p.shared_rope_k:  # per-head outliers cannot sit in the shared RoPE part
        slow = slow[slow < d - r]
    if p.n_outlier_channels:
        for j in range(hk):
            ch = slow[torch.randperm(len(slow), generator=g)[: p.n_outlier_channels]]
            sign = torch.randint(0, 2, (len(ch),), generator=g) * 2 - 1
            k_bias[j, ch] += p.outlier_scale * sign * (1 + 0.1 * torch.randn(len(ch), generator=g))
    u_q = sink_k = sink_ch = None
    if p.sink_tokens:
        # sink direction: 8 no-RoPE channels if there are some, else the 4 slowest RoPE pairs
        sink_ch = torch.arange(min(8, d - r)) if d > r else _slow_pairs(d, r, min(4, r // 2))
        u = torch.zeros(hk, d)
        u[:, sink_ch] = torch.randn(hk, len(sink_ch), generator=g).abs() + 0.5
        u[:, sink_ch] *= torch.randint(0, 2, (hk, len(sink_ch)), generator=g) * 2 - 1
        u /= u.norm(dim=-1, keepdim=True)
        typical = math.sqrt(
            d * (p.k_scale**2 + p.k_bias_scale**2) + p.n_outlier_channels * p.outlier_scale**2
        )
        a = p.sink_scale * typical
        sink_k = a * u
        u_q = u.repeat_interleave(group, dim=0)
        q_bias = q_bias - (q_bias * u_q).sum(-1, keepdim=True) * u_q  # exact sink alignment
        q_bias = q_bias + (p.sink_logit * math.sqrt(d) / a) * u_q
    v_chan = torch.ones(hk, p.head_dim_v)
    if p.v_tail_df:
        v_chan = torch.exp(0.3 * torch.randn(hk, p.head_dim_v, generator=g))
    prm = _Params(q_bias, head_scale, u_q, sink_ch, k_bias, sink_k, v_chan)
    if p.massive_qk:  # own generator: the draws above (the older presets' values) are unchanged
        _add_massive_pairs(p, prm, _generator(seed, p.name, "massive", p.heads, p.kv_heads))
    if p.head_temperature:
        t = torch.tensor([p.head_temperature[i % len(p.head_temperature)] for i in range(h)])
        prm.q_bias = prm.q_bias * t[:, None]
        prm.head_scale = prm.head_scale * t[:, None]
    return prm


def massive_pair_channels(p: Profile, pair: torch.Tensor) -> torch.Tensor:
    """Both channels ``(i, i + r/2)`` of RoPE pair ``pair`` (rotate-half layout), ``(..., 2)``."""
    d, r = p.head_dim_qk, p.rope_dims
    return torch.stack((d - r + pair, d - r // 2 + pair), -1)


def _add_massive_pairs(p: Profile, prm: _Params, g: torch.Generator) -> None:
    """Add each KV head's massive pair to the biases of K and its query heads (see docstring)."""
    h, hk, d, r = p.heads, p.kv_heads, p.head_dim_qk, p.rope_dims
    group = h // hk
    lo, hi = (int(round(f * r / 2)) for f in p.massive_pairs)
    pair = torch.randint(lo, max(lo + 1, hi), (hk,), generator=g)
    ch = massive_pair_channels(p, pair)  # (Hk, 2)
    phi = 2 * math.pi * torch.rand(hk, generator=g)  # direction of K's constant in the pair
    turn = math.acos(max(-1.0, min(1.0, p.massive_cos)))
    side = torch.randint(0, 2, (hk,), generator=g) * 2 - 1
    psi = phi + side * turn  # Q's direction: at the measured angle from K's
    mag_q = p.massive_qk * p.q_scale * (1 + 0.1 * torch.randn(h, generator=g))
    k_const = p.massive_qk * p.k_scale * torch.stack((phi.cos(), phi.sin()), -1)  # (Hk, 2)
    q_const = mag_q[:, None] * torch.stack((psi.cos(), psi.sin()), -1).repeat_interleave(group, 0)
    rows_k, rows_q = torch.arange(hk)[:, None], torch.arange(h)[:, None]
    ch_q = ch.repeat_interleave(group, 0)
    prm.k_bias = prm.k_bias.clone()
    prm.k_bias[rows_k, ch] = k_const  # replaces the per-channel bias there
    prm.q_bias = prm.q_bias.clone()
    prm.q_bias[rows_q, ch_q] = q_const
    # token noise in the pair: massive_jitter x the constant's magnitude
    prm.k_noise = torch.ones(hk, d)
    prm.k_noise[rows_k, ch] = p.massive_jitter * p.massive_qk
    prm.q_noise = torch.ones(h, d)
    prm.q_noise[rows_q, ch_q] = p.massive_jitter * mag_q[:, None].abs() / p.q_scale
    prm.massive_ch = ch


def _student_t_rows(shape, df: float, g: torch.Generator, g2: torch.Generator) -> torch.Tensor:
    """Multivariate Student-t rows: normals over the last dim, one chi-square(df) per row.

    Every element is exactly Student-t(df); rows sharing the chi-square gives some tokens a
    large V norm, as in real models, and needs one gamma draw per row only. The normals come
    from ``g``, the chi-squares from ``g2`` (two streams keep the rows prefix-stable).
    """
    z = torch.randn(shape, generator=g)
    chi2 = 2 * torch._standard_gamma(torch.full((*shape[:-1], 1), df / 2), generator=g2)
    return z.mul_(chi2.div_(df).rsqrt_())


def _rope_(x: torch.Tensor, pos: torch.Tensor, theta: float, r: int) -> None:
    """In-place rotate-half RoPE of the trailing ``r`` channels of float32 ``x`` ``(S, H, D)``."""
    ang = pos.to(torch.float64)[:, None] * rope_inv_freq(r, theta)
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    d = x.shape[-1]
    x1, x2 = x[..., d - r : d - r // 2], x[..., d - r // 2 :]
    x1_old = x1 * sin
    x1.mul_(cos).addcmul_(x2, sin, value=-1)
    x2.mul_(cos).add_(x1_old)


def _fill_block(kind, p, prm, seed, b, j, t0, t1, pos0, out):
    """Draw rows ``t0:t1`` of batch ``b`` of tensor ``kind`` into ``out[b, t0:t1]``."""
    g = _generator(seed, p.name, kind, b, j)
    n, d, r = t1 - t0, p.head_dim_qk, p.rope_dims
    sinks = max(0, min(n, p.sink_tokens - t0))  # sink rows in this block
    if kind == "q":
        x = torch.randn(n, p.heads, d, generator=g).mul_(p.q_scale * prm.head_scale)
        if prm.q_noise is not None:
            x.mul_(prm.q_noise)
        if prm.sink_ch is not None:  # damp the token noise along the sink direction
            u = prm.u_q[:, prm.sink_ch]
            xs = x[..., prm.sink_ch]
            x[..., prm.sink_ch] = xs - (1 - SINK_Q_NOISE) * (xs * u).sum(-1, keepdim=True) * u
        x += prm.q_bias
    elif kind == "k":
        x = torch.randn(n, p.kv_heads, d, generator=g).mul_(p.k_scale)
        if prm.k_noise is not None:
            x.mul_(prm.k_noise)
        if p.shared_rope_k and r:
            x[:, 1:, d - r :] = x[:, :1, d - r :]
        x += prm.k_bias
        if sinks:
            x[:sinks] += prm.sink_k
    else:  # v
        shape = (n, p.kv_heads, p.head_dim_v)
        if p.v_tail_df:
            x = _student_t_rows(shape, p.v_tail_df, g, _generator(seed, p.name, "v-chi2", b, j))
        else:
            x = torch.randn(shape, generator=g)
        x *= p.v_scale * prm.v_chan
        if sinks:
            x[:sinks] *= p.sink_v_scale
    if kind != "v" and r:
        _rope_(x, torch.arange(pos0 + t0, pos0 + t1), p.rope_theta, r)
    out[b, t0:t1] = x


def _resolve_heads(heads, kv_heads, ref_heads, ref_kv):
    """Apply ``heads``/``kv_heads`` overrides, keeping the reference GQA ratio when possible."""
    group = ref_heads // ref_kv
    if heads is None and kv_heads is None:
        return ref_heads, ref_kv
    if heads is None:
        return kv_heads * group, kv_heads
    if kv_heads is None:  # the divisor of heads whose group size is closest to the reference
        divisors = [k for k in range(heads, 0, -1) if heads % k == 0]
        kv_heads = min(divisors, key=lambda k: abs(heads // k - group))
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return heads, kv_heads


def make_qkv(
    preset: str | Profile,
    batch: int,
    seqlen: int,
    *,
    heads: int | None = None,
    kv_heads: int | None = None,
    seqlen_k: int | None = None,
    seed: int | None = None,
    device="cpu",
    dtype=torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model-like ``q, k, v`` in flash-attn layout ``(batch, seqlen, heads, head_dim)``.

    ``preset`` is a name from :data:`PRESETS`, a :class:`Profile`, or the path of a capture
    file (``"x.safetensors"`` for its first layer, ``"x.safetensors:7"`` for layer 7), whose
    tensors are returned cut or cyclically tiled to the requested batch, lengths and heads
    (``seed`` is then ignored; tiles along the sequence restart the RoPE phases, so they are
    not what a real longer run would give).

    ``heads``/``kv_heads`` override the preset's; given only ``heads``, ``kv_heads`` is the
    divisor of ``heads`` whose group size is closest to the preset's (e.g. 16 -> 4 for
    llama3-8b, 16 -> 2 for qwen2.5-7b). ``seqlen_k`` (default ``seqlen``) is the key length;
    queries take the last ``seqlen`` positions. Values are reproducible for (preset, shapes,
    seed) on any device (see the module docstring).
    """
    if isinstance(preset, str) and preset not in PRESETS:
        m = re.fullmatch(r"(.+\.safetensors)(?::(\d+))?", preset)
        if m is None:
            raise ValueError(
                f"unknown preset {preset!r}; choose from {list_presets()} or a .safetensors file"
            )
        layer = None if m[2] is None else int(m[2])
        return _from_capture(m[1], layer, batch, seqlen, heads, kv_heads, seqlen_k, device, dtype)
    p = PRESETS[preset] if isinstance(preset, str) else preset
    h, hk = _resolve_heads(heads, kv_heads, p.heads, p.kv_heads)
    p = replace(p, heads=h, kv_heads=hk)
    seed = p.seed if seed is None else seed
    sk = seqlen if seqlen_k is None else seqlen_k
    prm = _make_params(p, seed)
    q = torch.empty(batch, seqlen, h, p.head_dim_qk, dtype=dtype)
    k = torch.empty(batch, sk, hk, p.head_dim_qk, dtype=dtype)
    v = torch.empty(batch, sk, hk, p.head_dim_v, dtype=dtype)
    tensors = (("q", q, seqlen, max(0, sk - seqlen)), ("k", k, sk, 0), ("v", v, sk, 0))
    jobs = [
        (kind, p, prm, seed, b, j, j * BLOCK, min(n, (j + 1) * BLOCK), pos0, out)
        for kind, out, n, pos0 in tensors
        for b in range(batch)
        for j in range(-(-n // BLOCK))
    ]
    _run_parallel(jobs)
    return q.to(device), k.to(device), v.to(device)


def _run_parallel(jobs):
    """Run ``_fill_block`` jobs on a thread pool (torch releases the GIL), one torch thread each.

    torch's intra-op thread count is set to 1 meanwhile (process-wide) and then restored.
    """
    workers = min(len(jobs), torch.get_num_threads(), os.cpu_count() or 1)
    if workers <= 1:
        for job in jobs:
            _fill_block(*job)
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # avoid workers x intra-op threads oversubscription
    try:
        with ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(_fill_block, *job) for job in jobs]:
                f.result()
    finally:
        torch.set_num_threads(old)


def _fit(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Cut ``x`` to ``n`` along ``dim``, or tile it cyclically up to ``n``."""
    reps = -(-n // x.shape[dim])
    if reps > 1:
        x = torch.cat([x] * reps, dim=dim)
    return x.narrow(dim, 0, n)


def _from_capture(path, layer, batch, seqlen, heads, kv_heads, seqlen_k, device, dtype):
    """Captured tensors fitted to the request; queries are the last ``seqlen`` of ``seqlen_k``."""
    q, k, v, _ = load_captured(path, layer)
    h, hk = _resolve_heads(heads, kv_heads, q.shape[2], k.shape[2])
    sk = seqlen if seqlen_k is None else seqlen_k
    q = _fit(q, max(seqlen, sk), 1)[:, max(0, sk - seqlen) :][:, :seqlen]
    out = []
    for x, s, nh in ((q, seqlen, h), (k, sk, hk), (v, sk, hk)):
        x = _fit(_fit(_fit(x, batch, 0), s, 1), nh, 2)
        out.append(x.to(device=device, dtype=dtype).contiguous())
    return tuple(out)


# -------------------------------------------------------------------------------- capture


def _rope_theta(config) -> float | None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return theta if theta is not None else getattr(config, "rope_theta", None)


def _set_attn_implementation(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: the config attribute is read at every forward
        model.config._attn_implementation = name


def capture(
    model, input_ids: torch.Tensor, layers, path, *, max_tokens: int | None = None
) -> dict[str, torch.Tensor]:
    """Run a Hugging Face causal LM on ``input_ids`` and save the post-RoPE Q/K/V of ``layers``.

    Uses transformers' attention-function registry (``AttentionInterface``): the model is
    switched to an attention function that records ``query``/``key``/``value`` (post-RoPE,
    K/V still with their KV heads, before any GQA repeat) and ``module.layer_idx``, then
    delegates to transformers' SDPA function; the model's own implementation is restored
    afterwards. ``input_ids`` is ``(S,)``, ``(1, S)`` or ``(B, S)``; ``max_tokens`` keeps its
    first tokens only (the same Q/K/V as the full run for those tokens, the model being causal).
    Negative layer indices count from the end.

    Writes ``path`` (safetensors) with ``layer{i}.q``/``.k``/``.v`` in flash-attn layout
    ``(B, S, H, D)`` and the model's dtype, and string metadata: ``format``, ``model_type``,
    ``model_name``, ``heads``, ``kv_heads``, ``head_dim_qk``, ``head_dim_v``, ``rope_theta``,
    ``layers``, ``layer{i}.scale`` (the softmax scale the layer used). Returns the tensors.
    """
    from safetensors.torch import save_file
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if max_tokens is not None:
        ids = ids[:, :max_tokens]
    n_layers = model.config.get_text_config().num_hidden_layers
    wanted = sorted({i % n_layers for i in ([layers] if isinstance(layers, int) else layers)})
    records: dict[int, tuple] = {}
    calls = [0]

    def record_and_attend(module, query, key, value, attention_mask, **kwargs):
        idx = getattr(module, "layer_idx", None)
        idx = calls[0] if idx is None else idx  # fall back on the call order
        calls[0] += 1
        if idx in wanted and idx not in records:
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            bshd = [t.detach().transpose(1, 2).contiguous().cpu() for t in (query, key, value)]
            records[idx] = (*bshd, scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE_IMPL, record_and_attend)
    try:  # transformers >= 4.53 builds masks per implementation: ask for SDPA's
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(CAPTURE_IMPL, sdpa_mask)
    except ImportError:
        pass
    previous = model.config._attn_implementation
    try:
        _set_attn_implementation(model, CAPTURE_IMPL)
        with torch.no_grad():
            model(input_ids=ids.to(model.device), use_cache=False)
    finally:
        _set_attn_implementation(model, previous)
    missing = [i for i in wanted if i not in records]
    if missing:
        raise RuntimeError(f"layers {missing} were not reached by the attention function")

    tensors, meta = {}, {}
    for i in wanted:
        q, k, v, scale = records[i]
        tensors.update({f"layer{i}.q": q, f"layer{i}.k": k, f"layer{i}.v": v})
        meta[f"layer{i}.scale"] = repr(float(scale))
    q, k, v, _ = records[wanted[0]]
    cfg = model.config.get_text_config()
    meta.update(
        format=CAPTURE_FORMAT,
        model_type=str(getattr(cfg, "model_type", "")),
        model_name=str(getattr(cfg, "_name_or_path", "") or type(model).__name__),
        heads=str(q.shape[2]),
        kv_heads=str(k.shape[2]),
        head_dim_qk=str(q.shape[3]),
        head_dim_v=str(v.shape[3]),
        rope_theta=str(_rope_theta(cfg)),
        layers=",".join(map(str, wanted)),
    )
    save_file(tensors, str(path), metadata=meta)
    return tensors


def load_captured(path, layer: int | None = None):
    """Read a :func:`capture` file: ``(q, k, v, meta)`` of ``layer`` (default: its first).

    ``meta`` is the file's metadata with ``heads``, ``kv_heads``, ``head_dim_*`` as ints,
    ``rope_theta`` and ``scale`` (this layer's softmax scale) as floats (None if unknown),
    ``layers`` as a list of ints and ``layer`` the layer returned.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
        layers = sorted(int(m[1]) for key in f.keys() if (m := re.fullmatch(r"layer(\d+)\.q", key)))
        if not layers:
            raise ValueError(f"{path} holds no layer<i>.q tensor")
        layer = layers[0] if layer is None else layer
        if layer not in layers:
            raise KeyError(f"layer {layer} not in {path} (layers {layers})")
        q, k, v = (f.get_tensor(f"layer{layer}.{n}") for n in "qkv")
    meta = {key: val for key, val in raw.items() if not key.startswith("layer")}
    for key in ("heads", "kv_heads", "head_dim_qk", "head_dim_v"):
        if key in meta:
            meta[key] = int(meta[key])
    theta, scale = raw.get("rope_theta"), raw.get(f"layer{layer}.scale")
    meta["rope_theta"] = None if theta in (None, "None") else float(theta)
    meta["scale"] = None if scale is None else float(scale)
    meta["layers"], meta["layer"] = layers, layer
    return q, k, v, meta
