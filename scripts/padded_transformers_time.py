"""transformers' attention call on a padded batch (issue 25 item 5) on a GPU: leanfa (unpad, varlen kernel, re-pad)
against transformers' SDPA attention and the unpadded leanfa call.

    python scripts/padded_transformers_time.py                  # 2 x 3000, Llama-3-8B heads (32/8, d128), causal
    python scripts/padded_transformers_time.py --batch 4 --seqlen 8192

One layer's attention call, as a model makes it (``(B, H, S, D)`` BF16 tensors, a 2-D mask with the second half of
the batch left-padded to half the length): the milliseconds of ``"leanfa"``/``"leanfa_fp8"`` with the padding
mask (a fresh mask object per call, so every call pays the one host sync of a forward's first layer; and a cached
one, what the other layers pay), ``"sdpa"`` with the equivalent 4-D mask, and ``"leanfa"`` with no mask (all
rows full length: an upper bound on the work). Then the relative L2 error of the kept rows against SDPA.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import leanfa.integrations.transformers as lt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=3000)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dev, b, s = a.device, a.batch, a.seqlen
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, h, s, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
               for h in (a.heads, a.kv_heads, a.kv_heads))
    mask = torch.ones(b, s, dtype=torch.bool, device=dev)
    mask[b // 2:, : s // 2] = False  # left padding: half of the batch holds S/2 tokens
    module = torch.nn.Module().eval()
    module.num_key_value_groups = a.heads // a.kv_heads
    module.is_causal = True
    keep = mask[:, None, None, :] & torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    keep = keep | ~keep.any(-1, keepdim=True)

    calls = {
        "sdpa (4-D mask)": lambda: sdpa_attention_forward(module, q, k, v, keep, is_causal=False)[0],
        "leanfa, no mask (every row full)": lambda: lt.ATTENTION_FUNCTIONS["leanfa"](module, q, k, v, None)[0],
    }
    for name in ("leanfa", "leanfa_fp8"):
        fn = lt.ATTENTION_FUNCTIONS[name]
        calls[f"{name}, padded, first layer (syncs)"] = lambda fn=fn: fn(module, q, k, v, mask.clone())[0]
        calls[f"{name}, padded, later layers (cached)"] = lambda fn=fn: fn(module, q, k, v, mask)[0]
    ref = calls["sdpa (4-D mask)"]().float()
    rows = mask[:, -s:]
    print(f"B={b} S={s} heads {a.heads}/{a.kv_heads} d{a.head_dim}, causal, {int(mask.sum())} kept tokens")
    for name, call in calls.items():
        ms = do_bench(call, warmup=50, rep=300)
        out = call().float()
        err = ((out[rows] - ref[rows]).norm() / ref[rows].norm()).item() if "no mask" not in name else float("nan")
        print(f"  {name:<44} {ms:8.3f} ms   rel L2 vs SDPA (kept rows) {err:.2e}")


if __name__ == "__main__":
    main()
