"""The mixed mode (``attention(precision="fp8qk")``, issue 24 item 5) on a GPU: speed and error against FP8 and BF16.

    python scripts/mixed_time.py                      # d128 and MLA 192/128, S = 4K and 16K, causal
    python scripts/mixed_time.py --seqlens 16384 --dims 128/128

Per shape (B*S = 16K tokens, 16 query heads, GQA 4:1 like ``leanfa bench``'s Llama shape; MLA 16/16): the kernel alone
(inputs quantized once) and end to end (``leanfa.attention``, quantizer included) for ``bf16``, ``fp8`` and
``fp8qk``, in TFLOP/s (causal FLOP), each with the kernel :func:`leanfa.kernels.dispatch.choose` picked and the
ratio to BF16; then the relative L2 error of each precision against the float64 reference on the activation
presets (S = 4096) and on diffuse attention. The issue's targets: fp8qk error <= 0.5x fp8's, speed >= 1.25x
BF16's at 16K. (`leanfa bench` is the full measurement system; this is the first look.)
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import leanfa
from leanfa import api
from leanfa.activations import make_qkv
from leanfa.kernels import dispatch
from leanfa.reference import attention_ref

PRECISIONS = ("bf16", "fp8", "fp8qk")


def _kernel_call(q, k, v, precision):
    """A zero-argument call of the kernel alone (inputs prepared here), and the dispatcher's choice for it."""
    if precision == "bf16":
        args = (q, k, v)
        kw = {}
    else:
        quant = leanfa.quantize_fp8(q, k, v, quantize_v=precision == "fp8")
        args, kw = (quant.q, quant.k, quant.v), dict(q_descale=quant.q_descale, k_descale=quant.k_descale,
                                                    v_descale=quant.v_descale, k_mean=quant.k_mean)
    p = api._build_problem(*args, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, softmax_scale=None, causal=True, return_lse=False, out_dtype=None,
                           **{n: kw.get(n) for n in ("q_descale", "k_descale", "v_descale", "k_mean")})
    return (lambda: leanfa.flash_attn_func(*args, causal=True, **kw)), dispatch.choose(p, "auto").kernel


def speed(seqlens, dims_list):
    print(f"{'shape':<22}{'precision':<8}{'kernel':>10}{'kernel TF/s':>13}{'x bf16':>8}{'e2e TF/s':>10}{'x bf16':>8}")
    for dqk, dv in dims_list:
        for s in seqlens:
            b = max(1, 16384 // s)
            hq, hkv = (16, 16) if dqk == 192 else (16, 4)
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, s, hq, dqk, device="cuda", generator=g).to(torch.bfloat16)
            k = torch.randn(b, s, hkv, dqk, device="cuda", generator=g).to(torch.bfloat16)
            v = torch.randn(b, s, hkv, dv, device="cuda", generator=g).to(torch.bfloat16)
            flops = 2 * b * hq * s * s * (dqk + dv) / 2
            base = {}
            for prec in PRECISIONS:
                kern, which = _kernel_call(q, k, v, prec)
                e2e = (lambda prec=prec: leanfa.attention(q, k, v, causal=True, precision=prec))
                t = [flops / do_bench(f, warmup=50, rep=300, return_mode="median") / 1e9 for f in (kern, e2e)]
                base.setdefault("k", t[0])
                base.setdefault("e", t[1])
                print(f"{f'd{dqk}/{dv} S={s} B={b}':<22}{prec:<8}{which:>10}{t[0]:13.1f}{t[0] / base['k']:8.2f}"
                      f"{t[1]:10.1f}{t[1] / base['e']:8.2f}")


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def accuracy(seqlen):
    print(f"\n{'inputs (S=%d, causal)' % seqlen:<34}" + "".join(f"{p:>10}" for p in PRECISIONS) + f"{'fp8qk/fp8':>11}")
    cases = [(name, lambda name=name: make_qkv(name, 1, seqlen, heads=16, seed=0, device="cuda"))
             for name in ("gaussian", "llama3-8b", "qwen2.5-7b", "deepseek-v3-mla", "llama3-8b-massive",
                          "llama3-8b-heads")]

    def diffuse():
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, seqlen, 16, 128, device="cuda", generator=g) * 0.05
        k = torch.randn(1, seqlen, 4, 128, device="cuda", generator=g) + 0.5
        v = torch.randn(1, seqlen, 4, 128, device="cuda", generator=g)
        return tuple(t.to(torch.bfloat16) for t in (q, k, v))
    cases.append(("diffuse (q x 0.05)", diffuse))
    for name, make in cases:
        q, k, v = make()
        ref = attention_ref(q, k, v, causal=True)
        err = {p: _rel(leanfa.attention(q, k, v, causal=True, precision=p), ref) for p in PRECISIONS}
        print(f"{name:<34}" + "".join(f"{err[p]:10.3e}" for p in PRECISIONS) + f"{err['fp8qk'] / err['fp8']:11.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--dims", default="128/128,192/128")
    ap.add_argument("--accuracy-seqlen", type=int, default=4096)
    a = ap.parse_args()
    speed([int(s) for s in a.seqlens.split(",")], [tuple(map(int, d.split("/"))) for d in a.dims.split(",")])
    accuracy(a.accuracy_seqlen)


if __name__ == "__main__":
    main()
