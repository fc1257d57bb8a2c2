"""The clock-trace reader (leanfa.bench.chain_trace) on synthetic traces with known phase lengths."""

import numpy as np
import pytest

from leanfa.bench import chain_trace as ct

PHASE_LEN = (500, 60, 40, 400, 50)  # softmax, v_wait, issue, mma_wait, release
PHASE_LEN_4 = (500, 100, 400, 50)  # the four-event traces of runs 34-39: softmax, issue, mma_wait, release
PERIOD = sum(PHASE_LEN)
assert PERIOD == sum(PHASE_LEN_4)


def synthetic(tiles=3, wgs=2, blocks=10, slots=16, base=1000, offset=0, fill=300, epilogue=200, gap=0, sm_of=None,
              phase_len=PHASE_LEN):
    """Every block takes ``phase_len``; warpgroup w starts ``w * offset`` cycles later; tiles on one SM
    follow each other ``gap`` cycles apart."""
    tr = np.full((tiles, wgs, 1 + slots, len(phase_len)), -1, dtype=np.int64)
    t = base
    for i in range(tiles):
        end = t
        for w in range(wgs):
            q = t + w * offset
            s0 = q + fill
            tr[i, w, 0, :4] = [0 if sm_of is None else sm_of(i), q, s0, 0]
            clk = s0
            for j in range(blocks):
                for e, d in enumerate(phase_len):
                    clk += d
                    tr[i, w, 1 + j, e] = clk
            tr[i, w, 0, 3] = clk + epilogue
            end = max(end, clk + epilogue)
        t = end + gap
    return (tr & 0xFFFFFFFF).astype(np.uint32).view(np.int32)  # as the kernel stores them (wrapping)


@pytest.mark.parametrize("phase_len,names", [(PHASE_LEN, ct.PHASES), (PHASE_LEN_4, ct.PHASES_4)])
def test_phases_recovered_exactly_across_the_clock_wrap(phase_len, names):
    tr = synthetic(base=(1 << 32) - 3 * PERIOD, phase_len=phase_len)  # the 32-bit clock wraps in tile 0
    assert ct.phases(tr) == names
    cycles, valid = ct.block_phases(tr)
    assert valid[:, :, :10].all() and not valid[:, :, 10:].any()
    assert (cycles[valid] == np.array(phase_len)).all()
    s = ct.summarize(tr)
    assert s["blocks"] == 3 * 2 * 8  # first and last block of each tile and warpgroup left out
    for row in s["per_wg"]:
        assert [row[p] for p in names] == list(phase_len) and row["period"] == PERIOD
    assert ct.tile_costs(tr)["epilogue"] == 200


def _brute_joint(tr):
    """Joint phase shares by walking every cycle (independent of the reader's interval merge)."""
    n_ph = tr.shape[-1]
    counts = np.zeros((n_ph, n_ph))
    raw = tr.astype(np.int64) & 0xFFFFFFFF
    for t in range(raw.shape[0]):
        spans = []
        for w in (0, 1):
            b = np.concatenate([[raw[t, w, 0, 2]], raw[t, w, 1:][(raw[t, w, 1:] != 0xFFFFFFFF).all(-1)].ravel()])
            spans.append(b)
        lo, hi = max(s[0] for s in spans), min(s[-1] for s in spans)
        for c in range(lo, hi):
            st = [(np.searchsorted(s, c + 0.5) - 1) % n_ph for s in spans]
            counts[st[0], st[1]] += 1
    return counts / counts.sum()


@pytest.mark.parametrize("offset", [0, 525, 130])
def test_joint_phases_match_a_cycle_by_cycle_count(offset):
    tr = synthetic(tiles=2, blocks=6, offset=offset)
    got = ct.joint_phases(tr)
    want = _brute_joint(tr)
    for a, pa in enumerate(ct.PHASES):
        for b, pb in enumerate(ct.PHASES):
            assert got[f"{pa}/{pb}"] == pytest.approx(want[a, b], abs=1e-9)
    if offset == 0:  # in lockstep only the diagonal is ever occupied
        assert sum(got[f"{p}/{p}"] for p in ct.PHASES) == pytest.approx(1.0)
    else:
        assert got["softmax/softmax"] < 500 / PERIOD


def test_tile_costs():
    tr = synthetic(tiles=4, fill=300, epilogue=200, gap=77, sm_of=lambda i: i % 2)
    c = ct.tile_costs(tr)
    assert c["fill"] == 300 and c["epilogue"] == 200
    # tiles alternate between two SMs: one SM's consecutive tiles are two tiles apart
    assert c["turnover"] == pytest.approx(77 + (PERIOD * 10 + 300 + 200) + 77)


def test_unwritten_trace_gives_nothing():
    tr = np.full((2, 2, 5, 5), -1, dtype=np.int32)
    s = ct.summarize(tr)
    assert s["blocks"] == 0 and s["per_wg"] == [] and s["joint"] == {} and s["tile"] == {}


def test_format_and_plot(tmp_path):
    tr = synthetic(offset=525)
    text = ct.format_summary(ct.summarize(tr))
    assert "softmax" in text and "both warpgroups" in text
    path = tmp_path / "timeline.png"
    ct.plot_timeline(tr, 0, str(path), (0, 4))
    assert path.stat().st_size > 1000
