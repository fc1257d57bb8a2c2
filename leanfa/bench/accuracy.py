"""``leanfa accuracy``: every implementation's error on every activation profile.

For each profile (the ``leanfa.activations`` presets, ``gaussian`` = standard normal, and
captured ``.safetensors`` files passed with ``--inputs``) at a moderate shape (default
B=1, S=2048, the preset's heads, causal), the BF16 Q/K/V are fed to every implementation and
its output compared with the float64 reference (:func:`leanfa.reference.attention_ref`) on
all heads: relative L2, max abs error and worst-row relative error
(:func:`leanfa.bench.errors.error_metrics`). FP8 rows also get ``ratio_cudnn_fp8``: their
relative L2 over cuDNN FP8's on the same profile; every row gets ``best_peer`` and
``ratio_best_peer``: its relative L2 over that of the most accurate peer of its precision
(cuDNN or FlashAttention-3, :mod:`leanfa.bench.peers`) on the same profile.

Implementations whose numerics duplicate another row's (``leanfa-*-fp8-kernel`` computes
what ``leanfa-*-fp8`` does; ``cudnn-fp8-e2e`` what ``cudnn-fp8`` does) are left out by
default.
"""

from __future__ import annotations

import os

from . import errors, peers
from .impls import Impl, NotApplicable
from .inputs import Inputs, make_inputs
from .shapes import MODELS, Case

GAUSSIAN_HEADS = (16, 16, 128, 128)
DUPLICATES = ("leanfa-*-fp8-kernel", "cudnn-fp8-e2e")


def default_impls(impls: list[Impl]) -> list[Impl]:
    import fnmatch

    return [i for i in impls if not any(fnmatch.fnmatch(i.name, p) for p in DUPLICATES)]


def list_profiles() -> list[str]:
    try:
        from leanfa.activations import list_presets

        presets = list(list_presets())
    except Exception:
        presets = ["gaussian"] + list(MODELS)
    return presets if "gaussian" in presets else ["gaussian"] + presets


def profile_case(profile: str, *, batch: int, seqlen: int, causal: bool) -> Case:
    """The case of a named preset: its model's heads (a bench model, else the activation
    preset's own heads and head dims; gaussian: 16 heads, d128)."""
    hq, hkv, dqk, dv = MODELS.get(profile) or _preset_heads(profile) or GAUSSIAN_HEADS
    return Case("accuracy", profile, profile, batch, seqlen, hq, hkv, dqk, dv, causal)


def _preset_heads(profile: str):
    """(q heads, kv heads, Dqk, Dv) of a ``leanfa.activations`` preset, or None."""
    try:
        from leanfa.activations import PRESETS
    except Exception:
        return None
    p = PRESETS.get(profile)
    return None if p is None or profile == "gaussian" else (p.heads, p.kv_heads, p.head_dim_qk, p.head_dim_v)


def file_case_and_inputs(path: str, *, batch: int, seqlen: int, causal: bool, device, seed: int):
    """A captured .safetensors file: shapes come from the tensors make_qkv returns."""
    from leanfa.activations import make_qkv
    import torch

    q, k, v = make_qkv(path, batch, seqlen, seed=seed, device=device, dtype=torch.bfloat16)
    name = os.path.basename(path)
    case = Case("accuracy", name, path, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3],
                v.shape[3], causal)
    return case, Inputs(q.contiguous(), k.contiguous(), v.contiguous())


def accuracy_rows(case: Case, x: Inputs, impls: list[Impl]) -> list[dict]:
    """Rows of all ``impls`` on one profile's inputs."""
    from leanfa.reference import attention_ref

    ref = attention_ref(x.q, x.k, x.v, causal=case.causal)
    shape = (f"B{case.batch} S{case.seqlen} H{case.heads}/{case.kv_heads} "
             f"D{case.head_dim}/{case.head_dim_v} {'causal' if case.causal else 'full'}")
    rows = []
    for impl in impls:
        row = {"profile": case.label, "shape": shape, **impl.to_dict(), "status": None}
        try:
            ok, why = impl.available()
            if not ok:
                raise NotApplicable(why)
            p = impl.prepare(case, x)
            out = p.output(p.run())
            row.update(status="ok", **errors.error_metrics(out, ref))
            if p.note:
                row["note"] = p.note
            del out, p
        except NotApplicable as e:
            row.update(status="n/a", reason=str(e)[:500])
        except Exception as e:
            msg = str(e).strip().splitlines()
            row.update(status="FAILED", error=f"{type(e).__name__}: {msg[0] if msg else ''}"[:500])
        rows.append(row)
    cudnn = next((r for r in rows if r["impl"] == "cudnn-fp8" and r["status"] == "ok"), None)
    if cudnn and cudnn.get("rel_l2"):
        for r in rows:
            if r["status"] == "ok" and r["precision"] == "fp8":
                r["ratio_cudnn_fp8"] = r["rel_l2"] / cudnn["rel_l2"]
    return peers.add_best_peer_error(rows)


def run_accuracy(profiles, files, impls, *, batch: int = 1, seqlen: int = 2048, causal: bool = True,
                 device="cuda", seed: int = 0, log=print) -> list[dict]:
    rows: list[dict] = []
    jobs = [("preset", p) for p in profiles] + [("file", f) for f in files]
    for kind, what in jobs:
        try:
            if kind == "preset":
                case = profile_case(what, batch=batch, seqlen=seqlen, causal=causal)
                x = make_inputs(case, device=device, seed=seed)
            else:
                case, x = file_case_and_inputs(what, batch=batch, seqlen=seqlen, causal=causal,
                                               device=device, seed=seed)
            new = accuracy_rows(case, x, impls)
        except Exception as e:
            new = [{"profile": os.path.basename(what), **i.to_dict(), "status": "FAILED",
                    "error": f"inputs/reference: {type(e).__name__}: {e}"[:500]} for i in impls]
        rows += new
        if log:
            for r in new:
                val = f"{r['rel_l2']:.3e}" if r["status"] == "ok" else r["status"]
                log(f"{r['profile']:<20} {r['impl']:<24} {val}")
    return rows
