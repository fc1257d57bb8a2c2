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


def add_best_peer(rows: list[dict]) -> list[dict]:
    """Add ``best_peer``, ``best_peer_tflops`` and ``ratio_best_peer`` to every "ok" row of
    ``rows`` (bench rows: ``case``, ``impl``, ``precision``, ``status``, ``tflops``). Returns
    ``rows``, changed in place."""
    ok: dict = {}
    for r in rows:
        if r.get("status") == "ok":
            ok.setdefault(r.get("case"), {})[r.get("impl")] = r
    for r in rows:
        if r.get("status") != "ok":
            continue
        in_case = ok.get(r.get("case"), {})
        best = _best([in_case[p] for p in peers_for(r.get("precision", "")) if p in in_case],
                     "tflops", lower_is_better=False)
        if best is None:
            r.update(best_peer=None, best_peer_tflops=None, ratio_best_peer=None)
            continue
        r.update(best_peer=best["impl"], best_peer_tflops=best["tflops"])
        tf = r.get("tflops")
        r["ratio_best_peer"] = tf / best["tflops"] if isinstance(tf, (int, float)) else None
    return rows


def add_best_peer_error(rows: list[dict]) -> list[dict]:
    """Accuracy rows (``profile``, ``impl``, ``precision``, ``status``, ``rel_l2``): add
    ``best_peer`` (the peer of the row's precision with the lowest relative L2 on the profile),
    and ``ratio_best_peer``: the row's relative L2 over that peer's (< 1: more accurate than
    every peer). ``best_peer = None`` where no peer ran."""
    ok: dict = {}
    for r in rows:
        if r.get("status") == "ok":
            ok.setdefault(r.get("profile"), {})[r.get("impl")] = r
    for r in rows:
        if r.get("status") != "ok":
            continue
        in_profile = ok.get(r.get("profile"), {})
        best = _best([in_profile[p] for p in peers_for(r.get("precision", "")) if p in in_profile],
                     "rel_l2", lower_is_better=True)
        if best is None:
            r.update(best_peer=None, ratio_best_peer=None)
            continue
        r["best_peer"] = best["impl"]
        err = r.get("rel_l2")
        r["ratio_best_peer"] = err / best["rel_l2"] if isinstance(err, (int, float)) else None
    return rows
