"""GPU timing with CUDA events, warm-up, medians and input rotation.

:func:`time_calls` takes one zero-argument callable per input copy and calls them in turn
(call ``i`` uses copy ``i % n``), so with enough copies the inputs are not in L2 when a call
starts (the caller sizes the copies, see :func:`leanfa.bench.inputs.copies_for`). It

1. runs each callable once and synchronizes (compiles, autotunes, builds plans);
2. estimates the time per call from a few calls;
3. warms up for ``warmup_ms`` (at least 2 calls) so clocks and power settle;
4. records a CUDA event pair around each of ``n`` calls, ``n`` from ``rep_ms`` clamped to
   ``[min_reps, max_reps]``, while an optional sampler (e.g. NVML) runs, then synchronizes
   once and returns the median time with its 20th/80th percentiles;
5. measures the host time of one call: the CPU time of a few calls enqueued back to back with no
   synchronization in between (about 50 ms of GPU work, so the launch queue never fills). A call
   whose host time exceeds its GPU time is host-bound: in an eager serving loop the GPU waits.

The GPU runs the calls back to back (the host enqueues ahead), as in a real prefill loop.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    copies: int
    host_ms: float | None = None

    def to_dict(self) -> dict:
        return {"time_ms": self.median_ms, "time_p20_ms": self.p20_ms, "time_p80_ms": self.p80_ms,
                "reps": self.reps, "copies": self.copies, "host_ms": self.host_ms}


def quantile(values, q: float) -> float:
    s = sorted(values)
    if not s:
        raise ValueError("no values")
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(times_ms, copies: int, host_ms: float | None = None) -> Timing:
    return Timing(statistics.median(times_ms), quantile(times_ms, 0.2), quantile(times_ms, 0.8),
                  len(times_ms), copies, host_ms)


def time_calls(fns, *, warmup_ms: float = 100.0, rep_ms: float = 300.0, min_reps: int = 5,
               max_reps: int = 1000, max_total_ms: float = 20000.0, sampler=None) -> Timing:
    """Median GPU time (ms) of one call, rotating over ``fns`` (see module docstring).

    ``max_total_ms`` bounds warm-up plus timed calls for a very slow implementation (then
    fewer reps are taken, at least 3, and a shorter warm-up, at least 1 call)."""
    import torch

    fns = list(fns)
    if not fns:
        raise ValueError("time_calls needs at least one callable")
    for f in fns:
        f()
    torch.cuda.synchronize()

    est_n = max(3, len(fns))
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for i in range(est_n):
        fns[i % len(fns)]()
    t1.record()
    torch.cuda.synchronize()
    est_ms = max(t0.elapsed_time(t1) / est_n, 1e-3)

    n_warm = max(2, int(warmup_ms / est_ms))
    n_rep = min(max_reps, max(min_reps, int(rep_ms / est_ms)))
    if (n_warm + n_rep) * est_ms > max_total_ms:
        n_warm = max(1, min(n_warm, int(0.2 * max_total_ms / est_ms)))
        n_rep = max(3, min(n_rep, int(0.8 * max_total_ms / est_ms)))
    for i in range(n_warm):
        fns[i % len(fns)]()

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    if sampler is not None:
        sampler.start()
    try:
        for i in range(n_rep):
            f = fns[(n_warm + i) % len(fns)]
            starts[i].record()
            f()
            ends[i].record()
        torch.cuda.synchronize()
    finally:
        if sampler is not None:
            sampler.stop()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return summarize(times, len(fns), host_ms(fns, max(3, min(n_rep, int(50.0 / est_ms)))))


def host_ms(fns, n: int) -> float:
    """CPU milliseconds per call of ``n`` calls enqueued back to back (synchronized before and after only)."""
    import time

    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fns[i % len(fns)]()
    host = (time.perf_counter() - t) * 1e3 / n
    torch.cuda.synchronize()
    return host
