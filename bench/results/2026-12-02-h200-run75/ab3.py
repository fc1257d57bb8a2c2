"""A/B (temporary, not committed): main's v3 vs the 5a3d61b tree + tree row max ("wt3"), 2 and 3 consumer
warpgroups, vs FA3 and cuDNN, one process. Stage 1 checks each config against float64 (output poisoned)."""
import os, sys, math
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path[:0] = [HERE, ROOT, os.path.join(ROOT, "scripts")]
import torch
import hopper_gpu_check as H
from kernel_variants import SHAPES
from leanfa.bench import fa3, impls
from leanfa.bench.inputs import Inputs
from leanfa.bench.shapes import Case
os.environ["LEANFA_POISON_OUTPUTS"] = "0"

W3 = {"LEANFA_HOPPER_CONSUMERS": "3", "LEANFA_HOPPER_BLOCK_N": "128", "LEANFA_HOPPER_PV_IN_MMA": "1"}
PVM = {"LEANFA_HOPPER_PV_IN_MMA": "1"}
CONFIGS = [("main-v3", "leanfa", {}), ("wt3-v3", "oldleanfa", {}), ("wt3-pvmma", "oldleanfa", PVM),
           ("wt3-3wg", "oldleanfa", W3)]
BF16_CONFIGS = [("main-v3", "leanfa", {}), ("wt3-v3", "oldleanfa", {}),
                ("wt3-3wg64", "oldleanfa", {"LEANFA_HOPPER_CONSUMERS": "3", "LEANFA_HOPPER_BLOCK_N": "64"})]


def with_env(env, fn):
    os.environ.update(env)
    try:
        return fn()
    finally:
        for e in env:
            os.environ.pop(e, None)


def kernel_only(pkg, q, k, v, scale, kw, causal):
    api = __import__(f"{pkg}.api", fromlist=["x"]); hop = __import__(f"{pkg}.kernels.hopper", fromlist=["x"])
    L = __import__(f"{pkg}.kernels.hopper.launch", fromlist=["x"])
    problem = api._build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                 max_seqlen_k=None, softmax_scale=scale, causal=causal, return_lse=False, out_dtype=None,
                                 **{n: kw.get(n) for n in ("q_descale", "k_descale", "v_descale", "k_mean")})
    plan, out, _ = hop.plan(problem)
    return (lambda: L.launch(plan)), out


CHECKS = [(2, 784, 784, 8, 2, 128, 128, True), (1, 1008, 1008, 4, 4, 128, 128, False),
          (1, 640, 640, 4, 4, 192, 128, True), (2, 2048, 2048, 4, 2, 128, 128, True),
          (1, 304, 912, 4, 4, 128, 128, True), (1, 4096, 4096, 2, 2, 128, 128, True)]


def check(configs, prec):
    bad = 0
    for (B, Sq, Sk, Hq, Hkv, dqk, dv, causal) in CHECKS:
        q, k, v = H.make_qkv(B, Sq, Sk, Hq, Hkv, dqk, dv, seed=Sq + Hq)
        kw = {}
        if prec == "fp8":
            (q, k, v), kw = H.quantize(q, k, v)
        ref, _ = H.reference(q, k, v, causal, dqk ** -0.5, **kw)
        errs = []
        for name, pkg, env in configs:
            def run():
                H.poison_allocator(B * Sq * Hq * dv * 4)
                fn, out = kernel_only(pkg, q, k, v, dqk ** -0.5, kw, causal)
                out.fill_(float("nan"))
                fn(); torch.cuda.synchronize()
                return out
            try:
                o = with_env(env, run).double()
                err = float((o - ref).norm() / ref.norm())
                if math.isnan(err) or err > (0.12 if prec == "fp8" else 0.02):
                    bad += 1
                errs.append(f"{name}={err:.4e}")
            except Exception as e:  # noqa: BLE001
                bad += 1
                errs.append(f"{name}=FAIL({type(e).__name__}: {str(e)[:120]})")
        print(f"check {prec} {(B, Sq, Sk, Hq, Hkv, dqk, dv, causal)}: " + "  ".join(errs), flush=True)
    return bad


if os.environ.get("AB_CHECK"):
    n = check(CONFIGS, "fp8") + check(BF16_CONFIGS, "bf16")
    print(f"CHECK {'OK' if n == 0 else f'{n} BAD'}")
    sys.exit(0)

rows = []
for shape in sys.argv[1].split(","):
    B, S, Hq, Hkv, dqk, dv, causal = SHAPES[shape]
    if os.environ.get("AB_WARM"):
        B, S = 1, 256
    flops = 2 * B * Hq * S * S * (dqk + dv) / (2 if causal else 1)
    q, k, v = H.make_qkv(B, S, S, Hq, Hkv, dqk, dv)
    case = Case("ab", shape, "gaussian", B, S, Hq, Hkv, dqk, dv, causal); x = Inputs(q, k, v)
    (q8, k8, v8), kw = H.quantize(q, k, v)
    for rnd in range(1 if os.environ.get("AB_WARM") else 2):
        res = {}
        for prec in ("fp8", "bf16"):
            fp8 = prec == "fp8"
            if os.environ.get("AB_NO_BF16") and not fp8:
                continue
            res[f"fa3-{prec}"] = H.bench(fa3.call(case, x, fp8=fp8)[0])
            if fp8:
                res["cudnn-fp8"] = H.bench(impls._cudnn_graph_prepare(case, x, fp8=True, e2e=False).run)
            args = (q8, k8, v8, dqk ** -0.5, kw, causal) if fp8 else (q, k, v, dqk ** -0.5, {}, causal)
            for name, pkg, env in (CONFIGS if fp8 else BF16_CONFIGS):
                try:
                    res[f"{name}-{prec}"] = with_env(env, lambda: H.bench(kernel_only(pkg, *args)[0]))
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} {name}-{prec} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
        for n, (ms, clk) in res.items():
            prec = n.rsplit("-", 1)[1]
            best = min(res[p][0] for p in res if p.rsplit("-", 1)[1] == prec and p.split("-")[0] in ("fa3", "cudnn"))
            rows.append((shape, rnd, n, flops / ms / 1e9, best / ms, clk))
            print(f"{shape:12s} r{rnd} {n:16s} {flops / ms / 1e9:7.1f} TFLOP/s x{best / ms:.3f} @{clk}", flush=True)
    del q, k, v, q8, k8, v8, x; torch.cuda.empty_cache()
print("\n| impl | " + " | ".join(dict.fromkeys(r[0] for r in rows)) + " |")
for n in dict.fromkeys(r[2] for r in rows):
    print(f"| {n} | " + " | ".join(" / ".join(f"{r[4]:.3f}@{r[5]}" for r in rows if r[0] == s and r[2] == n)
                                    for s in dict.fromkeys(r[0] for r in rows)) + " |")
