"""One-off: is the raw-FP8 LSE error the FP8 MMA's reduced-precision accumulation?"""
import torch, leanfa
from leanfa.reference import attention_ref
torch.manual_seed(0)
one = torch.ones((), device="cuda")
for d in (128, 256):
    q = (torch.randn(1, 256, 1, d, device="cuda") * 3).to(torch.float8_e4m3fn)
    k = (torch.randn(1, 16, 1, d, device="cuda") * 3).to(torch.float8_e4m3fn)
    v = torch.randn(1, 16, 1, d, device="cuda").to(torch.float8_e4m3fn)
    s64 = q[0, :, 0].double() @ k[0, :, 0].double().T        # exact logits (256, 16)
    a64 = q[0, :, 0].double().abs() @ k[0, :, 0].double().abs().T
    for fast in (False, True):
        s = torch._scaled_mm(q[0, :, 0], k[0, :, 0].T, one, one, out_dtype=torch.float32, use_fast_accum=fast)
        e = (s.double() - s64).abs()
        print(f"d={d} cuBLAS fp8 use_fast_accum={fast}: max |ds| {e.max():.3g}, max |ds|/sum|qk| {(e / a64).max():.3g} (2^{torch.log2((e / a64).max()).item():.1f})")
    _, lse = leanfa.flash_attn_func(q, k, v, softmax_scale=1.0, return_lse=True, backend="portable")
    _, ref = attention_ref(q, k, v, softmax_scale=1.0, return_lse=True)
    e = (lse.double() - ref).abs()[0, 0]
    print(f"d={d} leanfa portable LSE: max err {e.max():.3g}, / max_j sum|qk| {(e / a64.max(1).values).max():.3g}")
