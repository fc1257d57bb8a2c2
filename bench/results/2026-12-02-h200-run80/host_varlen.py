import time, torch, leanfa
from leanfa.kernels.hopper import varlen_tiles
from leanfa.bench.shapes import SERVING_BATCHES
for name in ("mixed8", "chat64", "chat256"):
    lens = list(SERVING_BATCHES[name]); T = sum(lens); m = max(lens)
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(T, h, 128, device="cuda").to(torch.bfloat16) for h in (32, 8, 8))
    def per_call(fn, n=200):
        fn(); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return host * 1e6, (time.perf_counter() - t) / n * 1e6
    b = per_call(lambda: varlen_tiles.build(cu, cu, T, m, True, 128))
    f = per_call(lambda: leanfa.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, backend="hopper"))
    fq = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m)
    f8 = per_call(lambda: leanfa.flash_attn_varlen_func(fq, None, None, cu, cu, m, m, causal=True, backend="hopper"))
    print(f"{name}: table build host {b[0]:.0f} us / wall {b[1]:.0f} us; bf16 call host {f[0]:.0f} / wall {f[1]:.0f} us; "
          f"fp8 call host {f8[0]:.0f} / wall {f8[1]:.0f} us", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            leanfa.flash_attn_varlen_func(fq, None, None, cu, cu, m, m, causal=True, backend="hopper")
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
