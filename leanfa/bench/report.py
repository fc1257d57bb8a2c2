"""Write results: JSON (everything), markdown tables (for people and commits), PNG plots.

Plots use matplotlib's Agg backend (no display needed). Every writer takes plain dicts
(the rows produced by the runner, accuracy and profile modules), so they can be tested
and re-run on a saved JSON without a GPU.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict

from . import peers

# ------------------------------------------------------------------------------- helpers


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def _finite(o):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(payload), f, indent=1, default=_json_default, allow_nan=False)
        f.write("\n")
    return path


def _fmt(v, spec: str = ".1f", none: str = "") -> str:
    if v is None:
        return none
    if isinstance(v, str):
        return v
    try:
        if not math.isfinite(v):
            return str(v)
    except TypeError:
        return str(v)
    return format(v, spec)


def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(x):
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def env_lines(env: dict) -> list[str]:
    keys = ("gpu", "driver", "power_limit_w", "torch", "triton", "cuda", "cudnn_torch",
            "cudnn_frontend", "cudnn_backend", "git_commit", "git_tree", "date")
    return [", ".join(f"{k}: {env[k]}" for k in keys if env.get(k) is not None)]


def _uniq(seq):
    return list(OrderedDict.fromkeys(seq))


# ---------------------------------------------------------------------------------- bench


def _case_cell(r: dict) -> list:
    seqlen = r["seqlen"]
    if r.get("seqlens_k"):  # chunked prefill: the longest chunk and the longest key sequence
        shape, seqlen = f"chunked x{len(r['seqlens'])}", f"{r['seqlen']} (Sk {max(r['seqlens_k'])})"
    else:
        shape = f"varlen x{len(r['seqlens'])}" if r.get("seqlens") else f"B{r['batch']}"
    return [r["label"], seqlen, shape, f"{r['heads']}/{r['kv_heads']}",
            f"{r['head_dim']}/{r['head_dim_v']}", _mask_cell(r)]


def _mask_cell(r: dict) -> str:
    mask = "causal" if r["causal"] else "full"
    if r.get("window_left") is not None:
        mask += f", window {r['window_left']}"
    if r.get("softcap"):
        mask += f", softcap {r['softcap']:g}"
    return mask


def _speed_cell(r: dict | None) -> str:
    """TFLOP/s (x best peer); a peer row's own ratio is shown too (1.00x: it is the best)."""
    if r is None:
        return ""
    if r["status"] == "ok":
        ratio = r.get("ratio_best_peer")
        return _fmt(r["tflops"], ".0f") + (f" ({ratio:.2f}x)" if isinstance(ratio, (int, float)) else "")
    return r["status"]


def _peer_cell(r: dict | None) -> str:
    """The best peer of an ok row: 'fa3-fp8 (812)', or 'no peer ran'."""
    if r is None or r.get("status") != "ok":
        return ""
    if not r.get("best_peer"):
        return "no peer ran"
    return f"{r['best_peer']} ({_fmt(r.get('best_peer_tflops'), '.0f')})"


def _ratio_text(r: dict) -> str:
    ratio = r.get("ratio_best_peer")
    return f"{ratio:.2f}x" if isinstance(ratio, (int, float)) else "no peer ran"


def peer_markdown(rows: list[dict]) -> str:
    """The headline table: every leanfa row against the best peer of its precision in its case
    (TFLOP/s, which peer, the ratio); 'no peer ran' where neither cuDNN nor FA3 ran."""
    mine = [r for r in rows if r.get("family") == "leanfa" and r.get("status") in ("ok", "FAILED")]
    if not mine:
        return ""
    table = []
    for r in mine:
        ok = r["status"] == "ok"
        table.append(_case_cell(r) + [r["impl"], _fmt(r.get("tflops"), ".0f") if ok else r["status"],
                                      r.get("best_peer") or ("no peer ran" if ok else ""),
                                      _fmt(r.get("best_peer_tflops"), ".0f"), _ratio_text(r) if ok else ""])
    return md_table(["model/dims", "S", "batch", "heads", "Dqk/Dv", "mask", "leanfa", "TFLOP/s",
                     "best peer", "peer TFLOP/s", "x best peer"], table)


def bench_markdown(payload: dict) -> str:
    env, rows, gemm = payload.get("env", {}), payload.get("rows", []), payload.get("gemm", {})
    out = [f"# leanfa bench — {env.get('gpu', '?')}", ""] + env_lines(env) + [""]
    cfg = payload.get("config")
    if cfg:
        out += [f"Timing: median of >= {cfg.get('min_reps')} calls over ~{cfg.get('rep_ms')} ms after "
                f"{cfg.get('warmup_ms')} ms warm-up, CUDA events, inputs rotated over up to "
                f"{cfg.get('max_copies')} copies; clock and power: NVML medians during the timed calls; "
                "host ms: CPU time per call enqueued back to back (a row whose host ms exceeds its ms is "
                "host-bound).",
                ""]
    if gemm:
        out += ["## GEMM reference (8192³, same run)", ""]
        out.append(md_table(["GEMM", "TFLOP/s", "SM clock MHz", "power W", "note"], [
            [k, _fmt(g.get("tflops")), _fmt(g.get("sm_clock_mhz"), ".0f"), _fmt(g.get("power_w"), ".0f"),
             g.get("error", "")] for k, g in gemm.items()]))
        out.append("")
    peer_lists = "; ".join(f"{p.upper()}: {', '.join(n)}" for p, n in peers.PEERS.items()
                           if any(r.get("precision") == p for r in rows))
    out += ["Cells: TFLOP/s (x best peer: the row's TFLOP/s over the fastest peer of its precision "
            f"that ran on the same case — {peer_lists}; the 'best ... peer' columns name it, "
            "'no peer ran' where none did). FLOPs: 2·B·Hq·Sq·Sk·(Dqk+Dv), halved when causal. "
            "leanfa-*-fp8 and cudnn-fp8-e2e take BF16 in and give BF16 out, quantization timed; "
            "leanfa-*-fp8-kernel, cudnn-fp8 and fa3-fp8 time the kernel alone on pre-quantized "
            "inputs. The details tables also give the ratio to cuDNN of the same precision.", ""]
    headline = peer_markdown(rows)
    if headline:
        out += ["## leanfa against the best peer", "", headline, ""]
    for sweep in _uniq(r["sweep"] for r in rows):
        srows = [r for r in rows if r["sweep"] == sweep]
        impls = [i for i in _uniq(r["impl"] for r in srows)
                 if any(r["impl"] == i and r["status"] != "n/a" for r in srows)]
        out += [f"## {sweep}", ""]
        by_case = OrderedDict()
        for r in srows:
            by_case.setdefault(r["case"], {})[r["impl"]] = r
        precisions = [p for p in peers.PEERS if any(r.get("precision") == p for r in srows)]
        table = []
        for cells in by_case.values():
            first = next(iter(cells.values()))
            best = [_peer_cell(next((r for r in cells.values()
                                     if r.get("precision") == p and r.get("status") == "ok"), None))
                    for p in precisions]
            table.append(_case_cell(first) + [_speed_cell(cells.get(i)) for i in impls] + best)
        out.append(md_table(["model/dims", "S", "batch", "heads", "Dqk/Dv", "mask"] + impls
                            + [f"best {p.upper()} peer" for p in precisions], table))
        out.append("")
        detail = [r for r in srows if r["status"] != "n/a"]
        if detail:
            out += [f"### {sweep}: details", ""]
            out.append(md_table(
                ["case", "impl", "status", "ms", "host ms", "TFLOP/s", "% GEMM", "x best peer", "best peer",
                 "x cuDNN", "SM MHz", "W", "check rel L2", "note / error"],
                [[r["case"], r["impl"], r["status"], _fmt(r.get("time_ms"), ".3f"), _fmt(r.get("host_ms"), ".3f"),
                  _fmt(r.get("tflops")),
                  _fmt(r.get("pct_gemm")), _fmt(r.get("ratio_best_peer"), ".2f"), _peer_cell(r),
                  _fmt(r.get("ratio_cudnn"), ".2f"),
                  _fmt(r.get("sm_clock_mhz"), ".0f"), _fmt(r.get("power_w"), ".0f"),
                  _fmt(r.get("check_rel_l2"), ".2e"), r.get("error") or r.get("note", "")]
                 for r in detail]))
            out.append("")
    na = OrderedDict()
    for r in rows:
        if r["status"] == "n/a":
            na.setdefault((r["impl"], r.get("reason", "")), 0)
            na[(r["impl"], r.get("reason", ""))] += 1
    if na:
        out += ["## Not applicable", ""]
        out.append(md_table(["impl", "rows", "reason"], [[i, n, why] for (i, why), n in na.items()]))
        out.append("")
    return "\n".join(out)


def _agg():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panel_grid(n: int):
    cols = min(n, 4) if n > 1 else 1
    return cols, math.ceil(n / cols)


def plot_bench(rows: list[dict], path: str, title: str = "") -> str | None:
    """TFLOP/s vs sequence length, one line per implementation, one panel per
    (precision, head dims or model, mask). A panel with one sequence length is a bar chart."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return None
    plt = _agg()
    keys = _uniq((r["precision"], r["label"], r["causal"]) for r in ok)
    cols, nrows = _panel_grid(len(keys))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
    for ax, (prec, label, causal) in zip(axes.flat, keys):
        prow = [r for r in ok if (r["precision"], r["label"], r["causal"]) == (prec, label, causal)]
        seqs = sorted({r["seqlen"] for r in prow})
        impls = _uniq(r["impl"] for r in prow)
        if len(seqs) == 1:
            vals = [max((r["tflops"] for r in prow if r["impl"] == i), default=0) for i in impls]
            ax.bar(range(len(impls)), vals, color=[f"C{k}" for k in range(len(impls))])
            ax.set_xticks(range(len(impls)))
            ax.set_xticklabels(impls, rotation=35, ha="right", fontsize=7)
        else:
            for k, i in enumerate(impls):
                pts = sorted((r["seqlen"], r["tflops"]) for r in prow if r["impl"] == i)
                style = "-" if "e2e" in i or not i.endswith("kernel") else "--"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                        color=f"C{k}", label=i)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs)
            ax.set_xticklabels([f"{s // 1024}K" if s >= 1024 else str(s) for s in seqs], fontsize=7)
            ax.set_xlabel("sequence length")
            ax.legend(fontsize=6)
        ax.set_title(f"{prec.upper()} {label} {'causal' if causal else 'non-causal'}", fontsize=9)
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_bench(out_dir: str, payload: dict, plots: bool = True, stem: str = "bench",
                data: bool = True) -> list[str]:
    """<stem>.json (unless not ``data``), <stem>.md and one <stem>-<sweep>.png per sweep."""
    files = _write_with_markdown(out_dir, payload, stem, data, bench_markdown)
    if plots:
        rows = payload.get("rows", [])
        for sweep in _uniq(r["sweep"] for r in rows):
            p = plot_bench([r for r in rows if r["sweep"] == sweep],
                           os.path.join(out_dir, f"{stem}-{sweep}.png"),
                           f"{payload.get('env', {}).get('gpu', '')} — {sweep}")
            if p:
                files.append(p)
    return files


# ------------------------------------------------------------------------------- accuracy


def accuracy_markdown(payload: dict) -> str:
    env, rows = payload.get("env", {}), payload.get("rows", [])
    out = [f"# leanfa accuracy — {env.get('gpu', '?')}", ""] + env_lines(env) + [""]
    out += ["Error against the float64 reference on the same BF16 inputs: relative L2 "
            "‖out−ref‖/‖ref‖, max |out−ref|, worst row's relative L2. 'x best peer': a row's relative "
            "L2 over that of the most accurate peer of its precision on the same profile ("
            + "; ".join(f"{p.upper()}: {', '.join(n)}" for p, n in peers.PEERS.items())
            + "; < 1: more accurate than every peer). 'x cuDNN FP8': an FP8 row's relative L2 over "
            "cudnn-fp8's.", ""]
    profiles = _uniq(r["profile"] for r in rows)
    impls = _uniq(r["impl"] for r in rows if r["status"] != "n/a")
    table = []
    for p in profiles:
        cells = {r["impl"]: r for r in rows if r["profile"] == p}
        table.append([p] + [_fmt(cells[i].get("rel_l2"), ".2e") if cells.get(i, {}).get("status") == "ok"
                            else cells.get(i, {}).get("status", "") for i in impls])
    out.append(md_table(["profile (relative L2)"] + impls, table))
    out += ["", "## details", ""]
    out.append(md_table(
        ["profile", "shape", "impl", "status", "rel L2", "max abs", "worst row", "x best peer", "best peer",
         "x cuDNN FP8", "note / error"],
        [[r["profile"], r.get("shape", ""), r["impl"], r["status"], _fmt(r.get("rel_l2"), ".3e"),
          _fmt(r.get("max_abs"), ".3e"), _fmt(r.get("worst_row_rel"), ".3e"),
          _fmt(r.get("ratio_best_peer"), ".2f"),
          (r.get("best_peer") or "no peer ran") if r.get("status") == "ok" else "",
          _fmt(r.get("ratio_cudnn_fp8"), ".2f"), r.get("error") or r.get("reason") or r.get("note", "")]
         for r in rows]))
    return "\n".join(out)


def plot_accuracy(rows: list[dict], path: str, title: str = "") -> str | None:
    """Grouped bars: relative L2 (log scale) per profile, one bar per implementation."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("rel_l2") and r["rel_l2"] > 0
          and math.isfinite(r["rel_l2"])]
    if not ok:
        return None
    plt = _agg()
    profiles = _uniq(r["profile"] for r in ok)
    impls = _uniq(r["impl"] for r in ok)
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(profiles) * max(1, len(impls) / 3)), 4.2))
    for k, i in enumerate(impls):
        xs, ys = [], []
        for j, p in enumerate(profiles):
            v = next((r["rel_l2"] for r in ok if r["profile"] == p and r["impl"] == i), None)
            if v is not None:
                xs.append(j + (k - (len(impls) - 1) / 2) * width)
                ys.append(v)
        ax.bar(xs, ys, width, label=i, color=f"C{k}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(profiles)))
    ax.set_xticklabels(profiles, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("relative L2 error vs float64")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_accuracy(out_dir: str, payload: dict, plots: bool = True, stem: str = "accuracy",
                   data: bool = True) -> list[str]:
    """<stem>.json (unless not ``data``), <stem>.md and <stem>.png."""
    files = _write_with_markdown(out_dir, payload, stem, data, accuracy_markdown)
    if plots:
        p = plot_accuracy(payload.get("rows", []), os.path.join(out_dir, f"{stem}.png"),
                          f"{payload.get('env', {}).get('gpu', '')} — relative L2 error")
        if p:
            files.append(p)
    return files


# ------------------------------------------------------------------------------ model accuracy


def model_accuracy_markdown(payload: dict) -> str:
    """The table of ``leanfa accuracy --model``: one row per (length, implementation)."""
    env, rows, spec = payload.get("env", {}), payload.get("rows", []), payload.get("model", {})
    out = [f"# leanfa accuracy --model — {env.get('gpu', '?')}", ""] + env_lines(env) + [""]
    if spec:
        out += ["Model: random Llama-shaped, " + ", ".join(f"{k} {v}" for k, v in spec.items()) +
                f"; seed {payload.get('seed')}; one sequence per length.", ""]
    out += ["Prefill time: median of CUDA-event times of whole forwards (`logits_to_keep=1`); attention: the "
            "summed CUDA-event times of the attention calls inside those forwards (quantization included); "
            "'prefill − identity': the prefill time minus that of the model with attention replaced by an "
            "identity (attention's cost by subtraction, a cross-check). Errors: relative L2 of the logits (all "
            "positions) against the same model with SDPA attention in BF16 and in float32.", ""]
    if not payload.get("timed", True):
        out += ["No CUDA GPU: the kernels ran under Triton's CPU interpreter; no times.", ""]
    table = []
    for r in rows:
        ok = r.get("status") == "ok"
        share = r.get("attention_share")
        table.append([r["seqlen"], r["impl"], _fmt(r.get("prefill_ms"), ".2f", "-"),
                      _fmt(r.get("attention_ms"), ".2f", "-"), "-" if share is None else f"{share:.1%}",
                      _fmt(r.get("prefill_minus_identity_ms"), ".2f", "-"),
                      _fmt(r.get("rel_l2_vs_sdpa_bf16"), ".3e", "-") if ok else r.get("status", ""),
                      _fmt(r.get("rel_l2_vs_sdpa_fp32"), ".3e", "-") if ok else "",
                      "; ".join(filter(None, [r.get("reason") or r.get("error"), r.get("note"),
                                              *r.get("warnings", [])]))])
    out.append(md_table(["S", "implementation", "prefill ms", "attention ms", "attention share",
                         "prefill − identity ms", "logits rel L2 vs SDPA BF16", "vs SDPA FP32", "note"], table))
    return "\n".join(out)


def write_model_accuracy(out_dir: str, payload: dict, stem: str = "model-accuracy", data: bool = True) -> list[str]:
    """<stem>.json (unless not ``data``) and <stem>.md."""
    return _write_with_markdown(out_dir, payload, stem, data, model_accuracy_markdown)


def _write_with_markdown(out_dir: str, payload: dict, stem: str, data: bool, markdown) -> list[str]:
    """<stem>.json (unless not ``data``) and <stem>.md, ``markdown(payload)``."""
    files = [write_json(os.path.join(out_dir, f"{stem}.json"), payload)] if data else []
    md = os.path.join(out_dir, f"{stem}.md")
    with open(md, "w") as f:
        f.write(markdown(payload) + "\n")
    files.append(md)
    return files


# -------------------------------------------------------------------------------- profile


def profile_markdown(payload: dict) -> str:
    env, kernels = payload.get("env", {}), payload.get("kernels", [])
    out = [f"# leanfa profile — {payload.get('impl', '?')} — {env.get('gpu', '?')}", ""]
    out += env_lines(env) + [""]
    if payload.get("case"):
        out += [f"Case: `{payload['case']}`", ""]
    if payload.get("command"):
        out += ["Command: `" + " ".join(payload["command"]) + "`", ""]
    labels = _uniq(k for kern in kernels for k in kern.get("metrics", {}))
    out.append(md_table(["kernel"] + labels, [
        [kern.get("short_name", kern.get("name", "?"))] +
        [_fmt(kern["metrics"].get(lbl), ".6g") for lbl in labels] for kern in kernels]))
    names = payload.get("metric_names")
    if names:
        out += ["", "Metric per label: " + ", ".join(f"{k} = `{v}`" for k, v in names.items() if v)]
    dropped = payload.get("dropped_metrics")
    if dropped:
        out += ["", "Candidates this GPU/ncu does not have (another candidate of the same label may "
                "have been used): " + ", ".join(f"`{m}`" for m in dropped)]
    return "\n".join(out)


def write_profile(out_dir: str, payload: dict, stem: str = "profile", data: bool = True) -> list[str]:
    """<stem>.json (unless not ``data``) and <stem>.md."""
    return _write_with_markdown(out_dir, payload, stem, data, profile_markdown)


# --------------------------------------------------------------------------------- re-render


#: result kinds ``leanfa report`` renders, and the list of objects each one holds
KINDS = {"bench": "rows", "accuracy": "rows", "model-accuracy": "rows", "profile": "kernels"}


def load_result(path: str) -> dict:
    """The payload of a result JSON written by ``leanfa bench``/``accuracy``/``profile``.

    Raises ValueError with a one-line reason for a file that is not one (not JSON, not an
    object, no known ``kind``, its rows not a list of objects); OSError if it cannot be read."""
    try:
        with open(path) as f:
            payload = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{path}: not a leanfa result file (its top level is a JSON "
                         f"{type(payload).__name__}; leanfa bench/accuracy/profile write an object "
                         f"with 'kind' {' / '.join(KINDS)})")
    kind = payload.get("kind")
    if kind is None and isinstance(payload.get("kernels"), list) and "impl" in payload:
        kind = payload["kind"] = "profile"  # written by leanfa profile before it named its kind
    if kind not in KINDS:
        raise ValueError(f"{path}: not a leanfa result file (kind={kind!r}; expected one of "
                         f"{', '.join(KINDS)})")
    items = payload.get(KINDS[kind], [])
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ValueError(f"{path}: a {kind} result whose {KINDS[kind]!r} is not a list of objects")
    return payload


def rerender(path: str, plots: bool = True) -> list[str]:
    """Write the markdown (and plots) of a result JSON again, next to it and named after it:
    after a run cut before its plots (results are written as rows arrive), or after editing
    ``rows``. The JSON itself is left as it is; the tables' best-peer ratios are recomputed from
    its rows (so files from before those ratios existed get them too).

    Raises ValueError (one line) for a file it cannot render, OSError if unreadable."""
    payload = load_result(path)
    out_dir = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    kind = payload["kind"]
    try:
        if kind == "bench":
            peers.add_best_peer(payload.get("rows", []))
            return write_bench(out_dir, payload, plots=plots, stem=stem, data=False)
        if kind == "accuracy":
            peers.add_best_peer_error(payload.get("rows", []))
            return write_accuracy(out_dir, payload, plots=plots, stem=stem, data=False)
        if kind == "model-accuracy":
            return write_model_accuracy(out_dir, payload, stem=stem, data=False)
        return write_profile(out_dir, payload, stem=stem, data=False)
    except (KeyError, TypeError, AttributeError) as e:  # a row without a field the tables need
        raise ValueError(f"{path}: cannot render this {kind} result ({type(e).__name__}: {e})") from None
