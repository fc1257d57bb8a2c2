"""The Hopper kernel with the serving features off, against an earlier commit's kernel on the same calls (GPU).

    python scripts/features_off_time.py --make-old COMMIT DIR     # on a machine with the git history
    python scripts/features_off_time.py --old DIR [--rounds 7]    # on the GPU

Issue 25's target "features off: no change in the speed of any existing row (<= 1 %)". Sliding windows, paged
K/V and softcap added constexprs, arguments and branches to the Hopper kernel; with them off, its calls must
run as fast as before. ``--make-old`` writes the package of ``COMMIT`` into ``DIR/leanfa_old`` (absolute
``leanfa`` imports renamed), so both builds run in one process on the same inputs. Each row is the kernel's
launch alone (plans built once, inputs quantized beforehand for FP8): the outputs of the two builds are
compared first (they should be bit-equal), then timed in interleaved rounds (``triton.testing.do_bench``,
median of each round); the ratio is old time / new time per round, its median reported with the SM clock.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import subprocess
import sys

IMPORT = re.compile(r"\b(from|import) leanfa\b")


def make_old(commit: str, out_dir: str) -> None:
    """``git archive`` of ``leanfa/`` at ``commit`` into ``out_dir/leanfa_old``, its absolute imports renamed."""
    os.makedirs(out_dir, exist_ok=True)
    tar = subprocess.run(["git", "archive", commit, "leanfa"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out_dir], input=tar, check=True)
    root = os.path.join(out_dir, "leanfa_old")
    if os.path.exists(root):
        subprocess.run(["rm", "-rf", root], check=True)
    os.rename(os.path.join(out_dir, "leanfa"), root)
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                text = open(path).read()
                open(path, "w").write(IMPORT.sub(r"\1 leanfa_old", text))
    with open(os.path.join(root, "COMMIT"), "w") as f:
        f.write(commit + "\n")


#: (name, dtype, batch shape, heads q/kv, head dims qk/v, causal). ``B x S`` dense; ``varlen:L1/L2/...`` packed.
ROWS = (
    ("fp8 d128 causal 4x4K", "fp8", "4x4096", (32, 8), (128, 128), True),
    ("fp8 d128 causal 1x16K", "fp8", "1x16384", (32, 8), (128, 128), True),
    ("fp8 d128 full 2x8K", "fp8", "2x8192", (32, 8), (128, 128), False),
    ("fp8 mla 192/128 causal 1x16K", "fp8", "1x16384", (16, 16), (192, 128), True),
    ("fp8 d64 causal 4x8K", "fp8", "4x8192", (16, 16), (64, 64), True),
    ("fp8 d128 varlen serving", "fp8", "varlen:4096/1024/2048/512/8192/256/3000", (32, 8), (128, 128), True),
    ("bf16 d128 causal 4x4K", "bf16", "4x4096", (32, 8), (128, 128), True),
    ("bf16 d128 causal 1x16K", "bf16", "1x16384", (32, 8), (128, 128), True),
    ("bf16 d256 causal 2x8K", "bf16", "2x8192", (16, 16), (256, 256), True),
    ("bf16 d128 varlen serving", "bf16", "varlen:4096/1024/2048/512/8192/256/3000", (32, 8), (128, 128), True),
)


def build_call(pkg, dtype, q, k, v, causal, cu=None, s=None):
    """``(launch, out)``: the Hopper kernel's launch of one call built with package ``pkg`` (``leanfa`` or
    ``leanfa_old``)."""
    api = importlib.import_module(pkg + ".api")
    hopper = importlib.import_module(pkg + ".kernels.hopper")
    varlen = cu is not None
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s) if varlen else {}
    descales = {"q_descale": None, "k_descale": None, "v_descale": None, "k_mean": None}
    if dtype == "fp8":
        quant = importlib.import_module(pkg).quantize_fp8(q, k, v, **kw)
        q, k, v = quant.q, quant.k, quant.v
        descales.update(quant.descales())
    extra = {}
    if varlen:
        extra["scheduler_metadata"] = importlib.import_module(pkg).varlen_schedule(q, cu, cu, s, s, causal=causal)
    problem = api._build_problem(q, k, v, varlen=varlen, softmax_scale=None, causal=causal, return_lse=False,
                                 out_dtype=None, **{"cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None,
                                                    "max_seqlen_k": None, **kw}, **descales, **extra)
    ok, why = hopper.supports(problem)
    if not ok:
        raise RuntimeError(f"{pkg}: the Hopper kernel refuses the call: {why}")
    plan, out, _ = hopper.plan(problem)
    return (lambda: hopper._launch.launch(plan)), out


def inputs(shape, heads, dims, seed):
    import torch

    hq, hkv = heads
    dqk, dv = dims
    g = torch.Generator(device="cuda").manual_seed(seed)
    if shape.startswith("varlen:"):
        lens = [int(x) for x in shape.split(":")[1].split("/")]
        total, cu = sum(lens), torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        dims_q, dims_k, dims_v, s = (total, hq, dqk), (total, hkv, dqk), (total, hkv, dv), max(lens)
        flops_pairs = sum(n * n for n in lens)
    else:
        b, n = map(int, shape.split("x"))
        dims_q, dims_k, dims_v, cu, s = (b, n, hq, dqk), (b, n, hkv, dqk), (b, n, hkv, dv), None, None
        flops_pairs = b * n * n
    q, k, v = (torch.randn(*d, device="cuda", generator=g).to(torch.bfloat16) for d in (dims_q, dims_k, dims_v))
    k += 0.5 * torch.randn(dqk, device="cuda", generator=g).to(torch.bfloat16)  # a per-channel K bias
    return q, k, v, cu, s, 2 * flops_pairs * hq * (dqk + dv)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-old", nargs=2, metavar=("COMMIT", "DIR"))
    ap.add_argument("--old", help="folder holding leanfa_old")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if args.make_old:
        make_old(*args.make_old)
        return
    sys.path.insert(0, args.old)
    import torch
    from triton.testing import do_bench

    from leanfa.bench import power

    old_commit = open(os.path.join(args.old, "leanfa_old", "COMMIT")).read().strip()
    print(f"device {torch.cuda.get_device_name()}  old {old_commit}  rounds {args.rounds}")
    print(f"{'row':32s} {'old ms':>8s} {'new ms':>8s} {'new/old speed':>13s} {'min':>6s} {'max':>6s} "
          f"{'TF/s new':>8s} {'max|diff|':>9s} {'SM MHz':>6s}")
    worst = 1.0
    for i, (name, dtype, shape, heads, dims, causal) in enumerate(ROWS):
        q, k, v, cu, s, flops = inputs(shape, heads, dims, seed=1000 + i)
        flops = flops / 2 if causal else flops
        calls = {}
        for pkg in ("leanfa_old", "leanfa"):
            launch, out = build_call(pkg, dtype, q, k, v, causal, cu, s)
            out.fill_(float("nan"))
            launch()
            torch.cuda.synchronize()
            calls[pkg] = (launch, out)
        a, b = calls["leanfa_old"][1].float(), calls["leanfa"][1].float()
        if not torch.isfinite(b).all():
            raise RuntimeError(f"{name}: the new build left non-finite outputs")
        diff = (a - b).abs().max().item()
        ratios, t_old, t_new = [], [], []
        for _ in range(args.rounds):
            to = do_bench(calls["leanfa_old"][0], warmup=25, rep=150, return_mode="median")
            tn = do_bench(calls["leanfa"][0], warmup=25, rep=150, return_mode="median")
            t_old.append(to)
            t_new.append(tn)
            ratios.append(to / tn)
        r = statistics.median(ratios)
        worst = min(worst, r)
        tn = statistics.median(t_new)
        print(f"{name:32s} {statistics.median(t_old):8.3f} {tn:8.3f} {r:13.4f} {min(ratios):6.3f} {max(ratios):6.3f} "
              f"{flops / tn / 1e9:8.1f} {diff:9.2e} {power.sm_clock_mhz() or 0:6d}", flush=True)
    print(f"worst new/old speed {worst:.4f} (target >= 0.99)")


if __name__ == "__main__":
    main()
