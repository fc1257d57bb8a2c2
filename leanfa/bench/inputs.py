"""Make the Q/K/V of a benchmark case (never zeros), and several copies for L2 rotation.

The ``gaussian`` profile is standard-normal Q/K/V (as in the FA3 paper's benchmark) made
here, for any head dims; every other profile (a model preset, or a path to a captured
``.safetensors`` file) comes from :func:`leanfa.activations.make_qkv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .shapes import Case


@dataclass
class Inputs:
    """BF16 inputs of one case: ``(B, S, H, D)``, or packed ``(total, H, D)`` with
    int32 ``cu_seqlens`` for a varlen case.

    ``cu_seqlens``/``max_seqlen`` cut the queries (also spelled ``cu_seqlens_q``/``max_seqlen_q``);
    ``cu_seqlens_k``/``max_seqlen_k`` cut the keys and values, and equal the query ones unless
    the case is a chunked-prefill batch (then K and V have more tokens than Q). A caller passes
    ``cu_seqlens_q`` and ``cu_seqlens_k`` to every varlen call."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int | None = None

    def __post_init__(self):
        if self.cu_seqlens is None:
            if self.cu_seqlens_k is not None:
                raise ValueError("cu_seqlens_k without cu_seqlens")
            return
        if self.cu_seqlens_k is None:
            self.cu_seqlens_k, self.max_seqlen_k = self.cu_seqlens, self.max_seqlen

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def cu_seqlens_q(self) -> torch.Tensor | None:
        return self.cu_seqlens

    @property
    def max_seqlen_q(self) -> int | None:
        return self.max_seqlen

    def varlen_kw(self) -> dict:
        """``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k`` (flash-attn's names)."""
        return dict(cu_seqlens_q=self.cu_seqlens, cu_seqlens_k=self.cu_seqlens_k, max_seqlen_q=self.max_seqlen,
                    max_seqlen_k=self.max_seqlen_k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v))


def _gaussian(case: Case, tokens_shape, seed: int, device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for heads, dim in ((case.heads, case.head_dim), (case.kv_heads, case.head_dim),
                       (case.kv_heads, case.head_dim_v)):
        t = torch.randn(*tokens_shape, heads, dim, generator=gen, device=device, dtype=torch.float32)
        out.append(t.to(torch.bfloat16))
    return tuple(out)


def _profile(case: Case, batch: int, seqlen: int, seed: int, device) -> tuple[torch.Tensor, ...]:
    from leanfa.activations import make_qkv

    q, k, v = make_qkv(case.preset, batch, seqlen, heads=case.heads, kv_heads=case.kv_heads,
                       seed=seed, device=device, dtype=torch.bfloat16)
    want = ((batch, seqlen, case.heads, case.head_dim), (batch, seqlen, case.kv_heads, case.head_dim),
            (batch, seqlen, case.kv_heads, case.head_dim_v))
    got = tuple(tuple(t.shape) for t in (q, k, v))
    if got != want:
        raise ValueError(f"make_qkv({case.preset!r}) gave shapes {got}, expected {want}")
    return q, k, v


def cu_seqlens_of(seqlens, device) -> torch.Tensor:
    cu = [0]
    for s in seqlens:
        cu.append(cu[-1] + int(s))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def chunk_query_index(seqlens_q, seqlens_k, device) -> torch.Tensor:
    """Positions, among the packed key tokens, of each sequence's queries: the last ``Sq`` of
    its ``Sk`` tokens (a chunk after its prefix; int64)."""
    idx, start = [], 0
    for sq, sk in zip(seqlens_q, seqlens_k):
        idx.append(torch.arange(start + sk - sq, start + sk, device=device))
        start += sk
    return torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long, device=device)


def make_inputs(case: Case, *, device="cuda", seed: int = 0) -> Inputs:
    """The case's BF16 inputs on ``device``; a varlen batch is made as one long sequence
    of ``sum(seqlens)`` tokens and cut by ``cu_seqlens``. A chunked-prefill batch makes that
    sequence with its key tokens (``sum(seqlens_k)``): K and V are all of it, cut by
    ``cu_seqlens_k``, and Q is each sequence's last ``Sq`` tokens (the chunk), cut by ``cu_seqlens``."""
    if case.varlen:
        shape = (case.tokens_k,)
        if case.preset == "gaussian":
            q, k, v = _gaussian(case, shape, seed, device)
        else:
            q, k, v = (t[0] for t in _profile(case, 1, case.tokens_k, seed, device))
        if case.chunked:
            q = q[chunk_query_index(case.seqlens, case.seqlens_k, q.device)]
        return Inputs(q.contiguous(), k.contiguous(), v.contiguous(),
                      cu_seqlens_of(case.seqlens, device), max(case.seqlens),
                      cu_seqlens_of(case.key_seqlens, device), max(case.key_seqlens))
    if case.preset == "gaussian":
        q, k, v = _gaussian(case, (case.batch, case.seqlen), seed, device)
    else:
        q, k, v = _profile(case, case.batch, case.seqlen, seed, device)
    return Inputs(q.contiguous(), k.contiguous(), v.contiguous())


#: what the cache rows no sequence uses hold (a page's tail, the spare page): large and finite, so a kernel
#: that read them would fail the float64 check instead of passing on zeros
PAGE_FILL = {torch.bfloat16: 8192.0, torch.float16: 8192.0, torch.float8_e4m3fn: 448.0}


@dataclass
class PagedKV:
    """A packed batch's K and V in paged caches ``(num_pages, page_size, Hkv, D)``, and the int32 page table
    ``(B, max_pages_per_seq)`` of flash-attn's ``page_table``/``block_table``: key position ``n`` of sequence
    ``b`` is row ``n % page_size`` of page ``page_table[b, n // page_size]``."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]


def paged_kv(k: torch.Tensor, v: torch.Tensor, seqlens_k, page_size: int, *, seed: int = 0) -> PagedKV:
    """The packed ``k``/``v`` ``(total_k, Hkv, D)`` (sequences of ``seqlens_k`` tokens, in order) copied into
    paged caches: each sequence gets ``ceil(len / page_size)`` pages, all pages in a random order (``seed``),
    one spare page filled with :data:`PAGE_FILL`, to which the table's unused entries point. Rows past a
    sequence's end hold :data:`PAGE_FILL` too. Same dtype and device as ``k``/``v``."""
    lengths = [int(n) for n in seqlens_k]
    if sum(lengths) != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"seqlens_k sum to {sum(lengths)} keys; k has {k.shape[0]}, v {v.shape[0]}")
    device = k.device
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + 1
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    spare = int(order[-1])
    table = torch.full((len(lengths), max(need + [1])), spare, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = order[start:start + n].to(torch.int32)
        start += n
    table = table.to(device)
    fill = PAGE_FILL[k.dtype]
    k_cache = torch.full((num_pages, page_size, *k.shape[1:]), fill, dtype=k.dtype, device=device)
    v_cache = torch.full((num_pages, page_size, *v.shape[1:]), fill, dtype=v.dtype, device=device)
    seq, pos = _token_positions(lengths, device)
    pages = table[seq, pos // page_size].long()
    k_cache[pages, pos % page_size] = k
    v_cache[pages, pos % page_size] = v
    return PagedKV(k_cache, v_cache, table)


def _token_positions(lengths, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position in the sequence) of every packed token, int64."""
    n = torch.tensor(lengths, dtype=torch.long, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), n)
    starts = torch.cumsum(n, 0) - n
    return seq, torch.arange(int(n.sum()), device=device) - starts[seq]


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, seqlens_k) -> torch.Tensor:
    """The packed ``(total_k, H, D)`` tokens of a paged cache: what :func:`paged_kv` was given."""
    seq, pos = _token_positions([int(n) for n in seqlens_k], cache.device)
    page_size = cache.shape[1]
    return cache[page_table[seq, pos // page_size].long(), pos % page_size]


def input_bytes(case: Case) -> int:
    """Bytes of one BF16 Q/K/V set of ``case``."""
    q_token = case.heads * case.head_dim
    kv_token = case.kv_heads * (case.head_dim + case.head_dim_v)
    return 2 * (case.tokens * q_token + case.tokens_k * kv_token)


def copies_for(bytes_per_copy: int, *, l2_bytes: int, factor: int = 4, max_copies: int = 4,
               max_total_bytes: int = 8 << 30) -> int:
    """How many input copies to rotate so the working set is ``factor`` times the L2
    (at most ``max_copies`` and ``max_total_bytes``; at least 1)."""
    if bytes_per_copy <= 0:
        return 1
    n = math.ceil(factor * l2_bytes / bytes_per_copy)
    n = min(n, max_copies, max(1, max_total_bytes // bytes_per_copy))
    return max(1, n)


def make_copies(case: Case, n: int, *, device="cuda", seed: int = 0) -> list[Inputs]:
    """``n`` distinct input sets: copy 0 from ``seed``, the others clones of it (same data,
    other addresses), which is all L2 rotation needs and keeps the check valid for all."""
    first = make_inputs(case, device=device, seed=seed)
    out = [first]
    for _ in range(n - 1):
        out.append(Inputs(first.q.clone(), first.k.clone(), first.v.clone(), first.cu_seqlens,
                          first.max_seqlen, first.cu_seqlens_k, first.max_seqlen_k))
    return out
