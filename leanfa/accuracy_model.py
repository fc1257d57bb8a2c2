"""CPU emulator of leanfa's FP8 attention numerics, for measuring accuracy levers.

:func:`emulate` reproduces, in plain torch on the CPU, what the FP8 path computes:

1. optional transforms of Q and K that leave ``Q Kᵀ`` unchanged (random-sign Hadamard
   rotation of the head dim, SmoothQuant-style channel migration), K smoothing (and, as a
   *kernel-change* lever, Q smoothing with an exact per-key bias);
2. e4m3 quantization of Q, K (scale per 128-token block, per token, per head or per tensor;
   optionally a second e4m3 term for the residual: ``x ≈ hi + lo``) and V (per channel, per
   tensor, per channel × per token block, optionally mean-smoothed);
3. the kernels' online softmax over key blocks of ``block_n`` keys, exactly as in
   :mod:`leanfa.kernels.portable`: ``c = q_descale * k_descale * scale * log2e``,
   ``m = max(m, rowmax(s) * c)``, ``p = exp2(s*c - (m - p_shift))`` rounded to e4m3,
   ``l`` summed from the unrounded ``p``, each block's ``P V`` added to an fp32 accumulator;
4. ``out = acc / l * v_descale`` rounded to the output dtype.

Every quantization step can be switched off (``quant_q`` ... ``quant_p``) to attribute the
error to its sources. With ``block_n=32`` (the interpreter tile) and the default
:class:`Scheme` it matches ``leanfa.attention(precision="fp8")`` under ``TRITON_INTERPRET=1``
to float32 rounding (``tests/test_accuracy_levers.py`` checks it).

Run ``python -m leanfa.accuracy_model`` for the lever table of ``docs/accuracy-notes.md``, and
``python -m leanfa.accuracy_model --decompose --seqlen 2048`` for its error decomposition
(:func:`decompose`: Q·K scores, P and V rounding, one at a time, on every activation preset).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .hadamard import hadamard_pm1, random_hadamard  # noqa: F401 (hadamard_pm1: re-exported)

E4M3_MAX = 448.0
LOG2E = 1.4426950408889634
F8 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------ scheme


@dataclass(frozen=True)
class Scheme:
    """One FP8 numerics recipe. Defaults = leanfa's shipped scheme before this study."""

    q_gran: str = "block"  #: "block" (128 tokens), "token", "head", "tensor"
    k_gran: str = "block"
    smooth_k: bool = True  #: subtract K's per-channel mean over the sequence
    smooth_q: bool = False  #: subtract Q's mean; add the exact bias scale*μq·k_j (kernel change)
    hadamard: bool = False  #: random-sign Hadamard rotation of Q and K's head dim
    migrate: float | None = None  #: SmoothQuant alpha: q_d/σ_d, k_d·σ_d, σ_d = aq^α / ak^(1-α)
    q_terms: int = 1  #: 2: Q ≈ hi + lo, both e4m3 (two QKᵀ MMAs)
    k_terms: int = 1
    bf16_keys: int = 0  #: leading keys whose scores and P·V run unquantized (BF16 path)
    v_gran: str = "channel"  #: "channel", "tensor", "channel_block" (× per-128-key scale)
    smooth_v: bool = False  #: subtract V's per-channel mean, add it back to the output
    p_shift: float = 8.0  #: P scaled by 2^p_shift before e4m3 (8: 256; log2(448): 448)
    p_format: str = "e4m3"  #: "e4m3", "bf16", "exact"
    l_from_rounded_p: bool = False  #: row sum over the rounded P (kernel change)
    quant_q: bool = True
    quant_k: bool = True
    quant_v: bool = True
    out_dtype: torch.dtype | None = torch.bfloat16
    block_n: int = 128  #: keys per online-softmax step (32 under the interpreter)
    rotation_seed: int = 0


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(F8).to(torch.float32)


def _descale(x: torch.Tensor, gran: str, block: int = 128) -> torch.Tensor:
    """x (B, H, S, D) float32 -> per-token descale (B, H, S, 1) for the granularity."""
    b, h, s, _ = x.shape
    a = x.abs().amax(-1, keepdim=True)  # per token
    if gran == "token":
        pass
    elif gran == "block":
        nblk = -(-s // block)
        pad = torch.zeros(b, h, nblk * block - s, 1)
        a = torch.cat((a, pad), 2).reshape(b, h, nblk, block).amax(-1)
        a = a.repeat_interleave(block, 2)[:, :, :s, None]
    elif gran == "head":
        a = a.amax(2, keepdim=True).expand(b, h, s, 1)
    elif gran == "tensor":
        a = a.amax().reshape(1, 1, 1, 1).expand(b, h, s, 1)
    else:
        raise ValueError(gran)
    return torch.where(a > 0, a / E4M3_MAX, torch.ones_like(a))


def _quant(x: torch.Tensor, gran: str, terms: int, on: bool):
    """-> (values in scaled units, float32, possibly hi+lo summed; descale (B,H,S,1))."""
    d = _descale(x, gran)
    if not on:
        return x / d, d
    y = x / d
    hi = _to_e4m3(y)
    if terms == 1:
        return hi, d
    return hi + _to_e4m3(y - hi), d  # the lo term shares hi's scale (2 MMAs, one c)


def _prepare_qk(q, k, sc: Scheme):
    """q (B,Hq,S,D), k (B,Hkv,S,D) float32 -> transformed q, k and the per-key bias (or None)."""
    group = q.shape[1] // k.shape[1]
    bias = None
    if sc.smooth_q:
        mq = q.mean(2, keepdim=True)  # (B, Hq, 1, D)
        q = q - mq
        # exact per-key bias  μq · k_j  (the kernel would add it to s in fp32)
        bias = torch.matmul(mq.double(), k.double().repeat_interleave(group, 1).transpose(-1, -2))
    if sc.smooth_k:
        k = k - k.mean(2, keepdim=True)
    if sc.migrate is not None:
        aq = q.abs().amax(2).reshape(q.shape[0], k.shape[1], group, -1).amax(2)  # (B, Hkv, D)
        ak = k.abs().amax(2).clamp_min(1e-12)
        sig = (aq.clamp_min(1e-12) ** sc.migrate / ak ** (1 - sc.migrate)).clamp(1e-4, 1e4)
        q = q / sig.repeat_interleave(group, 1)[:, :, None]
        k = k * sig[:, :, None]
    return q, k, bias


def emulate(q, k, v, scheme: Scheme = Scheme(), *, causal: bool = True,
            softmax_scale: float | None = None) -> torch.Tensor:
    """FP8 attention of BF16/FP32 ``(B, S, H, D)`` q, k, v as the kernels compute it; returns
    ``(B, Sq, Hq, Dv)`` in ``scheme.out_dtype`` (float32 when None)."""
    sc = scheme
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if sc.hadamard:  # rotate first (as quantize_fp8 does); the smoothing below is linear
        r = random_hadamard(q.shape[-1], sc.rotation_seed).float()
        q, k = torch.matmul(q.float(), r), torch.matmul(k.float(), r)
    qf = q.float().permute(0, 2, 1, 3)  # (B, Hq, Sq, D)
    kf = k.float().permute(0, 2, 1, 3)
    vf = v.float().permute(0, 2, 1, 3)
    b, hq, sq, _ = qf.shape
    hkv, sk = kf.shape[1], kf.shape[2]
    group = hq // hkv
    qt, kt, bias = _prepare_qk(qf, kf, sc)
    q8, qd = _quant(qt, sc.q_gran, sc.q_terms, sc.quant_q)
    k8, kd = _quant(kt, sc.k_gran, sc.k_terms, sc.quant_k)
    if sc.bf16_keys:  # keys in the BF16 path: unquantized, unit descale
        n = min(sc.bf16_keys, sk)
    # V
    v_mean = None
    if sc.smooth_v:
        v_mean = vf.mean(2, keepdim=True)
        vf = vf - v_mean
    if sc.v_gran == "channel":
        vch = vf.abs().amax(2, keepdim=True)  # (B, Hkv, 1, Dv)
    elif sc.v_gran == "tensor":
        vch = vf.abs().amax().reshape(1, 1, 1, 1).expand(b, hkv, 1, vf.shape[-1])
    elif sc.v_gran == "channel_block":  # per channel, then per 128-key block on top
        vch = vf.abs().amax(2, keepdim=True)
    else:
        raise ValueError(sc.v_gran)
    vd = torch.where(vch > 0, vch / E4M3_MAX, torch.ones_like(vch))
    vs = vf / vd
    vtok = torch.ones(b, hkv, sk, 1)  # per-key V descale (channel_block)
    if sc.v_gran == "channel_block":
        nblk = -(-sk // 128)
        a = torch.cat((vs.abs().amax(-1, keepdim=True), torch.zeros(b, hkv, nblk * 128 - sk, 1)), 2)
        a = a.reshape(b, hkv, nblk, 128).amax(-1).repeat_interleave(128, 2)[:, :, :sk, None]
        vtok = torch.where(a > 0, a / E4M3_MAX, torch.ones_like(a))
        vs = vs / vtok
    v8 = _to_e4m3(vs) if sc.quant_v else vs
    if sc.bf16_keys:
        n = min(sc.bf16_keys, sk)
        v8 = v8.clone()
        v8[:, :, :n] = (vf[:, :, :n] / vd)
        vtok = vtok.clone()
        vtok[:, :, :n] = 1.0

    # expand KV heads to query heads
    k8 = k8.repeat_interleave(group, 1)
    kd = kd.repeat_interleave(group, 1)
    v8 = v8.repeat_interleave(group, 1)
    vtok = vtok.repeat_interleave(group, 1)
    c_row = qd * (scale * LOG2E)  # (B, Hq, Sq, 1)
    m = torch.full((b, hq, sq, 1), -math.inf)
    l = torch.zeros(b, hq, sq, 1)
    acc = torch.zeros(b, hq, sq, v8.shape[-1])
    rows = torch.arange(sq)[:, None] + (sk - sq)
    for n0 in range(0, sk, sc.block_n):
        n1 = min(sk, n0 + sc.block_n)
        s = torch.matmul(q8, k8[:, :, n0:n1].transpose(-1, -2))  # (B, Hq, Sq, bn)
        c = c_row * kd[:, :, n0:n1].transpose(-1, -2)  # per key (block or token scales)
        sc_s = s * c
        if bias is not None:
            sc_s = (sc_s.double() + bias[..., n0:n1] * (scale * LOG2E)).float()
        if sc.bf16_keys and n0 < sc.bf16_keys:  # BF16 path: unquantized Q and K
            nb = min(sc.bf16_keys, n1) - n0
            kx = kt.repeat_interleave(group, 1)[:, :, n0:n0 + nb]
            sc_s = sc_s.clone()
            sc_s[..., :nb] = torch.matmul(qt, kx.transpose(-1, -2)) * (scale * LOG2E)
        if causal:
            vis = torch.arange(n0, n1)[None, :] <= rows
            sc_s = sc_s.masked_fill(~vis, -math.inf)
        m_new = torch.maximum(m, sc_s.amax(-1, keepdim=True))
        m_use = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp2(sc_s - (m_use - sc.p_shift))
        alpha = torch.exp2(m - m_use)
        pv = p * vtok[:, :, n0:n1].transpose(-1, -2) if sc.v_gran == "channel_block" else p
        if sc.p_format == "e4m3":
            p8 = _to_e4m3(pv)
        elif sc.p_format == "bf16":
            p8 = pv.to(torch.bfloat16).float()
        else:
            p8 = pv
        if sc.bf16_keys and n0 < sc.bf16_keys:
            nb = min(sc.bf16_keys, n1) - n0
            p8 = p8.clone()
            p8[..., :nb] = pv[..., :nb].to(torch.bfloat16).float()
        if sc.l_from_rounded_p:
            l = l * alpha + (p8 / (vtok[:, :, n0:n1].transpose(-1, -2) if sc.v_gran == "channel_block" else 1)).sum(-1, keepdim=True)
        else:
            l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p8, v8[:, :, n0:n1])
        m = m_new
    out = acc / torch.where(l > 0, l, torch.ones_like(l)) * vd.repeat_interleave(group, 1)
    if v_mean is not None:
        out = out + v_mean.repeat_interleave(group, 1)
    out = out.permute(0, 2, 1, 3)
    return out.to(sc.out_dtype) if sc.out_dtype is not None else out


def reference(q, k, v, *, causal: bool = True) -> torch.Tensor:
    from .reference import attention_ref

    return attention_ref(q, k, v, causal=causal)


def rel_l2(out, ref) -> float:
    d = out.double() - ref.double()
    return float(d.norm() / ref.double().norm())


# ------------------------------------------------------------------------------ study

SOURCES = {  # one quantization source at a time (the others exact)
    "Q only": dict(quant_k=False, quant_v=False, p_format="exact"),
    "K only": dict(quant_q=False, quant_v=False, p_format="exact"),
    "V only": dict(quant_q=False, quant_k=False, p_format="exact"),
    "P only": dict(quant_q=False, quant_k=False, quant_v=False),
    "QK only": dict(quant_v=False, p_format="exact"),
}

LEVERS = {
    "baseline (shipped)": {},
    "a) Q smoothing + bias [kernel]": dict(smooth_q=True),
    "b) Q per-token [kernel]": dict(q_gran="token"),
    "b) K per-token [kernel]": dict(k_gran="token"),
    "c) Hadamard Q,K": dict(hadamard=True),
    "d) sink block BF16 [kernel]": dict(bf16_keys=128),
    "e) V smoothing [epilogue]": dict(smooth_v=True),
    "e) V per-block x channel [kernel]": dict(v_gran="channel_block"),
    "f) P x448": dict(p_shift=math.log2(448.0)),
    "f) l from rounded P [kernel]": dict(l_from_rounded_p=True),
    "g) two-term Q [2 MMAs]": dict(q_terms=2),
    "g) two-term K [2 MMAs]": dict(k_terms=2),
    "h) migration a=0.5": dict(migrate=0.5),
    "c+a) Hadamard + Q smoothing [kernel]": dict(hadamard=True, smooth_q=True),
    "c+g) Hadamard + two-term Q": dict(hadamard=True, q_terms=2),
    "c+g) Hadamard + two-term Q,K": dict(hadamard=True, q_terms=2, k_terms=2),
    "exact QK (floor: V,P only)": dict(quant_q=False, quant_k=False),
    "P in BF16 [kernel]": dict(p_format="bf16"),
    "c) Hadamard + P BF16 [kernel]": dict(hadamard=True, p_format="bf16"),
}

PRESET_NAMES = ("gaussian", "llama3-8b", "mistral-7b", "qwen2.5-7b", "deepseek-v3-mla")
#: every ``leanfa.activations`` preset (the ones above, then the massive-pair and per-head ones)
ALL_PRESET_NAMES = PRESET_NAMES + ("llama3-8b-massive", "mistral-7b-massive", "qwen2.5-7b-massive",
                                   "llama3-8b-heads")

#: the components of :func:`decompose`: one quantization step at a time (the others exact),
#: then all of them; every row keeps the shipped scheme's smoothing and scale granularity
COMPONENTS = {
    "Q·K scores (e4m3 Q, K)": dict(quant_v=False, p_format="exact"),
    "P (e4m3 P)": dict(quant_q=False, quant_k=False, quant_v=False),
    "V (e4m3 V)": dict(quant_q=False, quant_k=False, p_format="exact"),
    "P and V": dict(quant_q=False, quant_k=False),
    "all (shipped FP8)": {},
}


def study(seqlen: int = 1024, heads: int = 8, presets=PRESET_NAMES, levers=None, sources=True,
          seed: int = 0):
    """{preset: {row: rel_l2}} for the error sources and the levers."""
    from .activations import make_qkv

    rows = {}
    if sources:
        rows.update({f"src: {k}": v for k, v in SOURCES.items()})
    rows.update(LEVERS if levers is None else {k: LEVERS[k] for k in levers})
    result = {}
    for name in presets:
        kw = dict(heads=heads) if name != "deepseek-v3-mla" else dict(heads=heads, kv_heads=heads)
        q, k, v = make_qkv(name, 1, seqlen, seed=seed, **kw)
        ref = reference(q, k, v)
        result[name] = {r: rel_l2(emulate(q, k, v, Scheme(**kwargs)), ref) for r, kwargs in rows.items()}
    return result


def decompose(seqlen: int = 1024, heads: int = 8, presets=ALL_PRESET_NAMES, seed: int = 0):
    """{preset: {component: rel_l2 vs float64}} of :data:`COMPONENTS` (float32 output, so the
    output cast adds nothing), causal, ``make_qkv(preset, 1, seqlen, heads=heads)``
    (deepseek-v3-mla: ``heads`` KV heads too), and per preset the squared-sum check
    ``"sum of squares"`` = sqrt(QK² + P² + V²) of the single-source rows."""
    from .activations import make_qkv

    result = {}
    for name in presets:
        kw = dict(heads=heads) if name != "deepseek-v3-mla" else dict(heads=heads, kv_heads=heads)
        q, k, v = make_qkv(name, 1, seqlen, seed=seed, **kw)
        ref = reference(q, k, v)
        row = {c: rel_l2(emulate(q, k, v, Scheme(out_dtype=None, **kw2)), ref)
               for c, kw2 in COMPONENTS.items()}
        singles = list(COMPONENTS)[:3]
        row["sum of squares"] = math.sqrt(sum(row[c] ** 2 for c in singles))
        result[name] = row
    return result


def format_decomposition(result) -> str:
    """Markdown table (preset rows x component columns) of :func:`decompose`'s result."""
    cols = list(next(iter(result.values())))
    out = ["| preset | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for p, row in result.items():
        out.append(f"| {p} | " + " | ".join(f"{row[c]:.2e}" for c in cols) + " |")
    return "\n".join(out)


def format_table(result) -> str:
    presets = list(result)
    rows = list(next(iter(result.values())))
    base = {p: result[p].get("baseline (shipped)") for p in presets}
    out = ["| lever | " + " | ".join(presets) + " |", "|---|" + "---|" * len(presets)]
    for r in rows:
        cells = []
        for p in presets:
            e = result[p][r]
            rel = f" ({e / base[p]:.2f}x)" if base[p] and not r.startswith("src") else ""
            cells.append(f"{e:.2e}{rel}")
        out.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--presets", nargs="*", default=list(PRESET_NAMES))
    ap.add_argument("--levers", nargs="*", default=None)
    ap.add_argument("--no-sources", action="store_true")
    ap.add_argument("--decompose", action="store_true",
                    help="the Q·K / P / V error decomposition (docs/accuracy-notes.md) instead")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.decompose:
        presets = a.presets if a.presets != list(PRESET_NAMES) else list(ALL_PRESET_NAMES)
        print(format_decomposition(decompose(a.seqlen, a.heads, presets)))
    else:
        print(format_table(study(a.seqlen, a.heads, a.presets, a.levers, not a.no_sources)))
