"""``leanfa profile``: hardware counters of one attention call under Nsight Compute.

The command re-invokes itself as a child under ``ncu``::

    ncu --clock-control none --target-processes all --profile-from-start off \\
        --metrics <list> -f -o <tmp>/report python -m leanfa.bench.profile_child <case args>

The child warms the implementation up, then calls ``cudaProfilerStart``, runs the attention
call once and calls ``cudaProfilerStop``: every kernel of that one call is profiled (FP8
quantization kernels included; ``--skip-kernels REGEX`` drops them from the report, and
``--kernel-regex``/``--launch-skip``/``--launch-count`` pass through to ncu to narrow the
capture). ``--clock-control none`` leaves the GPU at its natural clocks, so the SM clock ncu
reports is the one a real run gets. The report is then exported with
``ncu --import <rep> --page raw --csv`` and parsed (:func:`parse_ncu_csv`: one row per
kernel, a units row under the header, numbers with thousands separators) into one
:data:`METRICS` value per kernel, normalized to us / MHz / bytes.

:data:`METRICS` maps a label to candidate metric names, first accepted wins. Which names
exist depends on the GPU and ncu version, so before profiling the names are checked
against ``ncu --query-metrics`` (base names), and if ncu still rejects one ("Failed to find
metric ...") it is dropped and the run retried; the report lists what was dropped.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

#: label -> candidate ncu metric names (first one ncu accepts is used). Edit freely.
METRICS: list[tuple[str, list[str]]] = [
    ("duration_us", ["gpu__time_duration.sum"]),
    ("sm_clock_mhz", ["smsp__cycles_elapsed.avg.per_second", "sm__cycles_elapsed.avg.per_second"]),
    # Hopper wgmma (GMMA) tensor pipe, then the all-tensor pipe and the mma.sync (HMMA) one
    ("tensor_gmma_pct", ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                         "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active"]),
    ("tensor_pct", ["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"]),
    ("tensor_hmma_pct", ["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                         "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active"]),
    # XU = MUFU (ex2) and conversions
    ("xu_pct", ["sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
                "sm__pipe_xu_cycles_active.avg.pct_of_peak_sustained_active"]),
    ("fma_pct", ["sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"]),
    ("alu_pct", ["sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active"]),
    ("issue_pct", ["sm__inst_issued.avg.pct_of_peak_sustained_active",
                   "smsp__issue_active.avg.pct_of_peak_sustained_active"]),
    ("occupancy_pct", ["sm__warps_active.avg.pct_of_peak_sustained_active"]),
    ("registers", ["launch__registers_per_thread"]),
    ("smem_static_bytes", ["launch__shared_mem_per_block_static"]),
    ("smem_dynamic_bytes", ["launch__shared_mem_per_block_dynamic"]),
    ("grid_size", ["launch__grid_size"]),
    ("block_size", ["launch__block_size"]),
]

_TIME_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
            "second": 1e6, "s": 1e6}
_FREQ_MHZ = {"hz": 1e-6, "khz": 1e-3, "mhz": 1.0, "ghz": 1e3, "cycle/second": 1e-6,
             "cycle/msecond": 1e-3, "cycle/usecond": 1.0, "cycle/nsecond": 1e3}
_BYTES = {"byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "kibyte": 1024.0,
          "mibyte": 1024.0 ** 2, "gibyte": 1024.0 ** 3}


# ------------------------------------------------------------------------------ parsing


def parse_number(text: str):
    """'1,234.5' -> 1234.5; '' / 'n/a' -> None; anything else non-numeric -> the text."""
    t = (text or "").strip().strip('"')
    if t in ("", "n/a", "N/A", "-"):
        return None
    try:
        return float(t.replace(",", ""))
    except ValueError:
        return t


def normalize(value, unit: str, label: str):
    """Scale ``value`` to the label's canonical unit (``*_us``: microseconds, ``*_mhz``:
    MHz, ``*_bytes``: bytes); other labels are returned as they are."""
    if not isinstance(value, float):
        return value
    u = (unit or "").strip().lower()
    base = u.split("/")[0] if label.endswith("_bytes") else u
    if label.endswith("_us") and u in _TIME_US:
        return value * _TIME_US[u]
    if label.endswith("_mhz") and u in _FREQ_MHZ:
        return value * _FREQ_MHZ[u]
    if label.endswith("_bytes") and base in _BYTES:
        return value * _BYTES[base]
    return value


def _rows(text: str) -> list[list[str]]:
    """CSV rows from ncu's output, skipping its ``==PROF==``/``==WARNING==`` lines and any
    program output before the header."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("==")]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith('"')), None)
    if start is None:
        return []
    return list(csv.reader(io.StringIO("\n".join(lines[start:]))))


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernels from ``ncu --csv`` output, in launch order: ``{"id", "name", "metrics":
    {metric: (value, unit)}}``. Reads both the wide ``--page raw`` format (one row per
    kernel, a units row under the header) and the long ``--page details`` format (one row
    per metric, with "Metric Name"/"Metric Unit"/"Metric Value" columns)."""
    rows = _rows(text)
    if not rows:
        return []
    header = [h.strip() for h in rows[0]]
    if "Metric Name" in header:
        return _parse_long(header, rows[1:])
    return _parse_wide(header, rows[1:])


def _kernel_col(header):
    for name in ("Kernel Name", "Function Name", "Demangled Name", "Name"):
        if name in header:
            return header.index(name)
    raise ValueError(f"no kernel name column in ncu CSV header: {header[:12]}")


def _parse_wide(header, body) -> list[dict]:
    kcol = _kernel_col(header)
    id_col = header.index("ID") if "ID" in header else None
    units = [""] * len(header)
    if body and (id_col is not None and body[0][id_col].strip() == "" or body[0][kcol].strip() == ""):
        units, body = body[0], body[1:]
    kernels = []
    for n, row in enumerate(body):
        if len(row) < len(header):
            continue
        metrics = {}
        for j, name in enumerate(header):
            if "__" in name:  # metric columns look like unit__counter...
                metrics[name] = (parse_number(row[j]), units[j].strip() if j < len(units) else "")
        kid = parse_number(row[id_col]) if id_col is not None else n
        kernels.append({"id": int(kid) if isinstance(kid, float) else n, "name": row[kcol],
                        "metrics": metrics})
    return kernels


def _parse_long(header, body) -> list[dict]:
    kcol = _kernel_col(header)
    mcol, ucol, vcol = (header.index(c) for c in ("Metric Name", "Metric Unit", "Metric Value"))
    id_col = header.index("ID") if "ID" in header else None
    kernels: dict = {}
    for row in body:
        if len(row) <= max(mcol, ucol, vcol, kcol):
            continue
        key = row[id_col] if id_col is not None else row[kcol]
        k = kernels.setdefault(key, {"id": len(kernels), "name": row[kcol], "metrics": {}})
        if id_col is not None and isinstance(parse_number(key), float):
            k["id"] = int(parse_number(key))
        k["metrics"][row[mcol].strip()] = (parse_number(row[vcol]), row[ucol].strip())
    return list(kernels.values())


def short_name(name: str, width: int = 90) -> str:
    """Kernel name without its argument list, shortened for a table."""
    s = name.split("(")[0].strip() or name
    return s if len(s) <= width else s[: width - 3] + "..."


def summarize_kernels(kernels: list[dict], metrics=METRICS, skip_regex: str | None = None) -> list[dict]:
    """One dict per kernel: name, short name and a value per label (normalized units)."""
    out = []
    for k in kernels:
        if skip_regex and re.search(skip_regex, k["name"]):
            continue
        vals = {}
        for label, candidates in metrics:
            for m in candidates:
                if m in k["metrics"] and k["metrics"][m][0] is not None:
                    v, unit = k["metrics"][m]
                    vals[label] = normalize(v, unit, label)
                    break
        out.append({"id": k["id"], "name": k["name"], "short_name": short_name(k["name"]),
                    "metrics": vals})
    return out


# --------------------------------------------------------------------------- running ncu


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for root in ("/usr/local/cuda/bin", "/opt/nvidia/nsight-compute"):
        for dirpath, _dirs, files in os.walk(root) if os.path.isdir(root) else ():
            if "ncu" in files:
                return os.path.join(dirpath, "ncu")
    return None


def query_base_metrics(ncu: str) -> set[str]:
    """Base metric names this GPU/ncu knows (empty if the query fails)."""
    try:
        res = subprocess.run([ncu, "--query-metrics", "--csv"], capture_output=True, text=True,
                             timeout=300)
    except (OSError, subprocess.SubprocessError):
        return set()
    names = set()
    for row in csv.reader(io.StringIO(res.stdout)):
        if row and "__" in row[0]:
            names.add(row[0].strip())
    if not names:  # older ncu: whitespace-separated table
        for ln in res.stdout.splitlines():
            tok = ln.split()
            if tok and "__" in tok[0]:
                names.add(tok[0])
    return names


def candidate_metrics(metrics=METRICS) -> list[str]:
    return list(dict.fromkeys(m for _label, cands in metrics for m in cands))


def accepted(names: list[str], base_names: set[str]) -> tuple[list[str], list[str]]:
    """Split metric names into (kept, dropped) by their base name (the part before the
    first rollup/suffix dot). ``launch__`` attributes are always kept; with no base names
    (query failed) everything is kept."""
    if not base_names:
        return list(names), []
    keep, drop = [], []
    for m in names:
        (keep if m.startswith("launch__") or m.split(".")[0] in base_names else drop).append(m)
    return keep, drop


_REJECT = re.compile(r"(?:Failed to find metric|Invalid metric|Unknown metric)[^A-Za-z_]*([A-Za-z0-9_.]+)",
                     re.IGNORECASE)


def rejected_metrics(ncu_output: str) -> list[str]:
    """Metric names ncu complained about in its output."""
    return list(dict.fromkeys(_REJECT.findall(ncu_output)))


def ncu_command(ncu: str, child_args: list[str], report_base: str, metrics: list[str], *,
                kernel_regex: str | None = None, launch_skip: int = 0,
                launch_count: int | None = None, python: str | None = None) -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--profile-from-start", "off",
           "--metrics", ",".join(metrics), "-f", "-o", report_base]
    if kernel_regex:
        cmd += ["--kernel-name", f"regex:{kernel_regex}"]
    if launch_skip:
        cmd += ["--launch-skip", str(launch_skip)]
    if launch_count:
        cmd += ["--launch-count", str(launch_count)]
    return cmd + [python or sys.executable, "-m", "leanfa.bench.profile_child"] + child_args


def run_ncu(ncu: str, child_args: list[str], *, workdir: str, kernel_regex=None, launch_skip=0,
            launch_count=None, metrics=METRICS, log=print, timeout_s: int = 900) -> dict:
    """Profile the child, export and parse the report. Returns
    ``{"kernels", "command", "dropped_metrics", "metric_names", "child_output"}``."""
    names, dropped = accepted(candidate_metrics(metrics), query_base_metrics(ncu))
    report = os.path.join(workdir, "report")
    for _attempt in range(4):
        cmd = ncu_command(ncu, child_args, report, names, kernel_regex=kernel_regex,
                          launch_skip=launch_skip, launch_count=launch_count)
        if log:
            log("running: " + " ".join(cmd))
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        output = res.stdout + res.stderr
        bad = [m for m in rejected_metrics(output) if m in names]
        if res.returncode != 0 and bad:
            dropped += bad
            names = [m for m in names if m not in bad]
            continue
        if res.returncode != 0 and "n/a: " in output:
            from .impls import NotApplicable

            raise NotApplicable(output.split("n/a: ", 1)[1].splitlines()[0])
        if res.returncode != 0:
            raise RuntimeError(f"ncu exited {res.returncode}: {output.strip()[-1500:]}")
        break
    else:
        raise RuntimeError(f"ncu kept rejecting metrics: {dropped}")
    rep = report + ".ncu-rep"
    if not os.path.exists(rep):
        raise RuntimeError("ncu wrote no report: no kernel was profiled (child output: "
                           f"{output.strip()[-800:]})")
    exported = _export(ncu, rep)
    kernels = parse_ncu_csv(exported)
    chosen = {}
    for label, cands in metrics:
        chosen[label] = next((m for m in cands if m in names), None)
    return {"kernels": kernels, "command": cmd, "dropped_metrics": dropped, "metric_names": chosen,
            "child_output": output[-4000:], "report_path": rep}


def _export(ncu: str, rep: str) -> str:
    for extra in (["--print-units", "base"], []):
        res = subprocess.run([ncu, "--import", rep, "--page", "raw", "--csv"] + extra,
                             capture_output=True, text=True, timeout=300)
        if res.returncode == 0 and res.stdout.strip():
            return res.stdout
    raise RuntimeError(f"ncu --import failed: {(res.stdout + res.stderr).strip()[-800:]}")


def profile(child_args: list[str], *, out_dir: str, stem: str, env: dict, case_name: str,
            impl: str, kernel_regex=None, launch_skip=0, launch_count=None, skip_regex=None,
            keep_report: bool = False, log=print) -> tuple[dict, list[str]]:
    """Run one profile and write ``<stem>.json``/``<stem>.md`` into ``out_dir``."""
    from .report import write_profile

    ncu = find_ncu()
    if ncu is None:
        raise FileNotFoundError("Nsight Compute (ncu) not found on PATH")
    with tempfile.TemporaryDirectory(prefix="leanfa-ncu-") as tmp:
        res = run_ncu(ncu, child_args, workdir=tmp, kernel_regex=kernel_regex, launch_skip=launch_skip,
                      launch_count=launch_count, log=log)
        if keep_report:
            os.makedirs(out_dir, exist_ok=True)
            dst = os.path.join(out_dir, f"{stem}.ncu-rep")
            shutil.copy(res["report_path"], dst)
            res["report_path"] = dst
    payload = {"kind": "profile", "env": env, "impl": impl, "case": case_name, "command": res["command"],
               "metric_names": res["metric_names"], "dropped_metrics": res["dropped_metrics"],
               "kernels": summarize_kernels(res["kernels"], skip_regex=skip_regex),
               "raw": res["kernels"], "child_output": res["child_output"],
               "report_path": res["report_path"] if keep_report else None}
    return payload, write_profile(out_dir, payload, stem)
