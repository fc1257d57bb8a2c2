"""One-off device A/B: portable kernel as of 32021a1 (old) vs do_not_specialize on lengths (new)
vs lengths specialized again (spec). Kernel only, pre-quantized FP8 and BF16, interleaved."""
import shutil, statistics, sys, os
for n in ("old", "spec"):
    shutil.copy(f".ab/portable_{n}.py", f"leanfa/kernels/portable_{n}.py")
import torch, importlib, leanfa
from leanfa.api import _build_problem, _unpack_quantized
mods = {n: importlib.import_module(f"leanfa.kernels.portable{'' if n == 'new' else '_' + n}") for n in ("old", "new", "spec")}
def prob(x, causal):
    q, k, v, qd, kd, vd, km = _unpack_quantized(*x, None, None, None, None) if len(x) == 3 else _unpack_quantized(x[0], None, None, None, None, None, None)
    return _build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                          softmax_scale=None, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, k_mean=km, return_lse=False, out_dtype=None)
def t(fn, n=30):
    for _ in range(5): fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for (B, S) in [(1, 16384), (4, 4096)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    quant = leanfa.quantize_fp8(q, k, v)
    for prec, x in (("fp8", (quant,)), ("bf16", (q, k, v))):
        p = prob(x, True)
        flops = 4 * B * 16 * S * S * 128 / 2
        res = {n: [] for n in mods}
        for rnd in range(3):
            for n, m in mods.items():
                res[n].append(t(lambda: m.run(p)))
        print(f"S={S} B={B} {prec} " + "  ".join(f"{n}={flops / min(r) / 1e9:.0f}TF" for n, r in res.items()), flush=True)
