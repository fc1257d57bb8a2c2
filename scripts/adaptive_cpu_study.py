"""CPU study of quantize_fp8(rotate="auto") (issue 24 item 2; docs/accuracy-notes.md): per preset, the emulator's error
(leanfa.accuracy_model, the kernel's arithmetic) of fp8 default / fp8 with Q and K rotated on exactly the KV heads
that the interpreted quantize_fp8(rotate="auto") flags / fp8 rotate=True, relative L2 vs float64.

TRITON_INTERPRET=1 python scripts/adaptive_cpu_study.py SEQLEN HEADS [SEED [PRESET,PRESET...]]   (S=1024, 32 heads: ~2 min)
"""
import sys, torch
from leanfa.activations import make_qkv
from leanfa.accuracy_model import emulate, Scheme
from leanfa.reference import attention_ref
from leanfa.quant import quantize_fp8, rotation_matrix
torch.set_num_threads(1)
S=int(sys.argv[1]); H=int(sys.argv[2]); seed=int(sys.argv[3]) if len(sys.argv)>3 else 0
presets=sys.argv[4].split(",") if len(sys.argv)>4 else ["gaussian","llama3-8b","mistral-7b","qwen2.5-7b","llama3-8b-massive","mistral-7b-massive","qwen2.5-7b-massive","llama3-8b-heads"]
R=rotation_matrix(128,"cpu")
def rel(o,r): return float((o.double()-r).norm()/r.norm())
for name in presets:
    q,k,v=make_qkv(name,1,S,heads=H,seed=seed)
    ref=attention_ref(q,k,v,causal=True)
    flags=quantize_fp8(q,k,v,rotate="auto").rotated[0]  # (Hkv,)
    g=q.shape[2]//k.shape[2]
    qf,kf=q.float(),k.float()
    qa=torch.where(flags.repeat_interleave(g)[None,None,:,None], qf@R, qf)
    ka=torch.where(flags[None,None,:,None], kf@R, kf)
    sc=Scheme(out_dtype=torch.bfloat16)
    e0=rel(emulate(q,k,v,sc),ref); ea=rel(emulate(qa,ka,v,sc),ref); e1=rel(emulate(q,k,v,Scheme(out_dtype=torch.bfloat16,hadamard=True)),ref)
    print(f"{name:<20} S={S} H={q.shape[2]}/{k.shape[2]} seed={seed} default {e0:.3e} auto {ea:.3e} ({ea/e0:.2f}x, {int(flags.sum())}/{flags.numel()} heads) rotate {e1:.3e} ({e1/e0:.2f}x)", flush=True)
