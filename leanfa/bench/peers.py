"""The peers a leanfa row is measured against, and the ratio to the best of them.

A *peer* is another library's attention kernel of the same precision, timed on the same case in
the same run. :data:`PEERS` lists them per precision; for every "ok" row,
:func:`add_best_peer` finds the fastest peer row that ran ("ok") on the row's case and adds

* ``best_peer``: that peer's implementation name, ``best_peer_tflops``: its TFLOP/s;
* ``ratio_best_peer``: the row's TFLOP/s over the best peer's (> 1: faster than every peer);

or ``best_peer = None`` when no peer of that precision ran on the case (then there is no ratio).
:func:`add_best_peer_error` does the same for ``leanfa accuracy`` rows, where the best peer is
the most accurate one (lowest relative L2) on the same profile.

Plain dicts in and out, no torch: the report writers use it on saved JSON too.
"""

from __future__ import annotations

import math

#: precision -> the peer implementations its rows are compared with (kernels alone: inputs
#: already in the kernel's format). cudnn-bf16 is torch SDPA's cuDNN backend; fa3-* is
#: FlashAttention-3 (the ``fa3-fwd`` wheel, or ``flash_attn_interface``).
PEERS: dict[str, tuple[str, ...]] = {
    "fp8": ("cudnn-fp8", "fa3-fp8"),
    "bf16": ("cudnn-bf16", "fa3-bf16"),
    "fp16": ("cudnn-fp16", "fa3-fp16"),
}


def peers_for(precision: str) -> tuple[str, ...]:
    """The peer implementation names of ``precision`` (none for an unknown precision)."""
    return PEERS.get(precision, ())


def is_peer(impl: str) -> bool:
    return any(impl in names for names in PEERS.values())


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _best(candidates: list[dict], key: str, lower_is_better: bool) -> dict | None:
    usable = [r for r in candidates if _positive(r.get(key))]
    if not usable:
        return None
    return (min if lower_is_better else max)(usable, key=lambda r: r[key])


def _best_peers(rows: list[dict], group: str, key: str, lower_is_better: bool):
    """``(row, best peer row or None)`` for every "ok" row: the best by ``key`` among the peers of the row's
    precision that ran in the same ``group`` (a bench case, an accuracy profile)."""
    ok: dict = {}
    for r in rows:
        if r.get("status") == "ok":
            ok.setdefault(r.get(group), {})[r.get("impl")] = r
    for r in rows:
        if r.get("status") == "ok":
            same = ok.get(r.get(group), {})
            yield r, _best([same[p] for p in peers_for(r.get("precision", "")) if p in same], key, lower_is_better)


def _ratio(x, y):
    return x / y if isinstance(x, (int, float)) else None


def add_best_peer(rows: list[dict]) -> list[dict]:
    """Add ``best_peer``, ``best_peer_tflops`` and ``ratio_best_peer`` to every "ok" row of
    ``rows`` (bench rows: ``case``, ``impl``, ``precision``, ``status``, ``tflops``). Returns
    ``rows``, changed in place."""
    for r, best in _best_peers(rows, "case", "tflops", lower_is_better=False):
        if best is None:
            r.update(best_peer=None, best_peer_tflops=None, ratio_best_peer=None)
        else:
            r.update(best_peer=best["impl"], best_peer_tflops=best["tflops"],
                     ratio_best_peer=_ratio(r.get("tflops"), best["tflops"]))
    return rows


def add_best_peer_error(rows: list[dict]) -> list[dict]:
    """Accuracy rows (``profile``, ``impl``, ``precision``, ``status``, ``rel_l2``): add
    ``best_peer`` (the peer of the row's precision with the lowest relative L2 on the profile),
    and ``ratio_best_peer``: the row's relative L2 over that peer's (< 1: more accurate than
    every peer). ``best_peer = None`` where no peer ran."""
    for r, best in _best_peers(rows, "profile", "rel_l2", lower_is_better=True):
        if best is None:
            r.update(best_peer=None, ratio_best_peer=None)
        else:
            r.update(best_peer=best["impl"], ratio_best_peer=_ratio(r.get("rel_l2"), best["rel_l2"]))
    return rows
