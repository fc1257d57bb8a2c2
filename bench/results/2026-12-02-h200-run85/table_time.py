import torch
from triton.testing import do_bench
from leanfa.kernels.hopper import varlen_tiles
from leanfa.bench.shapes import SERVING_BATCHES
cases = {"1x16384": (16384,), "64x300": (300,) * 64, **{k: SERVING_BATCHES[k] for k in ("mix16k", "long+short40", "chat256")}}
for warps, (name, lens) in [(w, c) for c in cases.items() for w in (4, 16)]:
    varlen_tiles.WARPS = warps
    cu = torch.tensor([0] + list(lens), device="cuda").cumsum(0).to(torch.int32)
    T, m = sum(lens), max(lens)
    f = lambda: varlen_tiles.build(cu, cu, T, m, True, 128)
    us = do_bench(f, return_mode="median") * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        f(); torch.cuda.synchronize()
    k = [e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"table {name}: warps {varlen_tiles.WARPS}, launch GPU {k} us, do_bench {us:.1f} us", flush=True)
