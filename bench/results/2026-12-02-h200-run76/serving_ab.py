"""Serving batches (issue 22), kernel alone: leanfa varlen with the tile table ("new"), the 5a3d61b tree's
varlen path ("old"), FA3 varlen; BF16 and FP8; one process. AB_CHECK=1: float64 check of new per sequence."""
import os, sys, random
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path[:0] = [HERE, ROOT, os.path.join(ROOT, "scripts")]
import torch
import hopper_gpu_check as H
import leanfa
from leanfa.reference import attention_ref
from leanfa.bench import fa3
from leanfa.bench.inputs import Inputs
from leanfa.bench.shapes import Case
os.environ["LEANFA_POISON_OUTPUTS"] = "0"
rng = random.Random(0)
BATCHES = {
    "bench8": [8192, 3001, 2048, 1500, 1024, 517, 100, 2],
    "4x4096": [4096] * 4,
    "mixed8": [5000, 3100, 2500, 2000, 1800, 1000, 983, 1],
    "chat64": [rng.randint(50, 600) for _ in range(64)],
    "12k+40": [12288] + [rng.randint(30, 200) for _ in range(40)],
}
HQ, HKV, D = 32, 8, 128


def flops(lens):
    return sum(2 * HQ * n * n * 2 * D / 2 for n in lens)


def make(lens, seed=0):
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = H.make_qkv(1, sum(lens), sum(lens), HQ, HKV, D, D, seed=seed)
    return cu, q[0], k[0], v[0]


def kernel_only(pkg, args, cu, m, persistent=None):
    api = __import__(f"{pkg}.api", fromlist=["x"]); hop = __import__(f"{pkg}.kernels.hopper", fromlist=["x"])
    L = __import__(f"{pkg}.kernels.hopper.launch", fromlist=["x"])
    if isinstance(args, tuple):
        q, k, v = args; kw = {}
    else:
        q, k, v = args.q, args.k, args.v
        kw = dict(q_descale=args.q_descale, k_descale=args.k_descale, v_descale=args.v_descale, k_mean=args.k_mean)
    if persistent is not None:
        os.environ["LEANFA_HOPPER_PERSISTENT"] = persistent
    try:
        problem = api._build_problem(q, k, v, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                     max_seqlen_k=m, softmax_scale=None, causal=True, return_lse=False, out_dtype=None,
                                     q_descale=kw.get("q_descale"), k_descale=kw.get("k_descale"),
                                     v_descale=kw.get("v_descale"), k_mean=kw.get("k_mean"))
        plan, out, _ = hop.plan(problem)
    finally:
        os.environ.pop("LEANFA_HOPPER_PERSISTENT", None)
    return (lambda: L.launch(plan)), out


if os.environ.get("AB_CHECK"):
    bad = 0
    for lens in ([1, 127, 128, 129, 0, 300], [12288 // 4] + [33] * 9, [5, 700, 2]):
        for prec in ("bf16", "fp8"):
            cu, q, k, v = make(lens, seed=len(lens))
            args = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                       max_seqlen_k=max(lens)) if prec == "fp8" else (q, k, v)
            ref = attention_ref(*((args, None, None) if prec == "fp8" else args), cu_seqlens_q=cu,
                                                 cu_seqlens_k=cu, causal=True)
            for pers in ("0", "1"):
                H.poison_allocator(sum(lens) * HQ * D * 4)
                fn, out = kernel_only("leanfa", args, cu, max(lens), pers)
                out.fill_(float("nan")); fn(); torch.cuda.synchronize()
                errs = [float((out[a:b].double() - ref[a:b]).norm() / ref[a:b].norm())
                        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
                nan = bool(torch.isnan(out).any())
                e = max(errs)
                ok = not nan and e < (0.1 if prec == "fp8" else 0.02)
                bad += not ok
                print(f"check {prec} persistent={pers} {lens[:6]}: max seq err {e:.3e} nan={nan} {'ok' if ok else 'BAD'}",
                      flush=True)
    print(f"CHECK {'OK' if bad == 0 else f'{bad} BAD'}")
    sys.exit(0)

rows = []
for name in sys.argv[1].split(","):
    lens = BATCHES[name]
    cu, q, k, v = make(lens)
    m = max(lens)
    case = Case("serving", name, "gaussian", len(lens), m, HQ, HKV, D, D, True, seqlens=tuple(lens))
    x = Inputs(q, k, v, cu, m)
    fq = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m)
    for rnd in range(1 if os.environ.get("AB_WARM") else 2):
        res = {}
        for prec in ("fp8", "bf16"):
            res[f"fa3-{prec}"] = H.bench(fa3.call(case, x, fp8=prec == "fp8")[0])
            args = fq if prec == "fp8" else (q, k, v)
            for label, pkg, pers in (("old", "oldleanfa", None), ("new", "leanfa", None)):
                try:
                    res[f"{label}-{prec}"] = H.bench(kernel_only(pkg, args, cu, m, pers)[0])
                except Exception as e:  # noqa: BLE001
                    print(f"{name} {label}-{prec} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        for n, (ms, clk) in res.items():
            prec = n.rsplit("-", 1)[1]
            best = res[f"fa3-{prec}"][0]
            rows.append((name, rnd, n, flops(lens) / ms / 1e9, best / ms, clk))
            print(f"{name:8s} r{rnd} {n:12s} {flops(lens) / ms / 1e9:7.1f} TFLOP/s x{best / ms:.3f} @{clk}", flush=True)
    torch.cuda.empty_cache()
print("\n| impl | " + " | ".join(dict.fromkeys(r[0] for r in rows)) + " |")
for n in dict.fromkeys(r[2] for r in rows):
    print(f"| {n} | " + " | ".join(" / ".join(f"{r[3]:.0f} ({r[4]:.2f}x)@{r[5]}" for r in rows if r[0] == s and r[2] == n)
                                    for s in dict.fromkeys(r[0] for r in rows)) + " |")
