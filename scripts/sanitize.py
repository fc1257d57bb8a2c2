#!/usr/bin/env python
"""Memory safety on the GPU: compute-sanitizer memcheck, racecheck, synccheck (and initcheck)
over a tiny representative workload: the portable kernel (odd lengths, varlen with empty and
length-1 sequences, GQA/MQA, bf16/fp16/fp8, causal or not, head dims 64..256), the FP8
quantizer (dense and varlen, every granularity), and the Hopper kernel (backend="hopper",
128/128 and 192/128, bf16 and FP8) where it applies.

    python scripts/sanitize.py             # all tools, one summary line each; exit 1 on errors
    python scripts/sanitize.py --tools memcheck racecheck
    python scripts/sanitize.py --workload  # the workload alone (what runs under each tool)

The workload first runs once without a sanitizer to fill Triton's compile cache, so the
sanitized runs launch cached kernels only (and small shapes use a fixed tile: no autotuning
sweep runs under a sanitizer, see AUTOTUNE_MIN_WORK). PyTorch's caching allocator is turned off
under the sanitizer (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so an out-of-bounds access inside a
cached segment is still caught. Every output is poisoned with NaN (LEANFA_POISON_OUTPUTS=1) and
checked for unwritten elements. Expected total: ~2-4 minutes on an H200.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")


def workload() -> int:
    os.environ["LEANFA_POISON_OUTPUTS"] = "1"
    sys.path.insert(0, ROOT)
    import torch

    import leanfa
    from leanfa.api import _build_problem
    from leanfa.kernels import dispatch

    dev = "cuda"
    bad = []

    def rnd(*shape, dtype=torch.bfloat16, seed=0):
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    def check(name, out):
        outs = out if isinstance(out, tuple) else (out,)
        torch.cuda.synchronize()
        for o in outs:
            if o is not None and torch.isnan(o).any():
                bad.append(f"{name}: NaN in output (unwritten elements)")
        print(f"  {name}", flush=True)

    def dense(b, sq, sk, hq, hkv, dqk, dv, dtype=torch.bfloat16, seed=0):
        return rnd(b, sq, hq, dqk, dtype=dtype, seed=seed), rnd(b, sk, hkv, dqk, dtype=dtype, seed=seed + 1), \
            rnd(b, sk, hkv, dv, dtype=dtype, seed=seed + 2)

    # --- portable kernel
    cases = [  # (B, Sq, Sk, Hq, Hkv, Dqk, Dv, dtype, causal)
        (1, 77, 77, 4, 2, 128, 128, torch.bfloat16, True),
        (2, 33, 90, 2, 1, 64, 64, torch.float16, False),
        (1, 90, 33, 3, 1, 192, 128, torch.bfloat16, True),  # Sq > Sk: masked rows, MQA
        (1, 1, 65, 2, 2, 256, 256, torch.bfloat16, False),
    ]
    for b, sq, sk, hq, hkv, dqk, dv, dt, causal in cases:
        q, k, v = dense(b, sq, sk, hq, hkv, dqk, dv, dt)
        check(f"portable {dt} {b}x{sq}x{sk} h{hq}/{hkv} d{dqk}/{dv} causal={causal}",
              leanfa.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="portable"))
    # strided (heads-major) inputs
    base = rnd(1, 4, 61, 3 * 128)
    q, k, v = (base[..., i * 128:(i + 1) * 128].transpose(1, 2) for i in range(3))
    check("portable strided", leanfa.flash_attn_func(q, k, v, causal=True, backend="portable"))
    # varlen, GQA, empty and length-1 sequences
    lq, lk = [5, 0, 1, 70, 33], [9, 3, 1, 70, 0]
    cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q, k, v = rnd(sum(lq), 4, 128), rnd(sum(lk), 2, 128, seed=1), rnd(sum(lk), 2, 128, seed=2)
    for causal in (False, True):
        check(f"portable varlen bf16 causal={causal}",
              leanfa.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_lse=True,
                                            backend="portable"))
    # --- quantizer (+ the FP8 portable kernel on its output)
    for gran in ("block", "head", "tensor"):
        q, k, v = dense(2, 150, 131, 4, 2, 128, 128, seed=3)
        quant = leanfa.quantize_fp8(q, k, v, granularity=gran, smooth_k=gran != "tensor")
        check(f"quantize dense {gran}", (quant.q.float(), quant.k.float(), quant.v.float()))
        check(f"portable fp8 {gran} causal",
              leanfa.flash_attn_func(quant, causal=True, return_lse=True, backend="portable"))
    qv = leanfa.quantize_fp8(rnd(sum(lq), 4, 128), rnd(sum(lk), 2, 128, seed=1),
                             rnd(sum(lk), 2, 128, seed=2), cu_seqlens_q=cq, cu_seqlens_k=ck,
                             max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    check("quantize varlen", (qv.q.float(), qv.k.float(), qv.v[: sum(lk)].float()))
    check("portable fp8 varlen", leanfa.flash_attn_varlen_func(qv, None, None, cq, ck, max(lq), max(lk),
                                                               causal=True, return_lse=True, backend="portable"))
    q, k, v = dense(1, 45, 70, 2, 1, 192, 128, seed=4)
    check("portable fp8 d192 MQA", leanfa.attention(q, k, v, causal=False, precision="fp8", backend="portable"))
    # raw FP8 with per-head and per-channel descales, token-major V
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in dense(2, 40, 50, 4, 2, 64, 64, torch.float32, seed=5))
    check("portable raw fp8 descales", leanfa.flash_attn_func(
        q8, k8, v8, q_descale=torch.full((2, 2), 0.5, device=dev), k_descale=torch.tensor(0.25, device=dev),
        v_descale=torch.full((2, 2, 64), 0.1, device=dev), causal=True, backend="portable"))
    # --- Hopper kernel, where it applies
    kw = dict(varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
              softmax_scale=None, q_descale=None, k_descale=None, v_descale=None, k_mean=None,
              return_lse=True, out_dtype=None)
    for b, sq, sk, hq, hkv, dqk, dv, causal in [(1, 200, 200, 2, 2, 128, 128, True),
                                                 (2, 130, 300, 4, 2, 128, 128, False),
                                                 (1, 300, 129, 2, 1, 192, 128, True)]:
        q, k, v = dense(b, sq, sk, hq, hkv, dqk, dv, seed=6)
        ok, why = dispatch.hopper_applies(_build_problem(q, k, v, causal=causal, **kw))
        if not ok:
            print(f"  hopper skipped: {why}", flush=True)
            break
        check(f"hopper bf16 {b}x{sq}x{sk} d{dqk} causal={causal}",
              leanfa.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="hopper"))
        quant = leanfa.quantize_fp8(q, k, v)
        check(f"hopper fp8 {b}x{sq}x{sk} d{dqk} causal={causal}",
              leanfa.flash_attn_func(quant, causal=causal, return_lse=True, backend="hopper"))
    torch.cuda.synchronize()
    for b in bad:
        print("UNWRITTEN:", b, flush=True)
    print(f"workload done, {len(bad)} poisoned outputs", flush=True)
    return 1 if bad else 0


def find_sanitizer() -> str | None:
    for cand in (shutil.which("compute-sanitizer"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer"),
                 "/usr/local/cuda/bin/compute-sanitizer"):
        if cand and os.path.exists(cand):
            return cand
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", action="store_true", help="run the workload only")
    ap.add_argument("--tools", nargs="*", default=list(TOOLS), choices=TOOLS)
    ap.add_argument("--timeout", type=float, default=150.0, help="per tool, seconds")
    args = ap.parse_args()
    if args.workload:
        sys.exit(workload())
    san = find_sanitizer()
    if san is None:
        sys.exit("compute-sanitizer not found (set CUDA_HOME or put it on PATH)")
    me = [sys.executable, os.path.abspath(__file__), "--workload"]
    env = dict(os.environ, LEANFA_POISON_OUTPUTS="1")
    t = time.time()
    warm = subprocess.run(me, env=env, capture_output=True, text=True)
    print(f"warm-up (no sanitizer, fills the Triton cache): rc={warm.returncode} [{time.time() - t:.0f} s]", flush=True)
    if warm.returncode:
        print(warm.stdout[-3000:], warm.stderr[-3000:])
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    failed = bool(warm.returncode)
    summary = []
    for tool in args.tools:
        cmd = [san, "--tool", tool, "--print-limit", "20", "--error-exitcode", "99"]
        if tool == "initcheck":
            cmd += ["--track-unused-memory", "no"]
        t = time.time()
        try:
            r = subprocess.run(cmd + me, env=env, capture_output=True, text=True, timeout=args.timeout)
            text = r.stdout + r.stderr
            rc = r.returncode
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout"
        # memcheck/synccheck/initcheck print "ERROR SUMMARY: N errors"; racecheck prints
        # "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
        m = re.findall(r"ERROR SUMMARY: (\d+) error", text) or re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", text)
        line = f"{tool:<10} ERROR SUMMARY: {m[-1] + ' errors' if m else 'n/a'}  rc={rc}  [{time.time() - t:.0f} s]"
        print(line, flush=True)
        summary.append(line)
        bad = (not m) or int(m[-1]) > 0 or rc not in (0,)
        if bad:
            failed = True
            errs = [ln for ln in text.splitlines() if "=========" in ln or "UNWRITTEN" in ln or "Error" in ln]
            print("\n".join(errs[:60]) or text[-4000:], flush=True)
    print("\n" + "\n".join(summary))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
