"""Read the v3 kernel's SM-clock trace (``LEANFA_HOPPER_TRACE=1``, :mod:`leanfa.kernels.hopper.trace`).

The buffer is ``[tiles, warpgroups, 1 + blocks, events]`` int32 (-1 where nothing was written). Per
key block a warpgroup's chain is cut into phases, each ending at one recorded clock (five events; traces
in the older four-event layout, without ``v_wait``, are read too):

* ``softmax``: from the previous block's slot release (block 0: S_0 ready) to the row sum -- the
  scores' mask, scale, row max, exponentials and row sum, P's conversion (ptxas puts the clock
  read after it), and the previous block's PV fold, which ptxas schedules into it;
* ``v_wait``: the barrier over the warpgroup's warps and the wait for V's ring slot;
* ``issue``: PV's issue, the wait for the next K, QK's issue (four events: all of ``v_wait`` too);
* ``mma_wait``: until ``[PV_j, QK_{j+1}]`` retired -- the matrix work, behind any of the other
  warpgroup's wgmmas the tensor pipe runs first;
* ``release``: the barrier over the warpgroup's warps and the slot's arrive.

:func:`summarize` gives the median cycles of each phase over the interior blocks (not a tile's first
or last, which wait for the pipeline or carry the causal mask), how often the two warpgroups of a CTA
were in each pair of phases at once, and the per-tile costs outside the key loop.
"""

from __future__ import annotations

import numpy as np

PHASES = ("softmax", "v_wait", "issue", "mma_wait", "release")
PHASES_4 = ("softmax", "issue", "mma_wait", "release")  # the older four-event layout (no v_wait)
WRAP = 1 << 32


def phases(trace: np.ndarray) -> tuple[str, ...]:
    """The phase names of a trace, by its number of events per block."""
    n = np.asarray(trace).shape[-1]
    return {len(PHASES): PHASES, len(PHASES_4): PHASES_4}[n]


def _clock(x: np.ndarray) -> np.ndarray:
    """int32 clocks as int64 in [0, 2^32) (``%clock`` wraps)."""
    return x.astype(np.int64) & (WRAP - 1)


def _since(later: np.ndarray, earlier: np.ndarray) -> np.ndarray:
    """Cycles from ``earlier`` to ``later`` (modulo the 32-bit wrap)."""
    return (later - earlier) % WRAP


def block_phases(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(cycles [tiles, wgs, blocks, phases], valid [tiles, wgs, blocks])``: each block's phase
    lengths; ``valid`` where the block and the clock it starts from were both recorded."""
    raw = np.asarray(trace)
    hdr, ev = raw[:, :, 0, :], raw[:, :, 1:, :]
    recorded = (ev != -1).all(axis=-1)
    start_raw = np.concatenate([hdr[:, :, None, 2], ev[:, :, :-1, -1]], axis=2)
    start_ok = np.concatenate([hdr[:, :, None, 2] != -1, recorded[:, :, :-1]], axis=2)
    c, start = _clock(ev), _clock(start_raw)
    bounds = np.concatenate([start[..., None], c], axis=-1)
    cycles = _since(bounds[..., 1:], bounds[..., :-1])
    return cycles, recorded & start_ok


def interior(valid: np.ndarray) -> np.ndarray:
    """``valid`` without each (tile, warpgroup)'s first and last recorded block."""
    n = valid.sum(axis=-1, keepdims=True)
    j = np.arange(valid.shape[-1])
    return valid & (j >= 1) & (j < n - 1)


def joint_phases(trace: np.ndarray, tiles=None) -> dict:
    """Share of the time both warpgroups of a tile spend in each pair of phases, over the span in
    which both are in their key loop (two warpgroups only). Keys ``"softmax/mma_wait"`` etc.
    (warpgroup 0's phase first)."""
    raw = np.asarray(trace)
    if raw.shape[1] < 2:
        return {}
    tiles = range(raw.shape[0]) if tiles is None else tiles
    names = phases(raw)
    n_ph = len(names)
    acc = np.zeros((n_ph, n_ph))
    for t in tiles:
        seqs = []
        for w in (0, 1):
            hdr, ev = raw[t, w, 0], raw[t, w, 1:]
            rec = (ev != -1).all(axis=-1)
            n = int(np.argmin(rec)) if not rec.all() else len(rec)  # recorded blocks are a prefix
            if n == 0 or hdr[2] == -1:
                break
            b = np.concatenate([[hdr[2]], ev[:n].reshape(-1)]).astype(np.int64) & (WRAP - 1)
            seqs.append(b[0] + np.cumsum(np.concatenate([[0], _since(b[1:], b[:-1])])))  # unwrapped
        if len(seqs) < 2:
            continue
        lo, hi = max(s[0] for s in seqs), min(s[-1] for s in seqs)
        if hi <= lo:
            continue
        cuts = np.unique(np.concatenate([s[(s > lo) & (s < hi)] for s in seqs] + [[lo, hi]]))
        mids = (cuts[:-1] + cuts[1:]) / 2
        states = [(np.searchsorted(s, mids, side="right") - 1) % n_ph for s in seqs]
        np.add.at(acc, (states[0], states[1]), np.diff(cuts))
    total = acc.sum()
    if total == 0:
        return {}
    return {f"{names[a]}/{names[b]}": acc[a, b] / total for a in range(n_ph) for b in range(n_ph)}


def tile_costs(trace: np.ndarray) -> dict:
    """Median cycles per tile outside the key loop: ``fill`` (Q wait to S_0 ready), ``epilogue``
    (the last release to the output stored) and ``turnover`` (on one SM, the previous tile's last
    store to the next tile's first clock: the CTA exit and launch)."""
    raw = np.asarray(trace)
    hdr, ev = raw[:, :, 0, :], raw[:, :, 1:, :]
    rec = (ev != -1).all(axis=-1)
    out = {}
    ok = (hdr[..., 1] != -1) & (hdr[..., 2] != -1)
    if ok.any():
        out["fill"] = float(np.median(_since(_clock(hdr[..., 2]), _clock(hdr[..., 1]))[ok]))
    n = rec.sum(axis=-1)
    has = (n > 0) & (hdr[..., 3] != -1)  # (a tile of more than the recorded blocks counts the rest here)
    if has.any():
        last = np.take_along_axis(_clock(ev[..., -1]), np.maximum(n - 1, 0)[..., None], axis=-1)[..., 0]
        out["epilogue"] = float(np.median(_since(_clock(hdr[..., 3]), last)[has]))
    gaps = []
    full = (hdr[:, :, 0] != -1).all(axis=1) & (hdr[:, :, 1] != -1).all(axis=1) & (hdr[:, :, 3] != -1).all(axis=1)
    sm = hdr[:, 0, 0]
    for s in np.unique(sm[full]):
        idx = np.nonzero(full & (sm == s))[0]
        begin = _clock(hdr[idx, :, 1]).min(axis=1)
        end = _clock(hdr[idx, :, 3]).max(axis=1)
        order = np.argsort(begin)  # (a wrap inside one SM's sequence only misorders one pair)
        d = begin[order][1:] - end[order][:-1]
        gaps.extend(d[(d >= 0) & (d < 1 << 20)].tolist())
    if gaps:
        out["turnover"] = float(np.median(gaps))
    return out


def summarize(trace: np.ndarray, overlap_tiles: int = 256) -> dict:
    """Median cycles per phase (per warpgroup, interior blocks), the block period, the joint
    phases of the two warpgroups (on up to ``overlap_tiles`` tiles, evenly spread) and the per-tile
    costs."""
    cycles, valid = block_phases(trace)
    inner = interior(valid)
    names = phases(trace)
    out = {"blocks": int(inner.sum()), "phases": list(names), "per_wg": []}
    for w in range(cycles.shape[1]):
        sel = inner[:, w]
        if not sel.any():
            continue
        c = cycles[:, w][sel]
        row = {p: float(np.median(c[:, i])) for i, p in enumerate(names)}
        row["period"] = float(np.median(c.sum(axis=1)))
        row["blocks"] = int(sel.sum())
        out["per_wg"].append(row)
    n = np.asarray(trace).shape[0]
    out["joint"] = joint_phases(trace, np.linspace(0, n - 1, min(n, overlap_tiles)).astype(int))
    out["tile"] = tile_costs(trace)
    return out


def format_summary(s: dict) -> str:
    names = tuple(s.get("phases", PHASES)) + ("period", )
    lines = [f"  interior blocks: {s['blocks']}"]
    lines.append("  wg  " + " ".join(f"{p:>9s}" for p in names) + "   (median cycles per block)")
    for w, r in enumerate(s["per_wg"]):
        lines.append(f"  {w:2d}  " + " ".join(f"{r[p]:9.0f}" for p in names))
    if s["joint"]:
        top = sorted(s["joint"].items(), key=lambda kv: -kv[1])
        lines.append("  both warpgroups at once (wg0/wg1, share of the loop's time): "
                     + ", ".join(f"{k} {v:.0%}" for k, v in top if v >= 0.02))
        mma = sum(v for k, v in s["joint"].items() if "mma_wait" in k)
        both = s["joint"].get("mma_wait/mma_wait", 0.0)
        lines.append(f"  at least one warpgroup waiting for its wgmmas: {mma:.0%}; both: {both:.0%}")
    if s["tile"]:
        lines.append("  per tile: " + ", ".join(f"{k} {v:.0f}" for k, v in s["tile"].items()) + " cycles")
    return "\n".join(lines)


def plot_timeline(trace: np.ndarray, tile: int, path: str, blocks: tuple[int, int] = (0, 12)) -> None:
    """The phases of both warpgroups of ``tile`` over key blocks ``blocks`` (a PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw = np.asarray(trace)
    names = phases(raw)
    colors = dict(zip(PHASES, ("tab:orange", "tab:red", "tab:gray", "tab:blue", "tab:green")))
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * raw.shape[1]))
    t0 = None
    for w in range(raw.shape[1]):
        hdr, ev = raw[tile, w, 0], raw[tile, w, 1:]
        lo, hi = blocks
        starts = [hdr[2]] + list(ev[:, -1])
        for j in range(lo, min(hi, ev.shape[0])):
            if (ev[j] == -1).any() or starts[j] == -1:
                break
            b = np.concatenate([[starts[j]], ev[j]]).astype(np.int64) & (WRAP - 1)
            t0 = b[0] if t0 is None else t0
            x = b[0] - t0 + np.concatenate([[0], np.cumsum(_since(b[1:], b[:-1]))])
            for i, p in enumerate(names):
                ax.broken_barh([(x[i], x[i + 1] - x[i])], (w - 0.4, 0.8), color=colors[p],
                               label=p if (w, j) == (0, lo) else None)
    ax.set_yticks(range(raw.shape[1]), [f"warpgroup {w}" for w in range(raw.shape[1])])
    ax.set_xlabel("SM clock cycles")
    ax.legend(loc="upper right", ncol=len(names), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
