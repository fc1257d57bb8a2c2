"""Benchmark shapes: the standard sweep, the model presets, one uneven varlen batch, the serving batches.

A :class:`Case` is one attention problem (shape, mask, activation profile). FLOPs follow
the flash-attn convention (docs/design.md §6): ``2·B·Hq·Sq·Sk·(Dqk+Dv)`` for the two matrix
products, halved for causal with ``Sq == Sk``; a varlen batch sums that over its sequences
(causal halves each sequence).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: tokens per batch in the standard sweep (FA3 paper): B = TOKENS // S (at least 1)
STANDARD_TOKENS = 16384
STANDARD_HEADS = 16
STANDARD_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
#: head dims of the standard sweep: (label, Dqk, Dv)
STANDARD_DIMS = (("d128", 128, 128), ("mla", 192, 128))
#: head dims the standard sweep can also run (``leanfa bench --dims``)
EXTRA_DIMS = (("d64", 64, 64), ("d256", 256, 256))

#: model presets: name -> (q heads, kv heads, Dqk, Dv)
MODELS = {
    "llama3-8b": (32, 8, 128, 128),
    "llama3.1-70b": (64, 8, 128, 128),
    "mistral-7b": (32, 8, 128, 128),
    "qwen2.5-7b": (28, 4, 128, 128),
    "deepseek-v3-mla": (128, 128, 192, 128),
}
#: the ``leanfa.activations`` preset that makes a model's Q/K/V (at the model's heads), where it
#: is not the model's own name: Llama-3.1-70B has Llama-3-8B's RoPE (theta 500000) and GQA
#: layout at twice the query heads
MODEL_ACTIVATIONS = {"llama3.1-70b": "llama3-8b"}
MODEL_SEQLENS = (2048, 8192, 32768)

#: one uneven varlen batch (a prefill mix), 16384 tokens in all, on Llama-3-8B heads
VARLEN_MODEL = "llama3-8b"
VARLEN_SEQLENS = (8192, 3001, 2048, 1500, 1024, 517, 100, 2)

#: ``--quick`` trims every sweep to these sequence lengths
QUICK_SEQLENS = (1024, 4096, 16384)

def _lengths(seed: int, n: int, low: int, high: int) -> tuple[int, ...]:
    """``n`` prompt lengths uniform in ``[low, high]``, fixed by ``seed`` (a small LCG: the same on every machine)."""
    out, x = [], seed
    for _ in range(n):
        x = (1103515245 * x + 12345) % 2**31
        out.append(low + x % (high - low + 1))
    return tuple(out)


#: packed serving batches on Llama-3-8B heads (``--sweep serving``, issue 22): what a serving engine's
#: ``flash_attn_varlen_func`` sees, by batch label
SERVING_MODEL = "llama3-8b"
SERVING_BATCHES = {
    "mix16k": VARLEN_SEQLENS,  # one long prompt, a spread of others, two tiny ones
    "equal4x4k": (4096,) * 4,  # equal lengths: what the dense kernel runs
    "mixed8": (5000, 3100, 2500, 2000, 1800, 1000, 983, 1),  # 16K tokens, down to one token
    "chat64": _lengths(1, 64, 50, 600),  # 64 chat-length prompts
    "long+short40": (12288,) + _lengths(2, 40, 30, 200),  # one long prompt among 40 short ones
    "chat256": _lengths(3, 256, 20, 300),  # a large decode-sized prefill batch
}

SWEEPS = ("standard", "models", "varlen", "serving")


@dataclass(frozen=True)
class Case:
    """One attention problem. ``seqlens`` is set for a varlen batch (then ``batch`` is its
    number of sequences and ``seqlen`` the longest one)."""

    sweep: str
    label: str  # "d128" / "mla" for the standard sweep, the model name otherwise
    preset: str  # activation profile for leanfa.activations.make_qkv ("gaussian": randn)
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    causal: bool
    seqlens: tuple[int, ...] | None = field(default=None)

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def tokens(self) -> int:
        return sum(self.seqlens) if self.varlen else self.batch * self.seqlen

    @property
    def name(self) -> str:
        mask = "causal" if self.causal else "full"
        shape = f"varlen{len(self.seqlens)}" if self.varlen else f"B{self.batch}"
        return (f"{self.sweep}/{self.label}/{shape}/S{self.seqlen}/H{self.heads}-{self.kv_heads}"
                f"/D{self.head_dim}-{self.head_dim_v}/{mask}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seqlens"] = list(self.seqlens) if self.seqlens else None
        d["tokens"] = self.tokens
        d["flops"] = flops(self)
        return d


def activation_preset(model: str) -> str:
    """The ``leanfa.activations`` preset for ``model``'s inputs (see :data:`MODEL_ACTIVATIONS`)."""
    return MODEL_ACTIVATIONS.get(model, model)


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    head_dim_v: int, causal: bool) -> float:
    """FLOPs of one forward attention, flash-attn convention (halved if causal and Sq == Sk)."""
    f = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v)
    if causal and seqlen_q == seqlen_k:
        f /= 2
    return f


def flops(case: Case) -> float:
    if case.varlen:
        return sum(attention_flops(1, case.heads, s, s, case.head_dim, case.head_dim_v, case.causal)
                   for s in case.seqlens)
    return attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim,
                           case.head_dim_v, case.causal)


def standard_cases(seqlens=STANDARD_SEQLENS, causal=(True, False), dims=STANDARD_DIMS) -> list[Case]:
    """B·S = 16384 tokens, 16 heads, d128 and MLA 192/128 (``dims``), gaussian inputs (FA3 paper)."""
    out = []
    for c in causal:
        for label, dqk, dv in dims:
            for s in seqlens:
                out.append(Case("standard", label, "gaussian", max(1, STANDARD_TOKENS // s), s,
                                STANDARD_HEADS, STANDARD_HEADS, dqk, dv, c))
    return out


def model_cases(seqlens=MODEL_SEQLENS, causal=(True,), models=tuple(MODELS)) -> list[Case]:
    """Model heads with model-like activations; batch keeps B·S >= 16384 tokens."""
    out = []
    for m in models:
        hq, hkv, dqk, dv = MODELS[m]
        for c in causal:
            for s in seqlens:
                out.append(Case("models", m, activation_preset(m), max(1, STANDARD_TOKENS // s), s, hq,
                                hkv, dqk, dv, c))
    return out


def varlen_cases(causal=(True,), seqlens=VARLEN_SEQLENS, model=VARLEN_MODEL) -> list[Case]:
    hq, hkv, dqk, dv = MODELS[model]
    return [Case("varlen", model, activation_preset(model), len(seqlens), max(seqlens), hq, hkv, dqk, dv, c,
                 tuple(seqlens)) for c in causal]


def serving_cases(causal=(True,), batches=tuple(SERVING_BATCHES), model=SERVING_MODEL) -> list[Case]:
    """The serving batches (:data:`SERVING_BATCHES`), labelled by batch."""
    hq, hkv, dqk, dv = MODELS[model]
    return [Case("serving", b, activation_preset(model), len(SERVING_BATCHES[b]), max(SERVING_BATCHES[b]), hq, hkv,
                 dqk, dv, c, tuple(SERVING_BATCHES[b])) for b in batches for c in causal]


def _causal_options(causal: str | None, default: tuple[bool, ...]) -> tuple[bool, ...]:
    if causal is None:
        return default
    return {"both": (True, False), "true": (True,), "false": (False,)}[causal]


def _standard_dims(labels) -> tuple:
    if not labels:
        return STANDARD_DIMS
    known = {d[0]: d for d in STANDARD_DIMS + EXTRA_DIMS}
    bad = [x for x in labels if x not in known]
    if bad:
        raise ValueError(f"unknown head dim label(s) {bad}; choose from {tuple(known)}")
    return tuple(known[x] for x in labels)


def build_cases(sweeps=SWEEPS, *, quick: bool = False, seqlens=None, causal: str | None = None,
                models=None, dims=None) -> list[Case]:
    """The cases of the chosen sweeps.

    ``seqlens`` overrides every sweep's sequence lengths (varlen and serving keep their batches);
    ``quick`` keeps only :data:`QUICK_SEQLENS`; ``causal`` is "both", "true" or "false"
    (default: both for the standard sweep, causal for models and varlen, as in prefill); ``dims``
    are the standard sweep's head-dim labels (default d128, mla; d64 and d256 too).
    """
    unknown = [s for s in sweeps if s not in SWEEPS]
    if unknown:
        raise ValueError(f"unknown sweep(s) {unknown}; choose from {SWEEPS}")
    models = tuple(models) if models else tuple(MODELS)
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise ValueError(f"unknown model(s) {bad}; choose from {tuple(MODELS)}")
    std_s = tuple(seqlens) if seqlens else (QUICK_SEQLENS if quick else STANDARD_SEQLENS)
    mod_s = tuple(seqlens) if seqlens else (QUICK_SEQLENS if quick else MODEL_SEQLENS)
    cases: list[Case] = []
    if "standard" in sweeps:
        cases += standard_cases(std_s, _causal_options(causal, (True, False)), _standard_dims(dims))
    if "models" in sweeps:
        cases += model_cases(mod_s, _causal_options(causal, (True,)), models)
    if "varlen" in sweeps:
        cases += varlen_cases(_causal_options(causal, (True,)))
    if "serving" in sweeps:
        cases += serving_cases(_causal_options(causal, (True,)))
    return cases
