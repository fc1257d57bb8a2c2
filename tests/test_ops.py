"""The torch.library custom ops: opcheck, torch.compile(fullgraph) without graph breaks, and
(GPU) CUDA-graph capture/replay and the inductor backend."""

import pytest
import torch

import leanfa
import leanfa.ops  # noqa: F401  (registers torch.ops.leanfa.*)
from leanfa import api

BF16 = torch.bfloat16


def _qkv(device, b=1, s=16, hq=4, hkv=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn((b, s, h, d), generator=g).to(BF16).to(device)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def _op_args(q, k, v, *, return_lse, causal=True):
    p = api._build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, causal=causal,
                           q_descale=None, k_descale=None, v_descale=None, k_mean=None,
                           return_lse=return_lse, out_dtype=None)
    # opcheck wants plain tensors (the tables are zero-stride expanded views)
    return (q, k, v, p.q_scale.contiguous(), p.k_scale.contiguous(), p.v_scale.contiguous(), None,
            p.softmax_scale, causal, return_lse, p.out_dtype, "portable")


# test_autograd_registration needs inputs that require grad (forward-only op: not applicable)
OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("return_lse", [False, True])
def test_opcheck_fwd(device, return_lse):
    q, k, v = _qkv(device)
    torch.library.opcheck(torch.ops.leanfa.fwd.default, _op_args(q, k, v, return_lse=return_lse),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_varlen_fwd(device):
    q, k, v = _qkv(device, s=20)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    args = _op_args(q, k, v, return_lse=True)
    qs = torch.ones((2, 4, 1), dtype=torch.float32, device=device)
    ks = torch.ones((2, 2, 1), dtype=torch.float32, device=device)
    vs = torch.ones((2, 2, 64), dtype=torch.float32, device=device)
    torch.library.opcheck(torch.ops.leanfa.varlen_fwd.default,
                          (q[0], k[0], v[0], cu, cu, 13, 13, qs, ks, vs, None, *args[7:]),
                          test_utils=OPCHECK_TESTS)


def test_opcheck_seqused(device):
    """The ops' optional seqused_q/seqused_k tensors (FA3's): schema, fake shapes, AOT dispatch."""
    q, k, v = _qkv(device, b=2, s=20)
    used_q = torch.tensor([20, 7], dtype=torch.int32, device=device)
    used_k = torch.tensor([3, 20], dtype=torch.int32, device=device)
    args = _op_args(q, k, v, return_lse=True)
    torch.library.opcheck(torch.ops.leanfa.fwd.default, args, {"seqused_q": used_q, "seqused_k": used_k},
                          test_utils=OPCHECK_TESTS)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.leanfa.varlen_fwd.default,
                          (q[0], k[0], v[0], cu, cu, 13, 13, *args[3:6], None, *args[7:]),
                          {"seqused_q": torch.tensor([7, 2], dtype=torch.int32, device=device)},
                          test_utils=OPCHECK_TESTS)


def test_opcheck_window_softcap(device):
    """The ops' window_left/window_right/softcap scalars: schema, fake shapes, AOT dispatch."""
    q, k, v = _qkv(device, s=20)
    args = _op_args(q, k, v, return_lse=True, causal=False)
    torch.library.opcheck(torch.ops.leanfa.fwd.default, args, {"window_left": 5, "window_right": 2, "softcap": 10.0},
                          test_utils=OPCHECK_TESTS)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.leanfa.varlen_fwd.default,
                          (q[0], k[0], v[0], cu, cu, 13, 13, *args[3:6], None, *args[7:]),
                          {"window_left": 3, "softcap": 4.0}, test_utils=OPCHECK_TESTS)


def test_opcheck_paged(device):
    """The ops' optional page_table (paged K/V caches), and varlen_fwd's optional cu_seqlens_k (packed q over
    per-sequence K/V): schema, fake shapes, AOT dispatch."""
    q, _, _ = _qkv(device, b=2, s=20)
    g = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn((5, 16, 2, 64), generator=g).to(BF16).to(device) for _ in range(2))
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=device)
    args = _op_args(q, q[:, :, :2], q[:, :, :2], return_lse=True)
    torch.library.opcheck(torch.ops.leanfa.fwd.default, (q, kc, vc, *args[3:]), {"page_table": table},
                          test_utils=OPCHECK_TESTS)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)
    used = torch.tensor([30, 9], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.leanfa.varlen_fwd.default,
                          (q[0], kc, vc, cu, None, 13, 32, *args[3:6], None, *args[7:]),
                          {"page_table": table, "seqused_k": used}, test_utils=OPCHECK_TESTS)


def test_compile_paged_fullgraph(device):
    """A paged call traces through torch.compile without a graph break and matches eager."""
    q, _, _ = _qkv(device, b=2, s=20)
    g = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn((5, 16, 2, 64), generator=g).to(BF16).to(device) for _ in range(2))
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32, device=device)
    used = torch.tensor([30, 9], dtype=torch.int32, device=device)

    def f(q, kc, vc, table, used):
        return leanfa.flash_attn_func(q, kc, vc, causal=True, page_table=table, seqused_k=used)

    eager = f(q, kc, vc, table, used)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(q, kc, vc, table, used), eager,
                               rtol=0, atol=0)


def test_opcheck_quantize(device):
    q, k, v = _qkv(device, s=20)
    torch.library.opcheck(torch.ops.leanfa.quantize_fp8.default, (q, k, v, "block", True, None, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_matches_direct_kernel(device):
    """Routing through the op changes nothing: same bits as the kernel dispatcher."""
    from leanfa.kernels import dispatch

    q, k, v = _qkv(device)
    out, lse = leanfa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    p = api._build_problem(q, k, v, varlen=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, softmax_scale=None, causal=True, q_descale=None, k_descale=None,
                           v_descale=None, k_mean=None, return_lse=True, out_dtype=None)
    ref_out, ref_lse = dispatch.run(p, "auto")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


class _Block(torch.nn.Module):
    """A tiny attention block: projections around leanfa.flash_attn_func (GQA, causal)."""

    def __init__(self, precision="bf16"):
        super().__init__()
        torch.manual_seed(0)
        self.qp = torch.nn.Linear(64, 4 * 64, dtype=BF16)
        self.kvp = torch.nn.Linear(64, 2 * 2 * 64, dtype=BF16)
        self.precision = precision
        self.requires_grad_(False)  # the ops are forward-only (inference/prefill)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.qp(x).view(b, s, 4, 64)
        k, v = self.kvp(x).view(b, s, 2, 2, 64).unbind(2)
        if self.precision == "fp8":
            o = leanfa.attention(q, k, v, causal=True, precision="fp8")
        else:
            o = leanfa.flash_attn_func(q, k, v, causal=True)
        return o.flatten(2).float().sum(-1)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compile_fullgraph_matches_eager(device, precision):
    m = _Block(precision).to(device)
    x = torch.randn(1, 16, 64, dtype=BF16, device=device)
    eager = m(x)
    explained = torch._dynamo.explain(m)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)


def test_compile_varlen_fullgraph(device):
    q, k, v = _qkv(device, s=20)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32, device=device)

    def f(q, k, v, cu):
        return leanfa.flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True, return_lse=True)

    eager = f(q[0], k[0], v[0], cu)
    explained = torch._dynamo.explain(f)(q[0], k[0], v[0], cu)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    out, lse = torch.compile(f, fullgraph=True, backend="eager")(q[0], k[0], v[0], cu)
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])


# ---- GPU: CUDA graphs and inductor (run by the lead on an H200) ---------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("s", [256, 2048])  # 2048: autotuned shape -> warm-up outside capture
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_cuda_graph_capture_replay(s, precision):
    q, k, v = _qkv("cuda", b=2, s=s, hq=8, hkv=2, d=128)
    run = lambda: leanfa.attention(q, k, v, causal=True, precision=precision)  # noqa: E731
    ref = run()  # warm-up: compiles and (large shapes) autotunes outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (1, 2):  # replay reads the new values written into the captured inputs
        nq, nk, nv = _qkv("cuda", b=2, s=s, hq=8, hkv=2, d=128, seed=seed)
        q.copy_(nq), k.copy_(nk), v.copy_(nv)
        graph.replay()
        torch.cuda.synchronize()
        expect = leanfa.attention(q, k, v, causal=True, precision=precision)
        torch.testing.assert_close(out, expect, rtol=0, atol=0)
    assert not torch.equal(out, ref)


@pytest.mark.gpu
def test_cuda_graph_capture_fp8_descales_on_device():
    """FP8 inputs with device-tensor descales: per-head (B, Hkv) descales change between replays."""
    q, k, v = _qkv("cuda", b=2, s=512, hq=8, hkv=2, d=128)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    qd = torch.ones(2, 2, device="cuda")
    kd = torch.ones(2, 2, device="cuda")
    vd = torch.ones(2, 2, device="cuda")
    run = lambda: leanfa.flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    vd.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_compile_inductor_gpu(precision):
    m = _Block(precision).cuda()
    x = torch.randn(2, 256, 64, dtype=BF16, device="cuda")
    eager = m(x)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="inductor")
    torch.testing.assert_close(compiled(x), eager, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_compile_inductor_cudagraphs_gpu():
    """mode='reduce-overhead' (inductor + CUDA graphs) after a warm-up call."""
    m = _Block("bf16").cuda()
    x = torch.randn(2, 256, 64, dtype=BF16, device="cuda")
    eager = m(x)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        got = compiled(x)
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)


def test_eager_calls_skip_the_dispatcher_and_traced_ones_do_not(device):
    """Plain eager calls run the implementation directly (the op's dispatch is ~80 us of host
    time); inputs that require grad, fake tensors and dispatch modes still go through the op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from leanfa import ops

    q, k, v = _qkv(device)
    assert ops._plain_eager(q, k, v, None)
    out = leanfa.flash_attn_func(q, k, v, causal=True)
    assert out.grad_fn is None
    quant = leanfa.quantize_fp8(q, k, v)  # the quantizer takes the same path
    assert quant.q.grad_fn is None

    qg = q.clone().requires_grad_()
    assert not ops._plain_eager(qg, k, v)
    with torch.no_grad():
        assert ops._plain_eager(qg, k, v)
    out_g = leanfa.flash_attn_func(qg, k, v, causal=True)  # through the op: backward says why
    torch.testing.assert_close(out_g.detach(), out, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out_g.float().sum().backward()

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        assert not ops._plain_eager(fq, fk, fv)
        fo = leanfa.flash_attn_func(fq, fk, fv, causal=True)  # the op's fake implementation
        assert fo.shape == out.shape and fo.dtype == out.dtype
