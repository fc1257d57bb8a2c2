"""Float64 reference attention with exactly leanfa's semantics.

Same arguments as :func:`leanfa.flash_attn_func` / :func:`leanfa.flash_attn_varlen_func`
(GQA, bottom-right causal mask, sliding window, softcap, descales, K-smoothing mean, LSE, paged K/V), computed
in float64 on the
inputs' device and chunked over queries so a 32K-token check fits in GPU memory: a chunk's
float64 score temporaries (all heads x chunk rows x keys) stay under :data:`SCORE_BYTES`. Rows that
see no key give output 0 and LSE ``-inf``.
"""

from __future__ import annotations

import math

import torch

from . import scales

#: Bytes a query chunk's float64 score temporaries may take (scores, the masked copy, P: three
#: ``(Hq, rows, Sk)`` tensors). A fixed row count does not bound them: at DeepSeek's 128 heads and 32K
#: keys, one such tensor of a 2048-row chunk is 64 GiB.
SCORE_BYTES = 6 << 30


def _dequantize(x: torch.Tensor, token_scale: torch.Tensor, seqlen: int) -> torch.Tensor:
    """x (S, H, D) of one sequence times its per-token-block scale table (H, nblk)."""
    x = x.double()
    # a one-block table (per tensor / per head) applies to every token
    idx = (torch.arange(seqlen, device=x.device) // scales.SCALE_BLOCK).clamp(max=token_scale.shape[-1] - 1)
    per_token = token_scale.double()[:, idx]  # (H, S)
    return x * per_token.transpose(0, 1).unsqueeze(-1)


def _one_sequence(q, k, v, *, causal, scale, q_tab, k_tab, v_tab, k_mean, chunk, window=(-1, -1), softcap=0.0,
                  attention_chunk=0, qv=None):
    """q (Sq, Hq, D), k (Sk, Hkv, D), v (Sk, Hkv, Dv) of one sequence (qv (Sq, Hq, Dv) or None) -> out (Sq,Hq,Dv),
    lse (Hq,Sq)."""
    sq, hq, _ = q.shape
    sk, hkv, dv = v.shape
    group = hq // hkv
    qd = _dequantize(q, q_tab, sq)  # (Sq, Hq, D)
    kd = _dequantize(k, k_tab, sk)
    if k_mean is not None:  # undo K smoothing: the real K is the stored K plus the mean
        kd = kd + k_mean.double().unsqueeze(0)
    vd = v.double() * v_tab.double().unsqueeze(0)
    qvd = None if qv is None else _dequantize(qv, q_tab, sq)  # (FA3: qv shares q's descale)
    kd = kd.repeat_interleave(group, dim=1).permute(1, 2, 0)  # (Hq, D, Sk)
    vd = vd.repeat_interleave(group, dim=1).permute(1, 0, 2)  # (Hq, Sk, Dv)
    out = torch.zeros((sq, hq, dv), dtype=torch.float64, device=q.device)
    lse = torch.full((hq, sq), -math.inf, dtype=torch.float64, device=q.device)
    if sq == 0:
        return out, lse
    cols = torch.arange(sk, device=q.device)
    chunk = max(1, min(chunk, SCORE_BYTES // (3 * 8 * hq * max(sk, 1))))
    for start in range(0, sq, chunk):
        stop = min(sq, start + chunk)
        s = torch.matmul(qd[start:stop].permute(1, 0, 2), kd)  # (Hq, c, Sk)
        if qvd is not None:
            s = s + torch.matmul(qvd[start:stop].permute(1, 0, 2), vd.transpose(1, 2))
        s = s * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(start, stop, device=q.device) + (sk - sq)  # the queries' key positions
        left, right = window
        if causal:  # flash-attn: causal is a right side of 0
            right = 0
        hidden = torch.zeros((stop - start, sk), dtype=torch.bool, device=q.device)
        if right >= 0:
            hidden |= cols[None, :] > pos[:, None] + right
        if left >= 0:
            hidden |= cols[None, :] < pos[:, None] - left
        if attention_chunk > 0:  # keys outside the query's chunk (floor division: pos may be negative)
            first = torch.div(pos, attention_chunk, rounding_mode="floor") * attention_chunk
            hidden |= (cols[None, :] < first[:, None]) | (cols[None, :] >= first[:, None] + attention_chunk)
        s = s.masked_fill(hidden[None], -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # (Hq, c); -inf for empty rows
        p = torch.exp(s - row_lse.nan_to_num(neginf=0.0).unsqueeze(-1))
        p = torch.where(torch.isneginf(row_lse).unsqueeze(-1), torch.zeros_like(p), p)
        out[start:stop] = torch.matmul(p, vd).permute(1, 0, 2)
        lse[:, start:stop] = row_lse
    return out, lse


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` keys of one sequence of a paged cache ``(num_pages, page_size, H, D)`` whose pages are
    ``pages`` (its page table row), as a contiguous ``(n, H, D)`` tensor."""
    page_size = cache.shape[1]
    used = pages[: -(-n // page_size)].long().to(cache.device)
    return cache[used].reshape(-1, *cache.shape[2:])[:n]


def attention_ref(
    q,
    k=None,
    v=None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    return_lse: bool = False,
    chunk_size: int = 2048,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    page_table: torch.Tensor | None = None,
    seqlens_k: torch.Tensor | None = None,
    cu_seqlens_v: torch.Tensor | None = None,
    attention_chunk: int = 0,
    qv: torch.Tensor | None = None,
):
    """Float64 attention. Dense: q (B,Sq,Hq,D) -> out (B,Sq,Hq,Dv), lse (B,Hq,Sq).
    ``window_size=(left, right)``: query ``i`` at key position ``p = i + Sk - Sq`` sees keys
    ``p - left <= j <= p + right`` (-1: unbounded; ``causal`` bounds the right side at ``p``);
    ``softcap > 0`` caps the scaled scores to ``softcap * tanh(s / softcap)`` before the softmax.
    ``attention_chunk = c > 0``: query ``i`` sees only keys in ``[floor(p / c) * c, floor(p / c) * c + c)`` (with the
    window and ``causal``). ``qv`` (q's layout with V's head dim; FP8: dequantized by ``q_descale``): the scores are
    ``softmax_scale * (q.k + qv.v)``, ``softmax_scale`` defaulting to ``1/sqrt(D + Dv)``.
    Varlen (``cu_seqlens_*`` given): q (total_q,Hq,D) -> out (total_q,Hq,Dv), lse (Hq,total_q).
    ``q`` may be an :class:`leanfa.FP8QKV` (then k, v and descales come from it). ``cu_seqlens_v``: a packed V
    in :func:`leanfa.quantize_fp8`'s aligned layout (sequence ``b``'s keys from token ``cu_seqlens_v[b]``).

    Paged K/V (``page_table`` int ``(B, max_pages)``): k, v are caches ``(num_pages, page_size, Hkv, D)``;
    sequence ``b``'s keys are gathered (:func:`gather_pages`) to a contiguous ``(Sk_b, Hkv, D)``, its length
    ``Sk_b`` from ``seqlens_k``, else ``cu_seqlens_k``'s differences, else the table row's capacity; q is dense,
    or packed with ``cu_seqlens_q``. ``seqlens_k`` (``(B,)``) also cuts dense or per-sequence ``(B, Sk)`` K/V to
    their first ``seqlens_k[b]`` keys (FA3's ``seqused_k``/``cache_seqlens``); with ``cu_seqlens_q`` and no
    ``cu_seqlens_k``, K/V are such per-sequence tensors."""
    from .quant import FP8QKV

    if isinstance(q, FP8QKV):
        q, k, v, q_descale, k_descale, v_descale, k_mean, cu_seqlens_v = (
            q.q, q.k, q.v, q.q_descale, q.k_descale, q.v_descale, q.k_mean, q.cu_seqlens_v)
    varlen = cu_seqlens_q is not None
    default_dim = q.shape[-1] + (v.shape[-1] if qv is not None else 0)
    scale = 1.0 / math.sqrt(default_dim) if softmax_scale is None else float(softmax_scale)
    hq, hkv, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    k_packed = cu_seqlens_k is not None and page_table is None
    if varlen:
        cq = [int(x) for x in cu_seqlens_q.tolist()]
        batch = len(cq) - 1
        q_spans = [(cq[b], cq[b + 1]) for b in range(batch)]
        max_q = max(1, max(b - a for a, b in zip(cq, cq[1:])))
    else:
        batch = q.shape[0]
        max_q = q.shape[1]
    if cu_seqlens_k is not None:
        ck = [int(x) for x in cu_seqlens_k.tolist()]
        k_spans = [(ck[b], ck[b + 1]) for b in range(batch)]
        max_k = max(1, max(b - a for a, b in zip(ck, ck[1:])))
        cv = ck if cu_seqlens_v is None else [int(x) for x in cu_seqlens_v.tolist()]
    else:
        k_spans = None
        max_k = page_table.shape[1] * k.shape[1] if page_table is not None else k.shape[1]
    used_k = None if seqlens_k is None else [int(x) for x in seqlens_k.tolist()]
    dev = q.device
    q_tab = scales.token_scale_table("q_descale", q_descale, batch=batch, heads=hq, kv_heads=hkv,
                                     max_seqlen=max_q, device=dev)
    k_tab = scales.token_scale_table("k_descale", k_descale, batch=batch, heads=hkv, kv_heads=hkv,
                                     max_seqlen=max_k, device=dev)
    v_tab = scales.channel_scale_table("v_descale", v_descale, batch=batch, kv_heads=hkv,
                                       head_dim=dv, device=dev)
    outs, lses = [], []
    for b in range(batch):
        qs = q[q_spans[b][0]:q_spans[b][1]] if varlen else q[b]
        qvs = None if qv is None else (qv[q_spans[b][0]:q_spans[b][1]] if varlen else qv[b])
        if page_table is not None:
            n = k_spans[b][1] - k_spans[b][0] if k_spans is not None else max_k
            n = n if used_k is None else min(n, used_k[b])
            ks, vs = gather_pages(k, page_table[b], n), gather_pages(v, page_table[b], n)
        elif k_packed:
            ks, vs = k[k_spans[b][0]:k_spans[b][1]], v[cv[b]:cv[b] + k_spans[b][1] - k_spans[b][0]]
        else:
            ks, vs = k[b], v[b]
        if used_k is not None:
            ks, vs = ks[:used_k[b]], vs[:used_k[b]]
        o, l = _one_sequence(qs, ks, vs, causal=causal, scale=scale, q_tab=q_tab[b], k_tab=k_tab[b],
                             v_tab=v_tab[b], k_mean=None if k_mean is None else k_mean[b],
                             chunk=chunk_size, window=tuple(window_size), softcap=float(softcap),
                             attention_chunk=int(attention_chunk), qv=qvs)
        outs.append(o)
        lses.append(l)
    if varlen:
        out, lse = torch.cat(outs, 0), torch.cat(lses, 1)
    else:
        out, lse = torch.stack(outs, 0), torch.stack(lses, 0)
    return (out, lse) if return_lse else out
