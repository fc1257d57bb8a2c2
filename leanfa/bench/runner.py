"""The speed benchmark loop: every implementation on every case, checked, then timed.

For each case: make the inputs (and copies for L2 rotation), compute the float64 reference
on a subset of heads, then for each implementation

1. ``prepare`` it on every copy (``NotApplicable`` -> row "n/a" with the reason);
2. run it once and compare with the reference (relative L2 over the head subset); above
   the precision's tolerance (for FP8: the larger of the fixed bound and twice the error of
   per-tensor e4m3 rounding of the inputs, ``errors.fp8_rounding_floor``), or on any
   exception, the row is "FAILED" with the error and no speed is reported;
3. time it (:func:`leanfa.bench.timing.time_calls`) with the NVML sampler running.

Afterwards :func:`add_ratios` adds the % of the same-run GEMM rate of the row's precision, the
ratio to cuDNN of the same precision in the same case, and the ratio to the best peer (the
fastest of cuDNN and FA3 of the same precision in the same case, :mod:`leanfa.bench.peers`).
"""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass, field

from . import errors, peers
from .impls import Impl, NotApplicable, baseline_for
from .inputs import copies_for, input_bytes, make_copies
from .shapes import Case, flops


@dataclass
class BenchConfig:
    warmup_ms: float = 200.0
    rep_ms: float = 1000.0
    min_reps: int = 5
    max_reps: int = 5000
    max_row_ms: float = 20000.0  # warm-up + timed calls of one row, at most
    seed: int = 0
    check_tol: dict = field(default_factory=lambda: dict(errors.CHECK_TOL))
    rotate_factor: int = 4  # rotate copies until inputs are this many times the L2
    max_copies: int = 4
    sample_period_s: float = 0.005
    device: str = "cuda"
    device_index: int = 0

    @classmethod
    def quick(cls, **kw) -> "BenchConfig":
        """Trimmed timing for ``--quick`` (about 0.3 s per row; clocks may not have settled
        at the power cap yet, so compare clocks within one run)."""
        return cls(warmup_ms=100.0, rep_ms=200.0, min_reps=3, max_row_ms=5000.0, **kw)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _l2_bytes(cfg: BenchConfig) -> int:
    try:
        import torch

        return int(torch.cuda.get_device_properties(cfg.device_index).L2_cache_size)
    except Exception:
        return 60 << 20


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


#: implementation families whose rows take a case's sliding window (``Case.window_size``)
WINDOW_FAMILIES = ("leanfa", "fa3")


def base_row(case: Case, impl: Impl) -> dict:
    return {**case.to_dict(), "case": case.name, **impl.to_dict(), "status": None}


def bench_one(case: Case, impl: Impl, copies, ref_info, cfg: BenchConfig, timer, sampler_factory) -> dict:
    """One row: prepare, check, time. Never raises (errors become the row's status)."""
    import torch

    row = base_row(case, impl)
    prepared = None
    try:
        ok, why = impl.available()
        if not ok:
            row.update(status="n/a", reason=why)
            return row
        if case.window_left >= 0 and impl.family not in WINDOW_FAMILIES:
            raise NotApplicable(f"sliding windows are wired for the {', '.join(WINDOW_FAMILIES)} rows only")
        prepared = [impl.prepare(case, x) for x in copies]
        if prepared[0].note:
            row["note"] = prepared[0].note
        out = prepared[0].output(prepared[0].run())
        if ref_info is None:
            raise RuntimeError("no reference to check against")
        ref, q_heads, batch0, fp8_floor = ref_info
        err = errors.error_metrics(errors.subset_of(out, q_heads, batch0), ref)
        row["check_rel_l2"] = err["rel_l2"]
        tol = cfg.check_tol[impl.precision]
        if impl.precision == "fp8" and fp8_floor is not None:
            tol = max(tol, errors.FP8_FLOOR_FACTOR * fp8_floor)
            row["check_fp8_floor"] = fp8_floor
        if not err["rel_l2"] <= tol:
            row.update(status="FAILED", error=f"check: relative L2 {err['rel_l2']:.3g} > {tol:.3g}")
            return row
        del out
        sampler = sampler_factory()
        t = timer([p.run for p in prepared], warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms,
                  min_reps=cfg.min_reps, max_reps=cfg.max_reps, max_total_ms=cfg.max_row_ms,
                  sampler=sampler)
        row.update(status="ok", **t.to_dict(), **sampler.summary())
        row["tflops"] = flops(case) / (t.median_ms * 1e-3) / 1e12
    except NotApplicable as e:
        row.update(status="n/a", reason=str(e)[:500])
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="FAILED", error=_short(e))
    except Exception as e:
        row.update(status="FAILED", error=_short(e), traceback=traceback.format_exc(limit=6)[-2000:])
    finally:
        del prepared
    return row


def cuda_alive(device: str) -> bool:
    """False once the CUDA context is poisoned (illegal address, launch failure...)."""
    if not device.startswith("cuda"):
        return True
    try:
        import torch

        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def run_bench(cases, impls, cfg: BenchConfig, *, timer=None, sampler_factory=None,
              progress: bool = True, log=print, on_case_done=None) -> list[dict]:
    """All rows of ``cases`` x ``impls`` (without ratios: see :func:`add_ratios`).

    ``on_case_done(rows)`` is called after each case (to save partial results). If a
    failure leaves the CUDA context unusable, the remaining rows are marked FAILED and
    the loop stops."""
    from .power import NvmlSampler
    from .timing import time_calls

    timer = timer or time_calls
    sampler_factory = sampler_factory or (lambda: NvmlSampler(cfg.device_index, cfg.sample_period_s))
    bar = _progress(len(cases) * len(impls), progress)
    rows: list[dict] = []
    l2 = _l2_bytes(cfg) if cfg.device.startswith("cuda") else 60 << 20
    lost: str | None = None
    for case in cases:
        t0 = time.time()
        copies, ref_info, case_error = [], None, None
        try:
            if lost is not None:
                raise RuntimeError(lost)
            # a call also touches its output and any FP8 copies: count 1.5x the inputs
            n = copies_for(int(input_bytes(case) * 1.5), l2_bytes=l2, factor=cfg.rotate_factor,
                           max_copies=cfg.max_copies)
            copies = make_copies(case, n, device=cfg.device, seed=cfg.seed)
            ref_info = errors.reference_subset(copies[0], case.causal, case.window_size)
            floor = (errors.fp8_rounding_floor(copies[0], case.causal, ref_info[0], case.window_size)
                     if any(i.precision == "fp8" for i in impls) else None)
            ref_info = (*ref_info, floor)
        except Exception as e:
            case_error = f"inputs/reference: {_short(e)}"
        for impl in impls:
            if bar is not None:
                bar.set_description(f"{case.sweep}/{case.label} S{case.seqlen} {impl.name}"[:60])
            if lost is not None:
                row = {**base_row(case, impl), "status": "FAILED", "error": lost}
            elif case_error is not None:
                row = {**base_row(case, impl), "status": "FAILED", "error": case_error}
            else:
                row = bench_one(case, impl, copies, ref_info, cfg, timer, sampler_factory)
                if row["status"] == "FAILED":
                    if cuda_alive(cfg.device):
                        _free(cfg.device)  # e.g. after an out-of-memory error
                    else:
                        lost = f"not run: CUDA context lost after {impl.name} on {case.name}"
            rows.append(row)
            _log_row(row, bar, log)
            if bar is not None:
                bar.update(1)
        del copies, ref_info
        if lost is None:
            _free(cfg.device)
        if on_case_done is not None:
            on_case_done(rows)
        if log and bar is None:
            log(f"  case {case.name} done in {time.time() - t0:.1f}s")
    if bar is not None:
        bar.close()
    return rows


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="row", dynamic_ncols=True)


def _log_row(row: dict, bar, log) -> None:
    if not log:
        return
    head = f"{row['case']:<60} {row['impl']:<26}"
    if row["status"] == "ok":
        clk = row.get("sm_clock_mhz")
        msg = (f"{head} {row['tflops']:8.1f} TFLOP/s  {row['time_ms']:9.3f} ms"
               + (f"  {clk:5.0f} MHz" if clk else ""))
    else:
        msg = f"{head} {row['status']}: {row.get('reason') or row.get('error')}"
    (bar.write if bar is not None else log)(msg)


def add_ratios(rows: list[dict], gemm: dict | None) -> list[dict]:
    """Add ``pct_gemm`` (% of the same-precision GEMM rate), ``ratio_cudnn`` (TFLOP/s over
    cuDNN's of the same precision in the same case) and ``best_peer``/``best_peer_tflops``/
    ``ratio_best_peer`` (:func:`leanfa.bench.peers.add_best_peer`) to every "ok" row."""
    by_case: dict = {}
    for r in rows:
        if r.get("status") == "ok":
            by_case.setdefault(r["case"], {})[r["impl"]] = r
    for r in rows:
        if r.get("status") != "ok":
            continue
        g = (gemm or {}).get(r["precision"], {})
        if g.get("tflops"):
            r["pct_gemm"] = 100.0 * r["tflops"] / g["tflops"]
        base = by_case.get(r["case"], {}).get(baseline_for(r["precision"]))
        if base is not None and base.get("tflops"):
            r["ratio_cudnn"] = r["tflops"] / base["tflops"]
    return peers.add_best_peer(rows)
