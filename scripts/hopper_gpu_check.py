#!/usr/bin/env python
"""Correctness + speed check of the Hopper (Gluon, sm90) kernel, for the H200.

    python scripts/hopper_gpu_check.py              # correctness table, then timings (< 5 min)
    python scripts/hopper_gpu_check.py --no-bench   # correctness only
    python scripts/hopper_gpu_check.py --bench-only
    compute-sanitizer --tool memcheck python scripts/hopper_gpu_check.py --sanitize
    compute-sanitizer --tool racecheck python scripts/hopper_gpu_check.py --sanitize

Correctness: every case runs ``leanfa.flash_attn_func(..., backend="hopper")`` (so the
dispatcher must accept it) on a NaN-poisoned allocator, and compares with a float64 reference
of the *same* (dequantized) inputs: relative L2 error of out, max |error| of the finite LSE,
and the -inf pattern of the LSE. Timing: causal, B*S = 16K, 16 heads, against torch SDPA with
the cuDNN backend (BF16), TFLOP/s with do_bench medians and the SM clock (NVML) after each.
Every case catches its own exception and the table is printed at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("LEANFA_POISON_OUTPUTS", "1")  # correctness: outputs start as NaN (unset for timing)

import torch  # noqa: E402
import triton  # noqa: E402

import leanfa  # noqa: E402
from leanfa.bench import power  # noqa: E402

try:
    from leanfa.reference import attention_ref as _leanfa_ref  # noqa: E402
except Exception:  # noqa: BLE001
    _leanfa_ref = None

FP8 = torch.float8_e4m3fn
TOL = {"bf16": 1e-2, "fp8": 4e-2}  # rel L2 vs float64 on the same dequantized inputs
LSE_TOL = 2e-2


# ----------------------------------------------------------------------------- inputs

def quantize(q, k, v):
    """FP8 inputs and the flash_attn_func kwargs that go with them."""
    if hasattr(leanfa, "quantize_fp8"):
        qq = leanfa.quantize_fp8(q, k, v)
        return (qq.q, qq.k, qq.v), qq.descales()
    # fallback: per-tensor scales, V stored transposed (B, H, D, S_pad)
    def pt(x):
        s = (x.abs().amax().float() / 448.0).clamp(min=1e-12)
        return (x.float() / s).to(FP8), s.reshape(1)
    q8, qs = pt(q)
    k8, ks = pt(k)
    v8, vs = pt(v)
    B, S, H, D = v8.shape
    pad = -(-S // 16) * 16
    store = torch.zeros(B, H, D, pad, dtype=torch.uint8, device=v.device).view(FP8)
    store[..., :S] = v8.permute(0, 2, 3, 1)
    v8t = store.permute(0, 3, 1, 2)[:, :S]
    return (q8, k8, v8t), dict(q_descale=qs, k_descale=ks, v_descale=vs)


def quantize_broadcast(q, k, v, form):
    """FP8 Q/K with *broadcast* descales: ``form`` "tensor" (one element) or "head" ((B, Hkv)).
    These become (B, H, 1) tables in the kernel: the 2026-11-29 stride bug read them past their
    end for every key block >= 1 / query tile >= 1. V (transposed storage) from quantize_fp8."""
    qq = leanfa.quantize_fp8(q, k, v)
    Hkv = k.shape[2]

    def quant(x):
        B, H = x.shape[0], x.shape[2]
        if form == "tensor":
            d = (x.float().abs().amax() / 448.0).clamp(min=1e-12).reshape(1)
            return (x.float() / d).to(FP8), d
        d = (x.float().abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # (B, H)
        d = d.reshape(B, Hkv, H // Hkv).amax(-1)  # (B, Hkv), shared by a query-head group
        return (x.float() / d.repeat_interleave(H // Hkv, 1)[:, None, :, None]).to(FP8), d

    (q8, qd), (k8, kd) = quant(q), quant(k)
    return (q8, k8, qq.v), dict(q_descale=qd, k_descale=kd, v_descale=qq.v_descale)


def reference(q, k, v, causal, scale, q_descale=None, k_descale=None, v_descale=None, k_mean=None):
    """float64 (out, lse)."""
    if _leanfa_ref is not None:
        return _leanfa_ref(q, k, v, causal=causal, softmax_scale=scale, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, k_mean=k_mean, return_lse=True)
    # own small implementation (per-tensor descales only)
    def deq(x, d):
        x = x.double()
        return x * d.double().reshape(1, 1, 1, 1) if d is not None else x
    qd, kd, vd = deq(q, q_descale), deq(k, k_descale), deq(v, v_descale)
    B, Sq, Hq, _ = qd.shape
    Sk, Hkv = kd.shape[1], kd.shape[2]
    kd = kd.repeat_interleave(Hq // Hkv, 2)
    vd = vd.repeat_interleave(Hq // Hkv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Sk - Sq, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", p, vd)
    return out, lse


def poison_allocator(nbytes: int):
    """Leave NaN-filled blocks in the caching allocator so torch.empty returns NaNs."""
    for n in (nbytes, nbytes // 2):
        t = torch.full((max(n // 4, 1),), float("nan"), device="cuda")
        del t


# ----------------------------------------------------------------------------- correctness

def make_qkv(B, Sq, Sk, Hq, Hkv, dqk, dv, layout="bshd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.float32)  # noqa: E731
    if layout == "packed":  # q/k/v slices of one (B, S, 3, H, D) tensor: odd strides
        assert Sq == Sk and Hq == Hkv and dqk == dv
        qkv = mk(B, Sq, 3, Hq, dqk).to(torch.bfloat16)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = mk(B, Sq, Hq, dqk).to(torch.bfloat16)
    k = mk(B, Sk, Hkv, dqk).to(torch.bfloat16)
    # a few outlier channels in K (model-like), and a non-zero K mean
    k[..., :4] = k[..., :4] * 4 + 2
    v = mk(B, Sk, Hkv, dv).to(torch.bfloat16)
    if layout == "vT":  # bf16 V stored transposed
        v = v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    return q, k, v


def _with_lse_check(ok, err, msg, lse_k, ref_lse):
    """``(ok, err, lse_err, message)`` of a case, with its LSE checked against the reference's
    (the same -inf pattern, finite entries within LSE_TOL); ``ref_lse`` None: no LSE asked for."""
    lse_err = float("nan")
    if ref_lse is not None:
        fin = torch.isfinite(ref_lse)
        same_inf = bool(torch.equal(torch.isinf(lse_k), ~fin))
        lse_err = float((lse_k.double() - ref_lse)[fin].abs().max()) if bool(fin.any()) else 0.0
        if not same_inf:
            msg.append("LSE -inf pattern differs")
        ok = ok and same_inf and lse_err < LSE_TOL
    return ok, err, lse_err, "; ".join(msg)


def run_case(dtype, B, Sq, Sk, Hq, Hkv, dqk, dv, causal, lse, layout="bshd", descale="block", repeat=False):
    q, k, v = make_qkv(B, Sq, Sk, Hq, Hkv, dqk, dv, layout)
    scale = dqk ** -0.5
    kw = {}
    if dtype == "fp8":
        (q, k, v), kw = quantize(q, k, v) if descale == "block" else quantize_broadcast(q, k, v, descale)
    poison_allocator(B * Sq * Hq * dv * 4)
    res = leanfa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=lse,
                                 backend="hopper", **kw)
    torch.cuda.synchronize()
    out, lse_k = (res if lse else (res, None))
    racy = False
    if repeat:  # a race (slot reuse, phase) rarely gives the same wrong bits twice
        for _ in range(3):
            again = leanfa.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=lse,
                                           backend="hopper", **kw)
            again = again[0] if lse else again
            racy = racy or not torch.equal(again.view(torch.uint8), out.view(torch.uint8))
    ref_out, ref_lse = reference(q, k, v, causal, scale, **kw)
    o = out.double()
    nan = bool(torch.isnan(o).any())
    err = float((o - ref_out).norm() / ref_out.norm().clamp(min=1e-30))
    msg = []
    ok = not nan and err < TOL[dtype]
    if ref_out.norm() == 0:  # every row masked: out must be exactly 0
        err = float(o.abs().max())
        ok = not nan and err == 0.0
    if nan:
        msg.append("NaN in out")
    if racy:
        msg.append("NOT DETERMINISTIC (race?)")
        ok = False
    return _with_lse_check(ok, err, msg, lse_k, ref_lse if lse else None)


def run_varlen_case(dtype, lens_q, lens_k, Hq, Hkv, dqk, dv, causal, lse):
    """Packed varlen through ``flash_attn_varlen_func`` on the Hopper kernel (FP8: ``quantize_fp8``'s
    transposed V, which the plan re-packs to 16-token sequence starts), each sequence against the
    float64 reference; outputs poisoned first."""
    from leanfa.reference import attention_ref

    cu_q = torch.tensor([0] + list(lens_q), device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + list(lens_k), device="cuda").cumsum(0).to(torch.int32)
    q, k, v = make_qkv(1, sum(lens_q), sum(lens_k), Hq, Hkv, dqk, dv)
    q, k, v = q[0], k[0], v[0]
    cu = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    args = (leanfa.quantize_fp8(q, k, v, **cu), None, None) if dtype == "fp8" else (q, k, v)
    poison_allocator(sum(lens_q) * Hq * dv * 4)
    res = leanfa.flash_attn_varlen_func(*args, **cu, causal=causal, return_lse=lse, backend="hopper")
    torch.cuda.synchronize()
    out, lse_k = (res if lse else (res, None))
    ref, ref_lse = attention_ref(*args, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal, return_lse=True)
    nan = bool(torch.isnan(out).any())
    errs = []
    for i in range(len(lens_q)):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        r = ref[rows]
        if lens_q[i] and r.norm() > 0:
            errs.append(float((out[rows].double() - r).norm() / r.norm()))
    err = max(errs, default=0.0)
    ok, msg = not nan and err < TOL[dtype], ["NaN in out"] if nan else []
    return _with_lse_check(ok, err, msg, lse_k, ref_lse if lse else None)


def _case_name(c):
    if "lens_q" in c:
        return "{} varlen q{} k{} H{}/{} d{}/{} {}{}".format(  # (no spaces in a field: see compact_table)
            c["dtype"], ",".join(map(str, c["lens_q"])), ",".join(map(str, c["lens_k"])), c["Hq"], c["Hkv"],
            c["dqk"], c["dv"],
            "causal" if c["causal"] else "full", " lse" if c["lse"] else "")
    return "{} B{} Sq{} Sk{} H{}/{} d{}/{} {}{}{}{}{}".format(
        c["dtype"], c["B"], c["Sq"], c["Sk"], c["Hq"], c["Hkv"], c["dqk"], c["dv"],
        "causal" if c["causal"] else "full", " lse" if c["lse"] else "",
        "" if c.get("layout", "bshd") == "bshd" else " " + c["layout"],
        "" if c.get("descale", "block") == "block" else " desc=" + c["descale"],
        " x4" if c.get("repeat") else "")


def correctness(cases):
    rows = []
    t0 = time.time()
    for c in cases:
        name = _case_name(c)
        try:
            ok, err, lerr, msg = run_varlen_case(**c) if "lens_q" in c else run_case(**c)
            rows.append((name, "PASS" if ok else "FAIL", err, lerr, msg))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=3)
            rows.append((name, "ERROR", float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:150]}"))
        print(f"{rows[-1][1]:5s} {name:55s} relL2={rows[-1][2]:.3e} lse_err={rows[-1][3]:.2e} {rows[-1][4]}",
              flush=True)
    print(f"[correctness: {len(rows)} cases in {time.time() - t0:.0f}s]")
    return rows


def _dims_from_env():
    """``LEANFA_CHECK_DIMS`` (e.g. ``256/256``, comma-separated): check only these head dims (their grid
    and varlen cases), e.g. a new head dim in a step of its own; unset: every dims of the kernel."""
    spec = os.environ.get("LEANFA_CHECK_DIMS", "").strip()
    return tuple(tuple(int(x) for x in d.split("/")) for d in spec.split(",")) if spec else None


def default_cases(small=False):
    """The check's cases; ``LEANFA_CHECK_DTYPES`` (e.g. ``fp8``) keeps only those input dtypes (a change
    that only the FP8 path sees, e.g. the TMA-store epilogue, in a step of its own)."""
    dtypes = [d.strip() for d in os.environ.get("LEANFA_CHECK_DTYPES", "").split(",") if d.strip()]
    cases = _all_cases(small)
    return [c for c in cases if c["dtype"] in dtypes] if dtypes else cases


def _all_cases(small):
    shapes = [  # B, Sq, Sk, Hq, Hkv
        (1, 1, 1, 4, 4), (2, 100, 100, 8, 2), (1, 128, 128, 4, 4), (2, 1000, 1000, 8, 8),
        (1, 100, 1000, 4, 2), (1, 1000, 100, 8, 8), (1, 4096, 4096, 8, 2), (2, 129, 4096, 4, 1),
        (1, 4096, 1000, 4, 4), (1, 1, 4096, 8, 2),
    ]
    if small:
        shapes = [(1, 1, 1, 4, 4), (2, 100, 100, 8, 2), (1, 129, 300, 4, 2), (1, 300, 129, 4, 4)]
    cases = []
    only = _dims_from_env()
    # 256/256 has its own step (gpu_session.sh d256_check: LEANFA_CHECK_DIMS=256/256), since with it the full
    # set would outrun the check's time limit
    dims = only or ((128, 128), (192, 128), (64, 64))
    for dtype in ("bf16", "fp8"):
        for dqk, dv in dims:
            for causal in (True, False):
                for i, (B, Sq, Sk, Hq, Hkv) in enumerate(shapes):
                    cases.append(dict(dtype=dtype, B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, dqk=dqk, dv=dv,
                                      causal=causal, lse=(i % 2 == 0)))
    if only:
        return cases + _varlen_cases(small, only)
    cases.append(dict(dtype="bf16", B=2, Sq=1000, Sk=1000, Hq=4, Hkv=4, dqk=128, dv=128, causal=True,
                      lse=True, layout="packed"))
    cases.append(dict(dtype="bf16", B=2, Sq=1000, Sk=1000, Hq=8, Hkv=2, dqk=128, dv=128, causal=True,
                      lse=True, layout="vT"))
    # FP8 with broadcast descales (one element / per (batch, kv head)), several tiles and key blocks
    for descale in ("tensor", "head"):
        for dqk in (128, 192):
            cases.append(dict(dtype="fp8", B=2, Sq=700, Sk=1500, Hq=4, Hkv=2, dqk=dqk, dv=128, causal=True,
                              lse=True, descale=descale))
    # repeat runs, bitwise: races in the K/V ring show up as run-to-run differences
    for dtype in ("bf16", "fp8"):
        for dqk in (128, 192):
            cases.append(dict(dtype=dtype, B=1, Sq=4096, Sk=4096, Hq=8, Hkv=2, dqk=dqk, dv=128, causal=False,
                              lse=False, repeat=True))
    cases += _varlen_cases(small, ((128, 128), ))
    if small:
        cases = [c for c in cases if not c.get("repeat")]
    return cases


def _varlen_cases(small, dims):
    """Packed varlen (FP8: V re-packed by the plan to 16-token sequence starts); these lengths start
    most sequences off a 16-token boundary, include an empty one, and tiles that straddle the next."""
    varlen = [([1, 130, 0, 300, 77], [5, 130, 3, 300, 77]), ([700, 129], [1300, 517])]
    if small:
        varlen = varlen[:1]
    return [dict(dtype=dtype, lens_q=lens_q, lens_k=lens_k, Hq=4, Hkv=2, dqk=dqk, dv=dv, causal=causal, lse=True)
            for dtype in ("bf16", "fp8") for dqk, dv in dims for lens_q, lens_k in varlen for causal in (True, False)]


def compact_table(rows):
    """One line per shape, one column per dtype/dims/mask: P(ass) F(ail) E(rror)."""
    cols, table = [], {}
    for name, st, *_ in rows:
        parts = name.split(" ")
        col = " ".join([parts[0], parts[5], parts[6]])  # dtype dims causal/full
        shape = " ".join(parts[1:5] + parts[7:])  # B Sq Sk H + extras
        shape = shape.replace(" lse", "")
        if col not in cols:
            cols.append(col)
        table.setdefault(shape, {})[col] = st[0]
    w = max(len(s) for s in table) + 1
    print(" " * w + " ".join(f"{i:>2d}" for i in range(len(cols))))
    for shape, r in table.items():
        print(f"{shape:{w}s}" + " ".join(f"{r.get(c, '.'):>2s}" for c in cols))
    print("columns: " + ", ".join(f"{i}={c}" for i, c in enumerate(cols)))


# ----------------------------------------------------------------------------- speed

def bench(fn):
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return ms, power.sm_clock_mhz(torch.cuda.current_device())


def timings():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for S in (4096, 16384):
        B, H = 16384 // S, 16
        for dqk, dv in ((128, 128), (192, 128)):
            flops = 2 * B * H * S * S * (dqk + dv) / 2
            q, k, v = make_qkv(B, S, S, H, H, dqk, dv)
            scale = dqk ** -0.5
            entries = {}
            try:
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                        qt, kt, vt, is_causal=True, scale=scale)
                    entries["cudnn-bf16"] = bench(f)
            except Exception as e:  # noqa: BLE001
                entries["cudnn-bf16"] = (float("nan"), f"{type(e).__name__}")
            for dtype in ("bf16", "fp8"):
                try:
                    if dtype == "fp8":
                        (q8, k8, v8), kw = quantize(q, k, v)
                        f = lambda: leanfa.flash_attn_func(q8, k8, v8, softmax_scale=scale,  # noqa: E731
                                                           causal=True, backend="hopper", **kw)
                    else:
                        f = lambda: leanfa.flash_attn_func(q, k, v, softmax_scale=scale,  # noqa: E731
                                                           causal=True, backend="hopper")
                    entries[f"hopper-{dtype}"] = bench(f)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc(limit=2)
                    entries[f"hopper-{dtype}"] = (float("nan"), f"{type(e).__name__}: {str(e)[:80]}")
            base = entries["cudnn-bf16"][0]
            for name, (ms, clk) in entries.items():
                tf = flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
                ratio = base / ms if (ms == ms and base == base) else float("nan")
                rows.append((f"S{S} B{B} H{H} d{dqk}/{dv} causal", name, ms, tf, ratio, clk))
                print(f"{rows[-1][0]:28s} {name:12s} {ms:8.3f} ms {tf:7.1f} TFLOP/s  x{ratio:4.2f} vs cuDNN bf16  "
                      f"clk={clk}", flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--sanitize", action="store_true", help="few small cases, no timing (compute-sanitizer)")
    a = ap.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    print(f"device {torch.cuda.get_device_name()} cap {torch.cuda.get_device_capability()} torch {torch.__version__} "
          f"triton {triton.__version__}")
    from leanfa.kernels import hopper
    print("hopper module:", hopper.__file__)
    rows, trows = [], []
    t0 = time.time()
    if not a.bench_only:
        rows = correctness(default_cases(small=a.sanitize))
    if not (a.no_bench or a.sanitize):
        os.environ["LEANFA_POISON_OUTPUTS"] = "0"
        trows = timings()
    print("\n==================== summary ====================")
    if rows:
        compact_table(rows)
    for name, st, err, lerr, msg in rows:
        if st != "PASS":
            print(f"{st:5s} {name:55s} relL2={err:.3e} lse_err={lerr:.2e} {msg}")
    if rows:
        npass = sum(r[1] == "PASS" for r in rows)
        worst = {}
        for name, st, err, _, _ in rows:
            key = name.split(" ")[0] + " " + name.split(" ")[5]
            if err == err:
                worst[key] = max(worst.get(key, 0.0), err)
        print(f"correctness: {npass}/{len(rows)} PASS; worst relL2 by dtype/dims: "
              + ", ".join(f"{k}={v:.2e}" for k, v in sorted(worst.items())))
    for r in trows:
        print(f"{r[0]:28s} {r[1]:12s} {r[2]:8.3f} ms {r[3]:7.1f} TFLOP/s  x{r[4]:4.2f}  clk={r[5]}")
    print(f"total {time.time() - t0:.0f}s")
    return 0 if all(r[1] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
