"""The one place that decides which kernel runs a call, and why; the others ask here.

:func:`choose` decides the backend of a validated :class:`leanfa.problem.Problem` and says why
(:class:`Choice`); :func:`run` runs it. The order: the Hopper kernel where it applies (sm90, supported
shape, supported Triton: :func:`hopper_applies`, which asks :func:`leanfa.kernels.hopper.supports`)
*and* it has passed its GPU validation (:data:`HOPPER_VALIDATED`) *and* the portable kernel was not
measured faster for the call (:func:`portable_faster`: FP8 at head dim 64), else the portable kernel.
``backend="hopper"`` demands the Hopper kernel (also before validation, for development) and raises
where it does not apply; ``backend="portable"`` forces the portable kernel. Calls with features only the
portable kernel implements (``seqused_q/k``, the paged K/V forms of :func:`_paged_reason`, e.g. pages of 8 keys;
packed queries over a per-sequence K/V cache, sliding windows in FP8 at head dim 256, ``attention_chunk``, ``qv``,
head dims other than the Hopper
kernel's: :func:`portable_only_reason`) run there, with one warning per process and feature where the Hopper kernel would have run them.

On a supported Triton that never ran the GPU suite (:data:`leanfa._versions.GPU_VALIDATED`),
``backend="auto"`` runs the first Hopper call of each kernel configuration (:func:`config_key`) in a
process only after a self-check (:func:`self_check`): the Hopper and the portable kernel attend one small
problem of that configuration, and where their outputs disagree (beyond :data:`SELF_CHECK_TOL`) the
configuration stays on the portable kernel, with one warning. The verdict is kept per configuration for
the process (:data:`VERDICTS`).

BF16 sink keys (``attention(precision="fp8", bf16_sink_keys=P)``): :func:`sink_route` decides whether they
are attended inside one FP8 call, and on which backend, or by the split path (:mod:`leanfa.sink_split`);
:func:`hopper_sink_enabled` whether the Hopper kernel attends them (``LEANFA_HOPPER_SINK``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import warnings

import torch

from .. import _versions
from . import portable

_log = logging.getLogger(__name__)

#: ``backend="auto"`` picks the Hopper kernel only once it passes the GPU check
#: (scripts/hopper_gpu_check.py); the kernel passes it on the H200, so this is on. The check is what
#: catches, e.g., broadcast Q/K descale tables indexed with their size-1 block stride (1, not 0: NaN
#: whenever Sk > 128 or Sq > 128); :func:`leanfa.scales.broadcast_strides` gives them stride 0, and
#: tests/test_hopper_emulate.py checks that on the CPU. The check's results: docs/perf-notes.md.
HOPPER_VALIDATED = True
#: FP8 with BF16 sink keys in the Hopper kernel (:mod:`.hopper.sink`), d64/d128: validated on the H200
#: (29/29 GPU tests, memcheck/synccheck 0 errors, `leanfa accuracy` equal to the portable sink's error;
#: d128 16K 0.97x the plain FP8 call; docs/perf-notes.md, "the sink validated"), so ``backend="auto"`` runs
#: it on sm90.
#: ``LEANFA_HOPPER_SINK=0`` sends it back to the portable kernel (``backend="hopper"``: to the split).
HOPPER_SINK_VALIDATED = True
#: FA3's ``seqused_k`` on the Hopper kernel (the kernel's ``seqused_k``; a paged call's lengths as its
#: ``cu_seqlens_k``, :func:`leanfa.kernels.hopper.launch.paged_keys`), and paged calls with packed queries and no
#: ``cu_seqlens_k`` (vLLM's FA3 prefill call): validated on the H200 (tests/test_hopper_seqused.py's 33 GPU tests,
#: compute-sanitizer memcheck 0 errors on vLLM's FP8 call, FA3's varlen and KV-cache tests 0 failures; vLLM's call
#: 0.99-1.01x the ``cu_seqlens_k`` call, the portable kernel 0.31-0.65x of it; docs/perf-notes.md, "Session 22"),
#: so ``backend="auto"`` runs these calls on sm90.
HOPPER_SEQUSED_VALIDATED = True
#: FA3's ``seqused_q`` on the Hopper kernel (``_tile`` cuts each sequence's attending query rows to it; the
#: epilogue writes the rows past it as 0 with LSE -inf): validated on the H200 (run 109: tests/test_hopper_seqused.py's
#: and tests/test_paged_kv.py's 67 GPU tests, the 8 ``seqused_q`` cases among them, compute-sanitizer memcheck 0 errors
#: on three of them, FA3's varlen tests 0 failures; 0.986-1.000x the same call without it; docs/perf-notes.md,
#: "Session 23"), so ``backend="auto"`` runs these calls on sm90.
HOPPER_SEQUSED_Q_VALIDATED = True
#: FP8 head dims where ``backend="auto"`` prefers the portable kernel although the Hopper kernel runs them: at
#: 64/64 the portable FP8 kernel is 1.10x / 1.06-1.07x as fast as the Hopper kernel at 4K / 16K on the H200 (causal,
#: B*S = 16K, 16 heads; docs/perf-notes.md, "FP8 at head dim 64 goes to the portable kernel"), and its sink beats
#: the Hopper kernel's plain FP8 call there too. BF16 d64 stays on the Hopper kernel (0.94-1.07x either way).
PORTABLE_FASTER_FP8 = ((64, 64),)
#: ``bf16_sink_keys`` that are a multiple of this run inside the FP8 kernel (the portable kernel's sink blocks
#: are whole KV tiles and K scale blocks; the Hopper kernel's sink is exactly one such block). Other values
#: take the split path (:func:`leanfa.sink_split.attention_sink_bf16`).
SINK_BLOCK = 128

#: relative L2 error between the Hopper and the portable kernel's outputs (and LSE) on the self-check's
#: problem above which they disagree: the sum of the two kernels' bounds against a float64 reference in the
#: GPU suite (FP8 4e-2 each, 16-bit 1e-2 each; scripts/hopper_gpu_check.py)
SELF_CHECK_TOL = {"fp8": 8e-2, "16-bit": 2e-2, "lse": 1e-2}
#: the self-check problem's sequence lengths: dense, one sequence (a multiple of 16 tokens: the rows of an FP8 V
#: stored transposed must be 16-byte aligned for TMA; ending in a partial 128-key block); varlen, two sequences
#: (each longer than 128 BF16 sink keys; the second starting off a multiple of 16 tokens; 352 in all)
SELF_CHECK_TOKENS = 208
SELF_CHECK_VARLEN = (150, 202)
#: self-check verdicts by :func:`config_key`: True runs the Hopper kernel, False the portable one
VERDICTS: dict[tuple, bool] = {}
#: refusal reasons already warned about (once per process)
_WARNED: set[str] = set()
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Choice:
    """The kernel :func:`choose` picked for a call (``"hopper"`` or ``"portable"``), and why."""

    kernel: str
    why: str


def _hopper():
    try:
        from . import hopper
    except ImportError:  # Gluon missing in this Triton
        return None
    return hopper


def portable_faster(problem) -> bool:
    """Whether ``backend="auto"`` runs this call on the portable kernel, measured faster there
    (:data:`PORTABLE_FASTER_FP8`: full FP8; the mixed mode's 16-bit PV was not measured there and stays on the
    Hopper kernel), although the Hopper kernel supports it (``backend="hopper"`` still runs it there)."""
    return problem.pv_fp8 and (problem.head_dim_qk, problem.head_dim_v) in PORTABLE_FASTER_FP8


def hopper_sink_enabled(dims=None, sink_keys=None) -> bool:
    """Whether FP8 calls with BF16 sink keys may run on the Hopper kernel (``LEANFA_HOPPER_SINK``, default 1 once
    validated: :data:`HOPPER_SINK_VALIDATED`); with ``dims`` (Dqk, Dv) and ``sink_keys``, also whether it supports
    them (:func:`leanfa.kernels.hopper.sink_problem`)."""
    hopper = _hopper()
    if hopper is None or os.environ.get("LEANFA_HOPPER_SINK", "1" if HOPPER_SINK_VALIDATED else "0") != "1":
        return False
    return dims is None or hopper.sink_problem(dims, sink_keys) is None


def sink_route(backend: str, dims, sink_keys: int) -> str | None:
    """Where ``attention(precision="fp8", bf16_sink_keys=sink_keys)`` with head dims ``dims`` (Dqk, Dv) attends
    its sink keys: the backend of the one FP8 call that attends them itself, or None for the split path (a
    16-bit call and an FP8 call merged through their LSEs; dense only). In the FP8 kernel: multiples of
    :data:`SINK_BLOCK` keys; on the Hopper kernel only where :func:`hopper_sink_enabled` (``backend="hopper"``
    elsewhere takes the split; ``"auto"`` runs on the portable kernel while the Hopper sink is off)."""
    if sink_keys % SINK_BLOCK:
        return None
    if backend == "hopper":
        return backend if hopper_sink_enabled(dims, sink_keys) else None
    if backend == "auto" and not hopper_sink_enabled():
        return "portable"
    return backend


def hopper_applies(problem, backend: str = "auto") -> tuple[bool, str]:
    """Whether the Hopper kernel can run this problem with ``backend`` (``"hopper"`` also runs what is not yet
    validated on the GPU: :func:`portable_only_reason`), and if not, why."""
    hopper = _hopper()
    if hopper is None:
        return False, "triton.experimental.gluon is not available"
    if problem.sink_keys and not hopper_sink_enabled():
        return False, ("BF16 sink keys (bf16_sink_keys) run in the portable kernel here: the Hopper kernel's "
                       "sink is off (LEANFA_HOPPER_SINK=0)")
    ok, why = hopper.supports(problem)
    portable_only = portable_only_reason(problem, backend)
    on_sm90 = ok or not hopper.device_problem(problem)  # a GPU where the Hopper kernel runs other calls
    if portable_only and on_sm90:  # one warning per process and reason, as for the other portable fallbacks
        _warn_once(portable_only)
        return False, portable_only
    return ok, why


def _warn_once(why: str) -> None:
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"leanfa: {why}", UserWarning, stacklevel=3)


def portable_only_reason(problem, backend: str = "auto") -> str:
    """Why only the portable kernel runs ``problem`` (features the Hopper kernel does not implement, or does not
    run with ``backend="auto"`` before their GPU validation), or ``""``."""
    if problem.paged:
        why = _paged_reason(problem, backend)
        if why:
            return why
    if problem.kv_per_sequence and not problem.paged:
        return ("packed queries (cu_seqlens_q) over a per-sequence (batch, seqlen) K/V cache are not implemented in "
                "the Hopper kernel: these calls run on the portable kernel")
    if problem.attention_chunk > 0:
        return ("attention_chunk (chunked local attention) is not implemented in the Hopper kernel: these calls run on "
                "the portable kernel")
    if problem.qv is not None:
        return "qv (MLA's absorbed form) is not implemented in the Hopper kernel: these calls run on the portable kernel"
    if problem.seqused_q is not None and not _enabled(HOPPER_SEQUSED_Q_VALIDATED, backend):
        return ("seqused_q on the Hopper kernel is not yet validated on the GPU: these calls run on the portable "
                "kernel (backend='hopper' runs them there)")
    if problem.seqused_k is not None and not _enabled(HOPPER_SEQUSED_VALIDATED, backend):
        return ("seqused_k on the Hopper kernel is not yet validated on the GPU: these calls run on the portable "
                "kernel (backend='hopper' runs them there)")
    if problem.has_window and problem.pv_fp8 and problem.head_dim_v > 128:
        return ("sliding windows (window_size) with FP8 P.V at head dim 256 are not enabled in the Hopper kernel (its "
                "sm90 build spills ~550 B in the key loop, against 36-76 B without a window): these calls run on the "
                "portable kernel")
    hopper = _hopper()
    dims = (problem.head_dim_qk, problem.head_dim_v)
    if hopper is not None and dims not in hopper.HEAD_DIMS:  # (leanfa's other head dims: the portable kernel's)
        return hopper.head_dims_reason(dims)
    return ""


def _enabled(validated: bool, backend: str) -> bool:
    """Whether the Hopper kernel runs a feature behind a validation flag for ``backend``: validated (the flag, e.g.
    :data:`HOPPER_SEQUSED_VALIDATED`, read at the call), or demanded (``backend="hopper"``)."""
    return validated or backend == "hopper"


def _paged_reason(problem, backend: str = "auto") -> str:
    """Why the Hopper kernel does not read this call's paged K/V, or ``""``: it reads packed queries (key lengths from
    ``cu_seqlens_k``, ``seqused_k`` or the table's capacity) and dense queries over the whole table, V caches stored
    token-major (16-bit, and FP8 through a transposed copy per call), pages of a power of two from 16 keys
    (:func:`leanfa.kernels.hopper.launch.paged_problem`). Packed queries without ``cu_seqlens_k`` (vLLM's call) wait for
    :data:`HOPPER_SEQUSED_VALIDATED` with ``backend="auto"``."""
    if problem.kv_per_sequence and not _enabled(HOPPER_SEQUSED_VALIDATED, backend):
        return ("paged K/V with packed queries and no cu_seqlens_k (key lengths from seqused_k or the page table) on "
                "the Hopper kernel is not yet validated on the GPU: these calls run on the portable kernel "
                "(backend='hopper' runs them there)")
    hopper = _hopper()
    why = hopper.paged_problem(problem.page_size, problem.v) if hopper is not None else "Gluon is not available"
    return f"{why}: these calls run on the portable kernel" if why else ""


def choose(problem, backend: str) -> Choice:
    """The kernel that runs ``problem`` with ``backend`` (``"auto"``, ``"hopper"`` or ``"portable"``), and why.
    An unsupported torch/triton warns once (:func:`leanfa._versions.check`) and ``"auto"`` stays portable;
    ``backend="hopper"`` where the Hopper kernel does not apply raises ``ValueError``. On a Triton that is not
    GPU-validated, ``"auto"``'s first Hopper call of a configuration runs the self-check here."""
    supported = _versions.check()
    if backend not in ("auto", "hopper"):
        return Choice("portable", f"backend={backend!r}")
    if backend == "auto" and not supported:
        return Choice("portable", "an unsupported torch/triton runs the portable kernel only")
    if backend == "auto" and not HOPPER_VALIDATED:
        return Choice("portable", "the Hopper kernel has not passed its GPU check")
    ok, why = hopper_applies(problem, backend)
    if not ok:
        if backend == "hopper":
            raise ValueError(f"backend='hopper' cannot run this call: {why}")
        return Choice("portable", why)
    if backend == "hopper":
        return Choice("hopper", "backend='hopper'")
    if portable_faster(problem):
        return Choice("portable", "the portable kernel was measured faster for FP8 at these head dims")
    if not (_versions.triton_gpu_validated() or _self_checked(problem)):
        return Choice("portable", "the Hopper kernel's self-check on this Triton failed for this configuration")
    return Choice("hopper", "the Hopper kernel applies")


def run(problem, backend: str):
    """Run ``problem`` on the kernel :func:`choose` picks; return ``(out, lse or None)``."""
    if choose(problem, backend).kernel == "hopper":
        return _hopper().run(problem)
    return portable.run(problem)


# ----------------------------------------------------------------------------- self-check

def config_key(problem) -> tuple:
    """The kernel configuration a self-check verdict holds for: input (Q/K and V: the mixed mode) and output
    dtype, head dims, causal, varlen, BF16 sink keys, LSE and its K-mean term, a sliding window, softcap."""
    p = problem
    return (p.q.dtype, p.v.dtype, p.out_dtype, p.head_dim_qk, p.head_dim_v, p.causal, p.varlen, p.sink_keys,
            p.return_lse, p.k_mean is not None, p.has_window, p.softcap > 0)


def _self_checked(problem) -> bool:
    """Whether ``backend="auto"`` may run this call on the Hopper kernel: the configuration's verdict,
    checked now if it has none. During CUDA graph capture a missing verdict cannot be checked (the check
    reads its results back): that call runs on the portable kernel and the verdict stays open."""
    key = config_key(problem)
    verdict = VERDICTS.get(key)
    if verdict is not None:
        return verdict
    if problem.q.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    with _lock:
        if key not in VERDICTS:
            VERDICTS[key] = self_check(problem)
        return VERDICTS[key]


def self_check(problem) -> bool:
    """Run the Hopper and the portable kernel on :func:`probe_problem` of ``problem``'s configuration; True
    when they agree. On a disagreement, warn (``UserWarning``) that the configuration runs on the portable
    kernel; an agreement is logged at INFO level."""
    import triton

    probe = probe_problem(problem)
    hopper = _hopper()
    ok, why = hopper.supports(probe)
    if ok:
        try:
            got = hopper.run(probe)
        except Exception as e:  # noqa: BLE001 (any failure of the kernel is a disagreement)
            ok, why = False, f"the Hopper kernel raised {type(e).__name__}: {e}"
        else:
            ok, why = outputs_agree(got, portable.run(probe), problem.is_fp8)
    else:
        why = f"the self-check problem does not run on it ({why})"
    desc = _describe(problem)
    if ok:
        _log.info("leanfa: the Hopper kernel agrees with the portable kernel on triton %s for %s", triton.__version__,
                  desc)
    else:
        warnings.warn(f"leanfa: the Hopper kernel was not validated on the GPU with triton {triton.__version__}, and "
                      f"its self-check for {desc} failed ({why}); these calls use the portable kernel",
                      UserWarning, stacklevel=2)
    return ok


def outputs_agree(got, want, fp8: bool) -> tuple[bool, str]:
    """Whether the Hopper kernel's ``(out, lse or None)`` ``got`` agrees with the portable kernel's ``want``:
    non-finite in the same places, relative L2 error within :data:`SELF_CHECK_TOL`; and if not, why."""
    tol = SELF_CHECK_TOL["fp8" if fp8 else "16-bit"]
    for name, a, b, t in (("output", got[0], want[0], tol), ("LSE", got[1], want[1], SELF_CHECK_TOL["lse"])):
        if b is None:
            continue
        a, b = a.double(), b.double()
        finite = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), finite):
            return False, f"its {name} is not finite where the portable kernel's is, or the reverse"
        err = float((a[finite] - b[finite]).norm() / b[finite].norm().clamp(min=1e-30))
        if not err <= t:
            return False, f"{name} relative L2 error {err:.3g} > {t:g}"
    return True, ""


def probe_problem(problem):
    """A small problem of ``problem``'s configuration (:func:`config_key`) on its device, from seeded random
    inputs: one sequence of :data:`SELF_CHECK_TOKENS` tokens (varlen: :data:`SELF_CHECK_VARLEN`), two query
    heads (sharing one KV head where ``problem`` has grouped KV heads), unit descales; FP8 V stored
    transposed (tokens innermost), as :func:`leanfa.quantize_fp8` writes it (the mixed mode's 16-bit V
    token-major). K/V are contiguous: a paged call's probe has no page table (its paged loads are not self-checked)."""
    p = problem
    dev = p.q.device
    g = torch.Generator(device=dev).manual_seed(0)
    hq, hkv = 2, 1 if p.kv_heads != p.heads else 2
    dqk, dv = p.head_dim_qk, p.head_dim_v
    if p.varlen:
        lens = SELF_CHECK_VARLEN
        batch, tokens, lead = len(lens), sum(lens), ()
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
        seqlens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    else:
        batch, tokens, lead = 1, SELF_CHECK_TOKENS, (1,)
        seqlens = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=tokens, max_seqlen_k=tokens)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    sixteen = (p.sink_q.dtype if p.sink_keys else p.v.dtype if p.is_mixed else torch.bfloat16 if p.is_fp8
               else p.q.dtype)
    q, k, v = (rand(*lead, tokens, h, d, dtype=sixteen) for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv)))
    sink = dict(sink_q=q, sink_k=k, sink_v=v) if p.sink_keys else {}
    if p.is_fp8:
        q, k = q.to(p.q.dtype), k.to(p.q.dtype)
    if p.pv_fp8:  # V stored (.., H, D, S), viewed as (.., S, H, D)
        to_hds, to_shd = ((1, 2, 0), (2, 0, 1)) if p.varlen else ((0, 2, 3, 1), (0, 3, 1, 2))
        v = v.permute(*to_hds).contiguous().to(p.q.dtype).permute(*to_shd)
    ones = torch.ones((1, 1, 1), dtype=torch.float32, device=dev)
    k_mean = rand(batch, hkv, dqk, dtype=torch.float32) * 0.1 if p.k_mean is not None else None
    return dataclasses.replace(
        p, q=q, k=k, v=v, batch=batch, heads=hq, kv_heads=hkv, **seqlens, softmax_scale=dqk ** -0.5,
        q_scale=ones.expand(batch, hq, 1), k_scale=ones.expand(batch, hkv, 1), v_scale=ones.expand(batch, hkv, dv),
        k_mean=k_mean, page_table=None, seqused_q=None, seqused_k=None, **sink)


def _describe(problem) -> str:
    p = problem
    dtype = str(p.q.dtype).replace("torch.", "") + (f" with a {str(p.v.dtype).replace('torch.', '')} v (the mixed "
                                                     "mode)" if p.is_mixed else "")
    return (f"{dtype} head dims {p.head_dim_qk}/{p.head_dim_v}, {'causal' if p.causal else 'non-causal'}"
            f"{', varlen' if p.varlen else ''}{f', {p.sink_keys} BF16 sink keys' if p.sink_keys else ''}"
            f"{', with LSE' if p.return_lse else ''} -> {str(p.out_dtype).replace('torch.', '')}")
