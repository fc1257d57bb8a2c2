"""Quick speed check on a GPU: leanfa kernels vs torch SDPA (cuDNN, flash) at a few shapes.

python scripts/quick_speed.py [--seqlens 4096,16384] — B*S = 16K tokens, 16 heads, causal d128.
(`leanfa bench` is the full measurement system; this is a smoke test for one run.)
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import leanfa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--backends", default="portable,hopper")
    args = ap.parse_args()
    rows = []
    for s in map(int, args.seqlens.split(",")):
        b, h, d = max(1, 16384 // s), 16, 128
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / 2
        qt = leanfa.quantize_fp8(q, k, v)
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        cands = {}
        for be in args.backends.split(","):
            cands[f"leanfa-{be} bf16"] = lambda be=be: leanfa.flash_attn_func(q, k, v, causal=True, backend=be)
            cands[f"leanfa-{be} fp8 (kernel)"] = lambda be=be: leanfa.flash_attn_func(qt, causal=True, backend=be)
        cands["leanfa fp8 quantize only"] = lambda: leanfa.quantize_fp8(q, k, v)

        def sdpa(backend):
            def f():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            return f
        cands["sdpa cudnn bf16"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        cands["sdpa flash bf16"] = sdpa(SDPBackend.FLASH_ATTENTION)
        for name, fn in cands.items():
            try:
                fn()
                ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
                rows.append((s, name, ms, flops / ms / 1e9))
            except Exception as e:  # report and go on
                rows.append((s, name, float("nan"), float("nan")))
                print(f"{name} S={s}: {type(e).__name__}: {str(e)[:200]}")
    print(f"{'S':>6} {'impl':<28}{'ms':>9}{'TFLOP/s':>9}")
    for s, name, ms, tf in rows:
        print(f"{s:>6} {name:<28}{ms:9.3f}{tf:9.1f}")


if __name__ == "__main__":
    main()
