"""quantize_fp8: scales, K smoothing, V transposed layout, saturation, varlen."""

import pytest
import torch
import triton
import triton.language as tl

import leanfa
from leanfa.quant import E4M3_MAX, FP8_DTYPE, _quantize_launch, _Seqs
from leanfa.kernels.sequences import packed_block
from leanfa.scales import SCALE_BLOCK
from helpers import cu_seqlens, poison_empty


def _dequant_qk(x8, descale, seqlen):
    if descale.dim() == 3:
        idx = torch.arange(seqlen, device=x8.device) // SCALE_BLOCK
        per_tok = descale[:, :, idx].permute(0, 2, 1)  # (B, S, H)
        return x8.float() * per_tok[..., None]
    if descale.dim() == 2:
        return x8.float() * descale[:, None, :, None]
    return x8.float() * descale


@pytest.mark.parametrize("granularity", ["block", "head", "tensor"])
def test_roundtrip_and_shapes(device, granularity):
    b, s, hq, hkv, d = 2, 300, 4, 2, 128
    q = torch.randn(b, s, hq, d).to(torch.bfloat16).to(device)
    k = (torch.randn(b, s, hkv, d) + 3.0).to(torch.bfloat16).to(device)
    v = torch.randn(b, s, hkv, d).to(torch.bfloat16).to(device)
    qt = leanfa.quantize_fp8(q, k, v, granularity=granularity, smooth_k=True)
    assert qt.q.dtype == qt.k.dtype == qt.v.dtype == FP8_DTYPE
    assert qt.q.shape == q.shape and qt.k.shape == k.shape and qt.v.shape == v.shape
    assert qt.v.stride(1) == 1, "V must be stored transposed (token axis contiguous)"
    nblk = -(-s // SCALE_BLOCK)
    expect = {"block": (b, hq, nblk), "head": (b, hq), "tensor": ()}[granularity]
    assert tuple(qt.q_descale.shape) == expect
    assert torch.allclose(qt.k_mean, k.float().mean(dim=1), atol=1e-3)
    for x8, desc, ref in ((qt.q, qt.q_descale, q.float()), (qt.k, qt.k_descale, k.float() - qt.k_mean[:, None])):
        back = _dequant_qk(x8, desc, s)
        rel = (back - ref).norm() / ref.norm()
        assert rel < 0.05, rel  # e4m3 rounding: ~2.7% rms
        assert x8.float().abs().max() <= E4M3_MAX
    vd = qt.v_descale if qt.v_descale.dim() == 0 else qt.v_descale[:, None]
    back_v = qt.v.float() * vd
    assert (back_v - v.float()).norm() / v.float().norm() < 0.05


def test_block_scales_are_block_amax(device):
    x = torch.randn(1, 256, 1, 64)
    x[0, 130, 0, 5] = 1000.0  # only the second block sees the outlier
    x = x.to(device)
    qt = leanfa.quantize_fp8(x, x, x, granularity="block", smooth_k=False)
    d = qt.q_descale[0, 0].cpu()
    assert torch.allclose(d[1], torch.tensor(1000.0 / E4M3_MAX))
    assert d[0] < 5.0 / E4M3_MAX * 1.5


def test_saturating_conversion(device):
    """Values beyond +-448 after scaling clamp to +-448; nothing becomes NaN."""
    x = torch.tensor([1000.0, -1000.0, 448.0, 500.0, 3.0, -0.001, 0.0, 1e6] * 16).reshape(1, 128, 1, 1)
    x = x.expand(1, 128, 1, 64).contiguous().to(device)
    y = torch.empty(x.shape, dtype=FP8_DTYPE, device=device)
    seqs = _Seqs(x, None, None)
    ones = torch.ones(1, 1, 1, device=device)
    _quantize_launch(x, y, seqs, scale=ones)
    yf = y.float().cpu()
    assert not torch.isnan(yf).any()
    assert yf[0, 0, 0, 0] == 448.0 and yf[0, 1, 0, 0] == -448.0 and yf[0, 7, 0, 0] == 448.0
    assert yf[0, 4, 0, 0] == 3.0


def test_zero_input_gives_unit_scale(device):
    z = torch.zeros(1, 16, 1, 64, device=device)
    qt = leanfa.quantize_fp8(z, z, z)
    assert torch.all(qt.q_descale == 1.0) and torch.all(qt.v_descale == 1.0)
    assert torch.all(qt.q.float() == 0)


def test_varlen_means_are_per_sequence(device):
    lens = [3, 130, 0, 7]
    cu = torch.tensor([0, 3, 133, 133, 140], dtype=torch.int32, device=device)
    k = torch.randn(sum(lens), 2, 64)
    k[3:133] += 5.0
    k = k.to(device)
    qt = leanfa.quantize_fp8(k, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=130, max_seqlen_k=130)
    assert qt.q_descale.shape == (4, 2, 2)
    assert torch.allclose(qt.k_mean[1].cpu(), k[3:133].mean(0).cpu(), atol=1e-4)
    assert torch.allclose(qt.k_mean[0].cpu(), k[0:3].mean(0).cpu(), atol=1e-4)
    # V in the aligned layout (kernels/varlen_v.py): sequences from 0, 16, 160, 160, 176 of 208 token columns
    assert qt.v.shape == (208, 2, 64) and qt.v.stride(0) == 1
    assert qt.cu_seqlens_v.tolist() == [0, 16, 160, 160, 176]
    assert qt.packed_v(cu).shape == k.shape


def test_aligned_v_needs_its_starts(device):
    """A packed FP8QKV's V passed tensor by tensor: without cu_seqlens_v (the hint names it), in another layout
    with it, or cu_seqlens_v on 16-bit inputs: a ValueError, never a silent misread."""
    lens = [3, 40]
    cu = cu_seqlens(lens, device)
    q, k, v = (torch.randn(43, 2, 64).to(torch.bfloat16).to(device) for _ in range(3))
    qt = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40, max_seqlen_k=40)
    d = qt.descales()
    out = leanfa.flash_attn_varlen_func(qt.q, qt.k, qt.v, cu, cu, 40, 40, causal=True, **d)
    torch.testing.assert_close(out, leanfa.flash_attn_varlen_func(qt, None, None, cu, cu, 40, 40, causal=True))
    no_starts = {n: t for n, t in d.items() if n != "cu_seqlens_v"}
    with pytest.raises(ValueError, match="cu_seqlens_v"):
        leanfa.flash_attn_varlen_func(qt.q, qt.k, qt.v, cu, cu, 40, 40, **no_starts)
    with pytest.raises(ValueError, match="tokens innermost"):
        leanfa.flash_attn_varlen_func(qt.q, qt.k, qt.v.contiguous(), cu, cu, 40, 40, **d)
    with pytest.raises(ValueError, match="not FP8"):
        leanfa.flash_attn_varlen_func(q, k, torch.zeros_like(qt.v, dtype=q.dtype), cu, cu, 40, 40,
                                      cu_seqlens_v=qt.cu_seqlens_v)


@pytest.mark.parametrize("packed", [False, True])  # (the fused quantizer's two grids, quant.packed_grid)
@pytest.mark.parametrize("dim", [128, 256])  # the fused quantizer, and the per-tensor kernels plus the re-pack
def test_packed_v_in_the_aligned_layout(device, monkeypatch, dim, packed):
    """A packed batch's V: each sequence from a multiple of 16 tokens (the running sum of the rounded lengths),
    its values those of the same V quantized alone per sequence, zeros up to its rounded end and for the
    ALIGNED_V_TAIL tokens after the last sequence (the kernel's last boxes read them: every byte there must be
    finite), on buffers that start as NaN."""
    from leanfa import quant
    from leanfa.kernels.varlen_v import ALIGNED_V_TAIL, repacked_tokens

    poison_empty(monkeypatch)
    monkeypatch.setattr(quant, "packed_grid", lambda *a: packed)
    lens = [5, 0, 129, 1, 16, 40]
    cu = cu_seqlens(lens, device)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), 2, dim, generator=g).to(torch.bfloat16).to(device) for _ in range(3))
    qt = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    rounded = [-(-n // 16) * 16 for n in lens]
    starts = [sum(rounded[:b]) for b in range(len(lens) + 1)]
    assert qt.cu_seqlens_v.tolist() == starts
    room = repacked_tokens(sum(lens), len(lens))
    assert qt.v.shape == (room, 2, dim) and qt.v.stride(0) == 1
    raw = qt.v.view(torch.uint8).cpu()
    for b, n in enumerate(lens):
        alone = leanfa.quantize_fp8(*(t[cu[b]:cu[b + 1]].unsqueeze(0) for t in (q, k, v))) if n else None
        seq = raw[starts[b]:starts[b] + n]
        if n:
            assert torch.equal(seq, alone.v[0].view(torch.uint8).cpu()), f"sequence {b}"
        assert (raw[starts[b] + n:starts[b + 1]] == 0).all(), f"the gap after sequence {b}"
    assert (raw[starts[-1]:starts[-1] + ALIGNED_V_TAIL] == 0).all(), "the tail after the last sequence"
    assert torch.equal(qt.packed_v(cu).view(torch.uint8), torch.cat(
        [raw[starts[b]:starts[b] + n] for b, n in enumerate(lens)]).to(device))


def test_bad_granularity():
    x = torch.randn(1, 4, 1, 64)
    with pytest.raises(ValueError, match="granularity"):
        leanfa.quantize_fp8(x, x, x, granularity="row")


@pytest.mark.parametrize("varlen", [False, "grid", "packed"])
@pytest.mark.parametrize("smooth_k", [True, False])
def test_fused_block_path_matches_per_tensor_kernels(device, monkeypatch, varlen, smooth_k):
    """granularity="block" runs two fused launches (K/V statistics, then Q, K, V together); the
    general per-tensor kernels compute the same thing: identical Q, V and scales, and K equal up
    to the summation order of its mean (a few e4m3 roundings may flip by one step). Packed batches
    both ways: one program per (sequence, block of the longest) and one per block slot (quant.packed_grid)."""
    from leanfa import quant

    if varlen:
        monkeypatch.setattr(quant, "packed_grid", lambda *a: varlen == "packed")

    g = torch.Generator().manual_seed(5)
    hq, hkv, dqk, dv = 6, 2, 192, 128
    if varlen:
        lens_q, lens_k = [1, 300, 0, 129], [2, 700, 0, 1]  # empty and one-token sequences
        shape_q, shape_k = (sum(lens_q), hq), (sum(lens_k), hkv)
        cu = lambda ls: cu_seqlens(ls, device)  # noqa: E731
        kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    else:
        shape_q, shape_k, kw = (2, 300, hq), (2, 700, hkv), {}
    q = (torch.randn(*shape_q, dqk, generator=g) * 3).to(torch.bfloat16).to(device)
    k = (torch.randn(*shape_k, dqk, generator=g) + torch.randn(dqk, generator=g) * 4).to(device)  # fp32, biased
    # V sliced out of a wider buffer (non-contiguous) with outlier channels
    v = (torch.randn(*shape_k, 2 * dv, generator=g) * torch.linspace(0.1, 20, 2 * dv)).to(torch.float16).to(device)[..., ::2]
    fused = leanfa.quantize_fp8(q, k, v, granularity="block", smooth_k=smooth_k, **kw)

    sq = quant._Seqs(q, kw.get("cu_seqlens_q"), kw.get("max_seqlen_q"))
    sk = quant._Seqs(k, kw.get("cu_seqlens_k"), kw.get("max_seqlen_k"))
    k_mean = quant._channel_stats_launch(k, sk, want_sum=True, want_amax=False)[0] if smooth_k else None
    q8, qd = quant._quantize_qk(q, sq, "block", None)
    k8, kd = quant._quantize_qk(k, sk, "block", k_mean)
    v8 = quant._quantize_v(v, quant._Seqs(v, kw.get("cu_seqlens_k"), kw.get("max_seqlen_k")), "block")

    if varlen:  # (V8: the per-tensor kernels' V re-packed into the aligned layout; its tail is all zeros)
        v8, vd, cu_v = v8
        assert torch.equal(fused.cu_seqlens_v, cu_v)
        v8, fused_v = (t.view(torch.uint8) for t in (v8, fused.v))
        end = int(cu_v[-1])
        assert torch.equal(fused_v[:end], v8[:end])
    else:
        v8, vd, _ = v8
        assert torch.equal(fused.v.view(torch.uint8), v8.view(torch.uint8))
    assert fused.v.stride() == v8.stride() and fused.q_descale.shape == qd.shape
    assert torch.equal(fused.q.view(torch.uint8), q8.view(torch.uint8))
    assert torch.equal(fused.v_descale, vd)
    assert torch.equal(fused.q_descale, qd)  # (blocks past a sequence's end: 1 in both)
    if smooth_k:
        torch.testing.assert_close(fused.k_mean, k_mean, rtol=1e-5, atol=1e-6)
    else:
        assert fused.k_mean is None
    diff = (fused.k.float() - k8.float()).abs()
    step = k8.float().abs() / 8 + 2.0**-9  # one e4m3 step at that magnitude (3 mantissa bits)
    assert (diff <= step).all() and (diff > 0).float().mean() < 1e-3
    torch.testing.assert_close(fused.k_descale, kd, rtol=1e-5, atol=0)


@pytest.mark.parametrize("packed", [False, True])  # (the fused quantizer's two grids, quant.packed_grid)
@pytest.mark.parametrize("dim", [128, 256])  # the fused quantizer, and the per-tensor kernels (dim > 192)
def test_blocks_past_a_sequence_end_have_unit_descale(device, monkeypatch, dim, packed):
    """Packed varlen: a sequence shorter than the longest has block-scale slots past its end; they hold 1, not
    what the allocator left there (GPU run 53: two calls on equal inputs differed in exactly those slots). Every
    ``torch.empty`` is poisoned here (float32: NaN), so a slot left unwritten fails."""
    from leanfa import quant

    poison_empty(monkeypatch)
    monkeypatch.setattr(quant, "packed_grid", lambda *a: packed)
    lens = [300, 5, 0, 129]  # (a one-token K smooths to 0: descale 1 in its own block too)
    cu = cu_seqlens(lens, device)
    g = torch.Generator().manual_seed(7)
    q, k, v = ((torch.randn(sum(lens), h, dim, generator=g) * 2).to(torch.bfloat16).to(device) for h in (4, 2, 2))
    qt = leanfa.quantize_fp8(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300, max_seqlen_k=300)
    for table in (qt.q_descale, qt.k_descale):
        assert table.shape[::2] == (4, 3) and not table.isnan().any()
        for b, n in enumerate(lens):
            nblk = -(-n // SCALE_BLOCK)
            assert (table[b, :, nblk:] == 1).all() and (table[b, :, :nblk] != 1).all()


class _PoisonedStats:
    """Stands in for ``quant.kv_stats``: fills the partial tables with NaN before each launch,
    so a slot the kernel leaves unwritten (a block past a sequence's end) poisons any finish
    that reads it (``torch.empty`` often hands back zeros, which would hide that)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(k, v, cu, ksum, vamax, *args, **kwargs):
            ksum.fill_(float("nan"))
            vamax.fill_(float("nan"))
            return self.kernel[grid](k, v, cu, ksum, vamax, *args, **kwargs)

        return launch


@pytest.mark.parametrize("packed", [False, True])  # (the fused quantizer's two grids, quant.packed_grid)
@pytest.mark.parametrize("finish_rows", [None, 2])  # the default, and a reduction over several steps
def test_fused_statistics_match_float64(device, monkeypatch, finish_rows, packed):
    """The fused path's K mean and V descales, finished from per-block partials, against float64
    references taken directly per sequence and head: packed sequences from 0 tokens to many
    blocks (one a single token, one a block plus one token), K channel offsets and V channel
    ranges that differ per sequence and head (a sum over another sequence's or head's blocks,
    or a wrong length, shows), head dims that differ between K and V."""
    from leanfa import quant

    monkeypatch.setattr(quant, "kv_stats", _PoisonedStats(quant.kv_stats))
    monkeypatch.setattr(quant, "packed_grid", lambda *a: packed)
    if finish_rows is not None:
        monkeypatch.setattr(quant, "FINISH_ROWS", finish_rows)
    g = torch.Generator().manual_seed(11)
    lens = [1, 1000, 0, 129, 384]
    hq, hkv, dqk, dv = 2, 3, 96, 64
    total, n = sum(lens), len(lens)
    offset = torch.randn(n, hkv, dqk, generator=g, dtype=torch.float64) * 20  # per sequence, head, channel
    spread = torch.rand(n, hkv, dv, generator=g, dtype=torch.float64) * 50 + 0.01
    seq = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))  # sequence of each token
    k = (torch.randn(total, hkv, dqk, generator=g, dtype=torch.float64) + offset[seq]).to(torch.bfloat16)
    v = (torch.randn(total, hkv, dv, generator=g, dtype=torch.float64) * spread[seq]).to(torch.bfloat16)
    v[seq == 3] = 0.0  # an all-zero sequence: descale 1
    q = torch.randn(total, hq, dqk, generator=g).to(torch.bfloat16)
    cu = cu_seqlens(lens, device)
    qt = leanfa.quantize_fp8(q.to(device), k.to(device), v.to(device), cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=max(lens), max_seqlen_k=max(lens))

    mean_ref = torch.zeros(n, hkv, dqk, dtype=torch.float64)
    amax_ref = torch.zeros(n, hkv, dv, dtype=torch.float64)
    for b in range(n):
        if lens[b]:
            mean_ref[b] = k[seq == b].double().mean(0)
            amax_ref[b] = v[seq == b].double().abs().amax(0)
    # amax is exact in float32; amax / 448 rounds once (a GPU's division may be off by an ulp)
    vd_ref = torch.where(amax_ref > 0, amax_ref.float() / E4M3_MAX, torch.ones(()))
    # float32 sums of up to 1000 values of magnitude <= ~80 (CPU: off by <= 2e-6); a finish over
    # the wrong blocks, heads or length is off by far more (or NaN from a poisoned slot)
    torch.testing.assert_close(qt.k_mean.cpu().double(), mean_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(qt.v_descale.cpu(), vd_ref, rtol=3e-7, atol=0)
    assert torch.all(qt.v_descale[3] == 1.0) and torch.all(qt.k_mean[2] == 0.0)


@triton.jit
def _packed_block_lookup(CU, OUT, batch, BLOCK_S: tl.constexpr, STEP: tl.constexpr):
    i = tl.program_id(0)
    b, blk = packed_block(i, CU, batch, BLOCK_S, STEP)
    tl.store(OUT + 2 * i, b)
    tl.store(OUT + 2 * i + 1, blk)


@pytest.mark.parametrize("step", [4, 64])  # several steps of the running sum, and one
def test_packed_block_finds_every_block_once(device, step):
    """sequences.packed_block maps program i of a ``total // 128 + batch`` grid to (sequence, block): every
    block of every sequence exactly once (empty sequences have none), then ``batch`` for the slots past the end."""
    lens = [0, 1, 128, 129, 0, 0, 300, 5, 256, 127, 0, 1000, 2]
    cu = cu_seqlens(lens, device)
    slots = sum(lens) // 128 + len(lens)
    out = torch.full((slots, 2), -7, dtype=torch.int32, device=device)
    _packed_block_lookup[(slots,)](cu, out, len(lens), BLOCK_S=128, STEP=step)
    want = [(b, j) for b, n in enumerate(lens) for j in range(-(-n // 128))]
    got = [tuple(r) for r in out.tolist()]
    assert got[:len(want)] == want
    assert all(b == len(lens) for b, _ in got[len(want):])
