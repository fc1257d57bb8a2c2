"""Benchmark shapes: the standard sweep, the model presets, one uneven varlen batch, the serving batches
(packed prompts, and chunked-prefill batches whose queries attend to longer key sequences).

A :class:`Case` is one attention problem (shape, mask, activation profile). FLOPs follow
the flash-attn convention (docs/design.md §6): ``2·B·Hq·Sq·Sk·(Dqk+Dv)`` for the two matrix
products without a mask; causal counts the keys the bottom-right mask leaves,
``2·B·Hq·(Dqk+Dv)·(Sq·(Sk−Sq) + Sq²/2)`` for ``Sq <= Sk`` (half of ``Sq·Sk`` when ``Sq == Sk``, as
before; see :func:`attention_flops`); a varlen batch sums that over its sequences. A causal sliding window
(``Case.window_left``: flash-attn's ``window_size=(left, 0)``) counts the (query, key) pairs of its band, with the
same half diagonal.

A chunked-prefill batch (:data:`SERVING_CHUNKED_BATCHES`) has per-sequence key lengths
``Case.seqlens_k`` longer than its query lengths ``Case.seqlens``: each sequence's queries are the
last ``Sq`` of its ``Sk`` tokens (a chunk after a cached prefix), causal aligned bottom-right.
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


def _chunks(chunk_lengths, prefixes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query lengths, key lengths) of chunks after cached prefixes: ``Sk = prefix + Sq``."""
    return tuple(chunk_lengths), tuple(c + p for c, p in zip(chunk_lengths, prefixes))


#: chunked-prefill batches (``--sweep serving``): ``label -> (query lengths, key lengths)``, what a
#: serving engine's chunked prefill passes to ``flash_attn_varlen_func`` (``cu_seqlens_q !=
#: cu_seqlens_k``): each sequence's queries are a chunk of its newest tokens, its keys the cached
#: prefix plus the chunk (causal aligned bottom-right). About 16K query tokens each, on
#: :data:`SERVING_MODEL` heads.
_NEW_PROMPTS = _lengths(6, 12, 100, 900)  # fresh prompts in a chunked batch: Sq == Sk
SERVING_CHUNKED_BATCHES = {
    # 8 chunks of 2048 tokens after prefixes drawn from 1024-12288 tokens (1599-11717): keys 3647-13765,
    # 68,689 in all
    "chunk8x2k+prefix": _chunks((2048,) * 8, _lengths(4, 8, 1024, 12288)),
    # 3 chunks (4096, 4096, 2048) after prefixes of 14699, 6456, 28574 tokens, then 12 new prompts of
    # 100-900 tokens: 16,276 query tokens, 66,005 keys
    "chunks+new": tuple(x + _NEW_PROMPTS for x in _chunks((4096, 4096, 2048), _lengths(7, 3, 4096, 28672))),
}

#: "chunked" is the serving sweep's chunked-prefill batches alone (a subset of "serving")
SWEEPS = ("standard", "models", "varlen", "serving", "chunked", "window")

#: the window sweep (``--sweep window``): causal sliding windows of WINDOW_LEFT keys at WINDOW_SEQLENS, next to the
#: plain causal cases at WINDOW_CAUSAL_SEQLENS (the target: a window's TFLOP/s, counted on its band, at least
#: 0.95x the causal kernel's at 4K-8K); d128, 16 heads, B·S = 16K tokens as the standard sweep
WINDOW_LEFT = 4096
WINDOW_SEQLENS = (16384, 32768)
WINDOW_CAUSAL_SEQLENS = (4096, 8192)


@dataclass(frozen=True)
class Case:
    """One attention problem. ``seqlens`` is set for a varlen batch (then ``batch`` is its
    number of sequences and ``seqlen`` the longest one). ``seqlens_k`` (varlen only) gives each
    sequence's key length where it differs from its query length (a chunked-prefill batch:
    ``Sk >= Sq``, causal aligned bottom-right); None means ``seqlens``."""

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
    seqlens_k: tuple[int, ...] | None = field(default=None)
    window_left: int = field(default=-1)  # a causal sliding window of this many keys back (-1: none)

    def __post_init__(self):
        if self.window_left >= 0 and not self.causal:
            raise ValueError("window_left: the bench's sliding windows are causal (window_size=(left, 0))")
        if self.seqlens_k is None:
            return
        if self.seqlens is None:
            raise ValueError("seqlens_k needs seqlens (key lengths are per sequence of a varlen batch)")
        if len(self.seqlens_k) != len(self.seqlens):
            raise ValueError(f"{len(self.seqlens_k)} key lengths for {len(self.seqlens)} sequences")
        if any(k < q for q, k in zip(self.seqlens, self.seqlens_k)):
            raise ValueError(f"a key length is shorter than its query length: seqlens={self.seqlens}, "
                             f"seqlens_k={self.seqlens_k}")
        if tuple(self.seqlens_k) == tuple(self.seqlens):  # not chunked: one spelling of a plain batch
            object.__setattr__(self, "seqlens_k", None)

    @property
    def window_size(self) -> tuple[int, int]:
        """flash-attn's ``window_size`` of this case: ``(window_left, 0)``, or ``(-1, -1)`` without a window."""
        return (self.window_left, 0) if self.window_left >= 0 else (-1, -1)

    @property
    def varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def chunked(self) -> bool:
        """A varlen batch whose key lengths differ from its query lengths (chunked prefill)."""
        return self.seqlens_k is not None

    @property
    def key_seqlens(self) -> tuple[int, ...] | None:
        """Each sequence's key length (``seqlens`` unless chunked); None for a dense case."""
        return self.seqlens_k if self.chunked else self.seqlens

    @property
    def tokens(self) -> int:
        """Query tokens."""
        return sum(self.seqlens) if self.varlen else self.batch * self.seqlen

    @property
    def tokens_k(self) -> int:
        """Key (and value) tokens."""
        return sum(self.key_seqlens) if self.varlen else self.batch * self.seqlen

    @property
    def seqlen_k(self) -> int:
        """The longest key sequence."""
        return max(self.seqlens_k) if self.chunked else self.seqlen

    @property
    def name(self) -> str:
        mask = ("causal" if self.causal else "full") + (f"-w{self.window_left}" if self.window_left >= 0 else "")
        if self.chunked:  # e.g. .../chunked8/S2048-Sk13765/...: longest chunk, longest key sequence
            shape, s = f"chunked{len(self.seqlens)}", f"S{self.seqlen}-Sk{self.seqlen_k}"
        else:
            shape = f"varlen{len(self.seqlens)}" if self.varlen else f"B{self.batch}"
            s = f"S{self.seqlen}"
        return (f"{self.sweep}/{self.label}/{shape}/{s}/H{self.heads}-{self.kv_heads}"
                f"/D{self.head_dim}-{self.head_dim_v}/{mask}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seqlens"] = list(self.seqlens) if self.seqlens else None
        d["seqlens_k"] = list(self.seqlens_k) if self.seqlens_k else None
        if self.window_left < 0:  # (rows without a window keep their columns)
            del d["window_left"]
        d["tokens"] = self.tokens
        if self.chunked:
            d["tokens_k"] = self.tokens_k
            d["seqlen_k"] = self.seqlen_k
        d["flops"] = flops(self)
        return d


def activation_preset(model: str) -> str:
    """The ``leanfa.activations`` preset for ``model``'s inputs (see :data:`MODEL_ACTIVATIONS`)."""
    return MODEL_ACTIVATIONS.get(model, model)


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    head_dim_v: int, causal: bool, window_left: int = -1) -> float:
    """FLOPs of one forward attention, flash-attn convention: ``2·B·Hq·(Dqk+Dv)`` times the
    (query, key) pairs computed.

    Without a mask that is ``Sq·Sk``. Causal (aligned bottom-right: query ``i`` sees keys
    ``j <= i + Sk − Sq``) it is ``Sq·(Sk−Sq) + Sq²/2`` for ``Sq <= Sk``: the keys before the chunk
    in full, the square over the chunk halved. That is the exact count
    ``Σ_i (Sk − Sq + i + 1) = Sq·(Sk−Sq) + Sq·(Sq+1)/2`` less ``Sq/2`` (the half diagonal), the
    convention flash-attn's benchmarks use and this project always has for ``Sq == Sk``
    (``Sq²/2``), so results before chunked batches stay comparable. For ``Sq > Sk`` the first
    ``Sq − Sk`` queries see no key: ``Sk²/2``.

    A causal sliding window of ``window_left`` keys: query ``i`` (at key position ``p = i + Sk − Sq``) sees keys
    ``[p − left, p]``, ``min(p, left) + 1`` of them; less the half diagonal as above, ``Σ_i min(p_i, left) + Sq/2``
    (the causal count once ``left >= Sk − 1``).
    """
    per_pair = 2.0 * batch * heads * (head_dim + head_dim_v)
    if not causal:
        return per_pair * seqlen_q * seqlen_k
    sq = min(seqlen_q, seqlen_k)  # queries that see at least one key
    if window_left < 0:
        return per_pair * (sq * (seqlen_k - sq) + sq * sq / 2)
    first = seqlen_k - sq  # the first such query's key position; positions first .. first + sq - 1
    below = max(0, min(sq, window_left - first))  # queries whose position is below left: not capped
    capped = below * first + below * (below - 1) / 2 + (sq - below) * window_left
    return per_pair * (capped + sq / 2)


def flops(case: Case) -> float:
    if case.varlen:
        return sum(attention_flops(1, case.heads, sq, sk, case.head_dim, case.head_dim_v, case.causal,
                                   case.window_left)
                   for sq, sk in zip(case.seqlens, case.key_seqlens))
    return attention_flops(case.batch, case.heads, case.seqlen, case.seqlen, case.head_dim,
                           case.head_dim_v, case.causal, case.window_left)


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


def window_cases(seqlens=WINDOW_SEQLENS, causal_seqlens=WINDOW_CAUSAL_SEQLENS, left=WINDOW_LEFT) -> list[Case]:
    """Causal d128 (16 heads, B·S = 16K tokens, gaussian): a sliding window of ``left`` keys at ``seqlens``, and
    the plain causal cases at ``causal_seqlens`` it is compared with."""
    out = [Case("window", "d128", "gaussian", max(1, STANDARD_TOKENS // s), s, STANDARD_HEADS, STANDARD_HEADS,
                128, 128, True) for s in causal_seqlens]
    return out + [Case("window", "d128", "gaussian", max(1, STANDARD_TOKENS // s), s, STANDARD_HEADS,
                       STANDARD_HEADS, 128, 128, True, window_left=left) for s in seqlens]


def serving_lengths(label: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(query lengths, key lengths or None) of a serving batch, plain or chunked."""
    if label in SERVING_BATCHES:
        return tuple(SERVING_BATCHES[label]), None
    if label in SERVING_CHUNKED_BATCHES:
        q, k = SERVING_CHUNKED_BATCHES[label]
        return tuple(q), tuple(k)
    raise ValueError(f"unknown serving batch {label!r}; choose from "
                     f"{tuple(SERVING_BATCHES) + tuple(SERVING_CHUNKED_BATCHES)}")


def serving_cases(causal=(True,), batches=tuple(SERVING_BATCHES) + tuple(SERVING_CHUNKED_BATCHES),
                  model=SERVING_MODEL) -> list[Case]:
    """The serving batches (:data:`SERVING_BATCHES`, then the chunked-prefill ones of
    :data:`SERVING_CHUNKED_BATCHES`), labelled by batch."""
    hq, hkv, dqk, dv = MODELS[model]
    out = []
    for b in batches:
        q, k = serving_lengths(b)
        out += [Case("serving", b, activation_preset(model), len(q), max(q), hq, hkv, dqk, dv, c, q, k)
                for c in causal]
    return out


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
    elif "chunked" in sweeps:
        cases += serving_cases(_causal_options(causal, (True,)), batches=tuple(SERVING_CHUNKED_BATCHES))
    if "window" in sweeps:  # (causal only; --seqlens sets the windowed cases' lengths; quick: 16K beside 4K)
        quick_s = tuple(s for s in QUICK_SEQLENS if s > WINDOW_LEFT)
        cases += window_cases(tuple(seqlens) if seqlens else quick_s if quick else WINDOW_SEQLENS,
                              WINDOW_CAUSAL_SEQLENS[:1] if quick else WINDOW_CAUSAL_SEQLENS)
    return cases
