"""TMA + mbarrier ring for the K/V tiles, and the operands its consumers take from it.

Key block ``j`` always lives in ring slot ``j % STAGES``; its ready barrier completes phase
``(j // STAGES) & 1``. K and V have separate barriers so QK^T can start while V is in flight.
Descriptors are rank 4: ``[batch, head, seq, dim]`` for Q/K (and V stored token-major),
``[batch, head, dim, seq]`` for V stored transposed (``V_KMAJOR``: FP8 PV needs a K-major B).
TMA zero-fills everything outside ``[0, seqlen)``, so tail tiles never read a neighbour's data.

Paged K/V (``PAGE_SIZE`` > 0, :func:`load_kv_paged`): the descriptors are over the caches ``(num_pages, page_size,
Hkv, D)`` as ``[page, head, row, dim]``, with boxes of ``min(page_size, BLOCK_N)`` rows; a key block is
``BLOCK_N / box`` boxes (one per page it spans), each into its rows of the block's ring slot. FP8 V
(``V_KMAJOR``): V is read from a dense transposed copy of the V pages made per call, one box per block.
"""

from __future__ import annotations

from .gluon_compat import gl, gluon, mbarrier, tma, warpgroup_mma


@gluon.jit
def alloc_barriers(count: gl.constexpr, arrivals: gl.constexpr = 1):
    """``count`` mbarriers, each completing a phase after ``arrivals`` arrives."""
    bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(bars.index(i), count=arrivals)
    return bars


@gluon.jit
def invalidate_barriers(bars, count: gl.constexpr):
    for i in gl.static_range(count):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def as_2d(buf):
    """View a ``[1, 1, R, C]`` TMA box in shared memory as ``[R, C]``."""
    return buf.reshape([buf.shape[2], buf.shape[3]])


@gluon.jit
def load_q(q_desc, b, h, m_start, bar, q_smem, QK_CHUNKS: gl.constexpr, FIRST: gl.constexpr = 0):
    """Q tile as ``QK_CHUNKS`` boxes along the head dim (TMA boxes are powers of two: 192 = 3 x 64),
    into ``q_smem[FIRST : FIRST + QK_CHUNKS]``."""
    DCHUNK: gl.constexpr = q_desc.block_type.shape[3]
    mbarrier.expect(bar, QK_CHUNKS * q_desc.block_type.nbytes)
    for c in gl.static_range(QK_CHUNKS):
        tma.async_copy_global_to_shared(q_desc, [b, h, m_start, c * DCHUNK], bar, q_smem.index(FIRST + c))


@gluon.jit
def load_kv(k_desc, v_desc, b, hkv, block, k_bufs, v_bufs, k_bars, v_bars,
            STAGES: gl.constexpr, V_KMAJOR: gl.constexpr, QK_CHUNKS: gl.constexpr, k_start=0, ring_index=None,
            v_start=None):
    """Issue the TMA loads of key block ``block`` into its ring slot (K: ``QK_CHUNKS`` boxes).
    ``k_start``: the sequence's first token in the descriptor (varlen: its ``cu_seqlens_k`` entry);
    ``ring_index``: the block's position in the ring when it differs from ``block`` (a persistent
    program's ring runs on across its tiles); ``v_start``: the sequence's first token in V's
    descriptor when it differs from K's (FP8 varlen: V re-packed with every sequence on a multiple
    of 16 tokens, :func:`.launch.align_varlen_v`)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    DCHUNK: gl.constexpr = k_desc.block_type.shape[3]
    if ring_index is None:
        slot = block % STAGES
    else:
        slot = ring_index % STAGES
    n0 = k_start + block * BLOCK_N
    if v_start is None:
        v0 = n0
    else:
        v0 = v_start + block * BLOCK_N
    kb = k_bars.index(slot)
    mbarrier.expect(kb, QK_CHUNKS * k_desc.block_type.nbytes)
    for c in gl.static_range(QK_CHUNKS):
        tma.async_copy_global_to_shared(k_desc, [b, hkv, n0, c * DCHUNK], kb, k_bufs.index(slot * QK_CHUNKS + c))
    vb = v_bars.index(slot)
    mbarrier.expect(vb, v_desc.block_type.nbytes)
    if V_KMAJOR:
        tma.async_copy_global_to_shared(v_desc, [b, hkv, 0, v0], vb, v_bufs.index(slot))
    else:
        tma.async_copy_global_to_shared(v_desc, [b, hkv, v0, 0], vb, v_bufs.index(slot))


@gluon.jit
def box_rows(buf, i, BOX: gl.constexpr):
    """Rows ``[i * BOX, (i + 1) * BOX)`` of a ``[1, 1, rows, cols]`` ring slot (the slot itself when it is one box)."""
    if BOX == buf.shape[2]:
        return buf
    return buf.slice(i * BOX, BOX, dim=2)


@gluon.jit
def page_box(pages, n, seqlen_k, PAGE_SIZE: gl.constexpr):
    """``(page, row)`` of the box holding key ``n`` of a sequence of ``seqlen_k`` keys whose page ids are
    ``pages = (row, stride)`` (its row of the page table): page ``row[(n // PAGE_SIZE) * stride]``, row
    ``n % PAGE_SIZE``. A box past the sequence's last key gets page -1 (TMA zero-fills it: no table entry past
    the sequence is read)."""
    row_ptr, stride = pages
    page = gl.load(row_ptr + (gl.minimum(n, seqlen_k - 1) // PAGE_SIZE) * stride)
    return gl.where(n < seqlen_k, page, -1), n % PAGE_SIZE


@gluon.jit
def load_kv_paged(k_desc, v_desc, hkv, block, k_bufs, v_bufs, k_bars, v_bars, STAGES: gl.constexpr,
                  QK_CHUNKS: gl.constexpr, ring_index, pages, seqlen_k, PAGE_SIZE: gl.constexpr, b=0,
                  V_KMAJOR: gl.constexpr = False):
    """:func:`load_kv` from paged caches: key block ``block`` of a sequence whose page-table row is ``pages`` as
    ``BLOCK_N / box`` boxes (``box = min(PAGE_SIZE, BLOCK_N)``: the descriptors' box rows), box ``i`` into rows
    ``[i * box, (i + 1) * box)`` of the ring slot; each barrier expects the whole block's bytes. Rows of a
    sequence's last page past its keys are read as stored (masked out of the scores: they must be finite).
    ``V_KMAJOR`` (FP8 V): V comes from the call's dense transposed copy of the V pages (:func:`..paged_v.gather_paged_v`,
    ``[batch, head, dim, seq]``), one box ``[b, hkv, 0, block * BLOCK_N]`` as :func:`load_kv` reads it (``b``: the
    sequence, varlen too)."""
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    BOX: gl.constexpr = k_desc.block_type.shape[2]
    BOXES: gl.constexpr = BLOCK_N // BOX
    DCHUNK: gl.constexpr = k_desc.block_type.shape[3]
    slot = ring_index % STAGES
    n0 = block * BLOCK_N
    kb = k_bars.index(slot)
    mbarrier.expect(kb, BOXES * QK_CHUNKS * k_desc.block_type.nbytes)
    for i in gl.static_range(BOXES):
        page, row = page_box(pages, n0 + i * BOX, seqlen_k, PAGE_SIZE)
        for c in gl.static_range(QK_CHUNKS):
            tma.async_copy_global_to_shared(k_desc, [page, hkv, row, c * DCHUNK], kb,
                                            box_rows(k_bufs.index(slot * QK_CHUNKS + c), i, BOX))
    vb = v_bars.index(slot)
    if V_KMAJOR:
        mbarrier.expect(vb, v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hkv, 0, n0], vb, v_bufs.index(slot))
    else:
        mbarrier.expect(vb, BOXES * v_desc.block_type.nbytes)
        for i in gl.static_range(BOXES):
            page, row = page_box(pages, n0 + i * BOX, seqlen_k, PAGE_SIZE)
            tma.async_copy_global_to_shared(v_desc, [page, hkv, row, 0], vb, box_rows(v_bufs.index(slot), i, BOX))


@gluon.jit
def wait_k(k_bars, block, STAGES: gl.constexpr):
    """Wait for key block ``block``; return its ring slot."""
    slot = block % STAGES
    mbarrier.wait(k_bars.index(slot), (block // STAGES) & 1)
    return slot


@gluon.jit
def v_tile(v_bufs, v_bars, block, STAGES: gl.constexpr, V_KMAJOR: gl.constexpr):
    """Wait for value block ``block``; return it as the B operand ``[BLOCK_N, Dv]`` of PV."""
    slot = block % STAGES
    mbarrier.wait(v_bars.index(slot), (block // STAGES) & 1)
    v = as_2d(v_bufs.index(slot))
    if V_KMAJOR:
        v = v.permute((1, 0))
    return v


@gluon.jit
def qk_async(q_smem, Q_FIRST: gl.constexpr, k_bufs, slot, s_zero, QK_CHUNKS: gl.constexpr):
    """Issue S = Q K^T (async wgmmas chained over the head-dim chunks; the caller waits): Q in
    ``q_smem[Q_FIRST : Q_FIRST + QK_CHUNKS]``, K in ring slot ``slot``."""
    s = warpgroup_mma(as_2d(q_smem.index(Q_FIRST)), as_2d(k_bufs.index(slot * QK_CHUNKS)).permute((1, 0)),
                      s_zero, use_acc=False, is_async=True)
    for c in gl.static_range(1, QK_CHUNKS):
        s = warpgroup_mma(as_2d(q_smem.index(Q_FIRST + c)), as_2d(k_bufs.index(slot * QK_CHUNKS + c)).permute((1, 0)),
                          s, is_async=True)
    return s


# ----------------------------------------------------------------------------- warp-specialized ring

@gluon.jit
def produce_kv(k_desc, v_desc, b, hkv, n_end, k_bufs, v_bufs, k_bars, v_bars, empty_bars, V_KMAJOR: gl.constexpr,
               k_start=0, ring_base=0, v_start=None, FIRST=0, pages=None, seqlen_k=0, PAGE_SIZE: gl.constexpr = 0):
    """The producer warp's loop: key blocks ``[FIRST, n_end)`` into the ring, block ``j`` at ring
    position ``g = ring_base + j - FIRST``. Position ``g >= STAGES`` reuses the slot of ``g - STAGES``,
    so it waits for that one's release: phase ``g // STAGES - 1`` of ``empty[g % STAGES]``. (``FIRST``
    = 1 with BF16 sink keys: block 0 is read in 16 bits instead, :mod:`.sink`; a sliding window's first
    block, a runtime value.) ``PAGE_SIZE`` > 0: paged K/V, the sequence's ``seqlen_k`` keys through its
    page-table row ``pages`` (:func:`load_kv_paged`; ``j`` is the sequence's absolute key block, a window's too; with
    ``V_KMAJOR`` V from the dense transposed copy's row ``b``)."""
    STAGES: gl.constexpr = v_bufs.shape[0]
    QK_CHUNKS: gl.constexpr = k_bufs.shape[0] // STAGES
    for j in range(FIRST, n_end):
        g = ring_base + j - FIRST
        if g >= STAGES:
            mbarrier.wait(empty_bars.index(g % STAGES), ((g // STAGES) - 1) & 1)
        if PAGE_SIZE > 0:
            load_kv_paged(k_desc, v_desc, hkv, j, k_bufs, v_bufs, k_bars, v_bars, STAGES, QK_CHUNKS, g, pages,
                          seqlen_k, PAGE_SIZE, b, V_KMAJOR)
        else:
            load_kv(k_desc, v_desc, b, hkv, j, k_bufs, v_bufs, k_bars, v_bars, STAGES, V_KMAJOR, QK_CHUNKS, k_start,
                    g, v_start)


@gluon.jit
def release_slot(empty_bars, slot):
    """A consumer partition is done with ``slot`` (its wgmmas reading it were waited for): a
    barrier over the partition's warps, then one arrive on ``empty[slot]``."""
    gl.thread_barrier()
    mbarrier.arrive(empty_bars.index(slot), count=1)
