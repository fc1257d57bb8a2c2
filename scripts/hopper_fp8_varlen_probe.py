#!/usr/bin/env python
"""Why does FP8 varlen crash the v3 Hopper kernel ("illegal instruction", H200 run 15)?

Suspected: FP8 V is stored transposed (tokens innermost), so the TMA box of key block j of
sequence b starts at token ``cu_seqlens_k[b] + 128 j`` -- a byte offset that is not 16-aligned
unless the sequence starts on a multiple of 16 tokens. Each case runs in its own process (a crash
loses the CUDA context) with the Hopper kernel forced (LEANFA_HOPPER_FP8_VARLEN=1):
sequence lengths that are all multiples of 16 (aligned starts) against ones that are not.

    python scripts/hopper_fp8_varlen_probe.py
"""

from __future__ import annotations

import os
import subprocess
import sys

CASES = {"aligned starts": [256, 128, 512, 64], "unaligned starts": [250, 130, 517, 63]}


def child(lens):
    import torch

    import leanfa
    from leanfa.reference import attention_ref

    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lens), 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    quant = leanfa.quantize_fp8(q, k, v, **kw)
    out = leanfa.flash_attn_varlen_func(quant, None, None, **kw, causal=True, backend="hopper")
    torch.cuda.synchronize()
    ref = attention_ref(quant, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    err = float((out.double() - ref).norm() / ref.norm())
    print(f"relative L2 {err:.3e}", "PASS" if err < 4e-2 else "WRONG")
    return 0 if err < 4e-2 else 1


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        return child([int(x) for x in sys.argv[2].split(",")])
    env = dict(os.environ, LEANFA_HOPPER_FP8_VARLEN="1")
    for name, lens in CASES.items():
        r = subprocess.run([sys.executable, __file__, "--child", ",".join(map(str, lens))], env=env,
                           capture_output=True, text=True, timeout=300)
        tail = (r.stdout + r.stderr).strip().splitlines()
        print(f"{name:18s} lens {lens}: rc={r.returncode} {tail[-1] if tail else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
