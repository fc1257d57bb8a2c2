"""cuDNN attention through the cuDNN frontend (``nvidia-cudnn-frontend==1.15.0``, ``import cudnn``).

Used for cuDNN FP8 (``graph.sdpa_fp8``), which torch's SDPA does not expose, and for cuDNN
BF16 on packed varlen batches (``graph.sdpa`` with ragged offsets). One graph is built per
shape and cached; executing it costs one ``graph.execute`` call.

FP8 the way a cuDNN user runs it on Hopper (what the speed and accuracy comparisons use):

* Q, K, V quantized to e4m3 with one scale per tensor from its amax:
  ``scale = 448 / amax(|x|)``, ``x8 = x·scale``, ``descale = 1/scale``
  (:func:`quantize_per_tensor`);
* P (the softmax probabilities, in [0, 1]) is quantized inside the kernel with
  ``scale_s = 256`` (``descale_s = 1/256``): a power of two, so exact;
* the output must be FP8 on Hopper: ``O8 = O·scale_o``. ``scale_o = 448 / amax(O)``,
  with ``amax(O)`` taken from a first calibration call (cuDNN reports it in ``amax_o``,
  measured before ``scale_o`` is applied) — as delayed scaling does in training stacks;
* the output is dequantized as ``O8 / scale_o`` for the accuracy check.

Layouts: leanfa's ``(B, S, H, D)`` tensors are described to cuDNN as ``(B, H, S, D)`` with
the strides of the BSHD memory, so nothing is copied; packed varlen ``(total, H, D)`` uses
the THD layout with ragged offsets (``cu_seqlens·H·D`` elements) and a padding mask.
Causal is cuDNN's top-left causal mask, which equals flash-attn's bottom-right one for
``Sq == Sk``; a chunked-prefill batch (``Sq < Sk`` per sequence, separate ragged offsets and
lengths for Q and K/V) asks for ``use_causal_mask_bottom_right`` instead. cuDNN frontend 1.15
supports that in BF16 (cuDNN >= 9.3) but in FP8 only on Blackwell, so ``cudnn-fp8`` is "n/a" for
those batches on Hopper (the graph's support check says so).

This code runs only on a GPU: the lead checks it on the H200 before trusting its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest float8_e4m3fn value
SCALE_S = 256.0

_handle = None
_graphs: dict = {}


class Unsupported(Exception):
    """cuDNN cannot build a graph for this shape."""


def cudnn():
    import cudnn as _cudnn  # nvidia-cudnn-frontend

    return _cudnn


def available() -> tuple[bool, str]:
    try:
        mod = cudnn()
    except Exception as e:  # ImportError, or a broken libcudnn
        return False, f"nvidia-cudnn-frontend not importable ({type(e).__name__}: {e})"
    try:
        return True, f"cudnn frontend {getattr(mod, '__version__', '?')}, backend {mod.backend_version()}"
    except Exception as e:
        return False, f"cuDNN backend unavailable ({e})"


def handle():
    """A cuDNN handle bound to torch's current stream (so CUDA events time it)."""
    global _handle
    mod = cudnn()
    if _handle is None:
        _handle = mod.create_handle()
    mod.set_stream(handle=_handle, stream=torch.cuda.current_stream().cuda_stream)
    return _handle


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale)``: e4m3 values scaled by ``448/amax(x)``, and the float32
    ``(1, 1, 1, 1)`` descale that multiplies them back."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    scale = FP8_MAX / amax
    x8 = (x.float() * scale).to(torch.float8_e4m3fn)
    return x8, (1.0 / scale).reshape(1, 1, 1, 1)


def _bshd(b, h, s, d):
    """dims/strides of a contiguous (B, S, H, D) tensor seen as (B, H, S, D)."""
    return [b, h, s, d], [s * h * d, d, h * d, 1]


@dataclass
class SdpaGraph:
    graph: object
    tensors: dict  # name -> cudnn tensor
    workspace: torch.Tensor
    fp8: bool
    ragged: bool

    def variant_pack(self, named: dict) -> dict:
        """Map tensor names to the graph's tensors; unknown names are an error."""
        return {self.tensors[n]: t for n, t in named.items()}

    def execute(self, pack: dict) -> None:
        self.graph.execute(pack, self.workspace, handle=handle())


def get_graph(*, fp8: bool, batch: int, heads: int, kv_heads: int, seqlen: int, head_dim: int,
              head_dim_v: int, causal: bool, softmax_scale: float, ragged: bool,
              device, seqlen_k: int | None = None, bottom_right: bool = False) -> SdpaGraph:
    """The cached graph for this shape (``seqlen`` is the longest query sequence when ragged,
    ``seqlen_k`` the longest key sequence, default ``seqlen``). ``bottom_right``: causal aligned
    bottom-right (flash-attn's mask for ``Sq < Sk``) instead of top-left."""
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    key = (fp8, batch, heads, kv_heads, seqlen, seqlen_k, head_dim, head_dim_v, causal, bottom_right,
           softmax_scale, ragged, str(device))
    if key not in _graphs:
        _graphs[key] = _build(*key[:-1], device=device)
    return _graphs[key]


def _build(fp8, b, hq, hkv, s, s_k, dqk, dv, causal, bottom_right, scale, ragged, *, device) -> SdpaGraph:
    mod = cudnn()
    io = mod.data_type.FP8_E4M3 if fp8 else mod.data_type.BFLOAT16
    g = mod.pygraph(io_data_type=io, intermediate_data_type=mod.data_type.FLOAT,
                    compute_data_type=mod.data_type.FLOAT, handle=handle())
    t: dict = {}
    for name, h, n, d in (("q", hq, s, dqk), ("k", hkv, s_k, dqk), ("v", hkv, s_k, dv)):
        dim, stride = _bshd(b, h, n, d)
        t[name] = g.tensor(name=name, dim=dim, stride=stride, data_type=io)
    extra = {}
    if ragged:
        off_type = mod.data_type.INT64 if mod.backend_version() >= 90600 else mod.data_type.INT32
        for name in ("q", "k", "v", "o"):
            t[f"off_{name}"] = g.tensor(name=f"off_{name}", dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                        data_type=off_type)
        for name in ("q", "k", "v"):
            t[name].set_ragged_offset(t[f"off_{name}"])
        for name in ("seq_q", "seq_kv"):
            t[name] = g.tensor(name=name, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1],
                               data_type=mod.data_type.INT32)
        extra = dict(use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"])
    mask = dict(use_causal_mask=causal and not bottom_right)
    if causal and bottom_right:
        mask["use_causal_mask_bottom_right"] = True
    if fp8:
        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            t[name] = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                               data_type=mod.data_type.FLOAT)
        o, _stats, amax_s, amax_o = g.sdpa_fp8(
            q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"],
            descale_v=t["descale_v"], descale_s=t["descale_s"], scale_s=t["scale_s"],
            scale_o=t["scale_o"], generate_stats=False, attn_scale=scale, name="sdpa_fp8", **mask, **extra)
        for name, a in (("amax_s", amax_s), ("amax_o", amax_o)):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
                mod.data_type.FLOAT)
            t[name] = a
    else:
        o, _stats = g.sdpa(q=t["q"], k=t["k"], v=t["v"], generate_stats=False, attn_scale=scale,
                           name="sdpa", **mask, **extra)
    dim, stride = _bshd(b, hq, s, dv)
    o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(io)
    if ragged:
        o.set_ragged_offset(t["off_o"])
    t["o"] = o
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([mod.heur_mode.A, mod.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as e:  # cudnnGraphNotSupportedError, RuntimeError
        raise Unsupported(f"cuDNN {'FP8' if fp8 else 'BF16'} graph not supported: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    ws = torch.empty(max(1, g.get_workspace_size()), dtype=torch.uint8, device=device)
    return SdpaGraph(g, t, ws, fp8, ragged)


def ragged_tensors(cu_seqlens: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                   head_dim_v: int, cu_seqlens_k: torch.Tensor | None = None) -> dict:
    """Ragged offsets (elements) and sequence lengths for a packed THD batch: Q and O cut by
    ``cu_seqlens``, K and V by ``cu_seqlens_k`` (default the same)."""
    mod = cudnn()
    off_dtype = torch.int64 if mod.backend_version() >= 90600 else torch.int32
    cu_q = cu_seqlens.to(torch.int64)
    cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.to(torch.int64)

    def lens(cu):
        return (cu[1:] - cu[:-1]).to(torch.int32).reshape(-1, 1, 1, 1).contiguous()

    def off(cu, h, d):
        return (cu * (h * d)).to(off_dtype).reshape(-1, 1, 1, 1).contiguous()

    return {"off_q": off(cu_q, heads, head_dim), "off_k": off(cu_k, kv_heads, head_dim),
            "off_v": off(cu_k, kv_heads, head_dim_v), "off_o": off(cu_q, heads, head_dim_v),
            "seq_q": lens(cu_q), "seq_kv": lens(cu_k)}


def scalar(x: float, device) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), float(x), dtype=torch.float32, device=device)
