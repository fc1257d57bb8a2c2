"""The ``leanfa`` command: ``demo`` (any machine), the GPU measurement tools ``bench``,
``accuracy`` and ``profile`` (:mod:`leanfa.bench.commands`), ``report`` (any machine) and
``--version``. Every command's ``--help`` is written for users: what it does, its main options,
examples."""

from __future__ import annotations

import argparse
import os
import sys
import time

USAGE = """usage: leanfa <command> [options]      (leanfa <command> --help for each one)

commands:
  demo       model-like prefill attention in BF16 and FP8: error vs float64 (and time on a GPU)
  bench      time leanfa against cuDNN, FlashAttention-3 and others (GPU)
  accuracy   error vs float64 of every implementation on every activation profile (GPU)
  profile    Nsight Compute counters of one attention call (GPU)
  report     re-render the markdown and plots of result JSON files (any machine)

options:
  --version  print leanfa's version
  -h, --help this message

examples:
  leanfa demo                 # works anywhere; on a CPU through Triton's interpreter
  leanfa bench --quick        # ~5 min on an H200: leanfa vs cuDNN and FA3
  leanfa accuracy
"""

DEMO_HELP = """Run leanfa's attention on model-like activations in BF16, FP8, and FP8 with the first
128 keys kept in BF16 ("fp8+sink"), and print each one's relative L2 error against a float64
reference (and its time and TFLOP/s on a GPU).

Works on any machine: without a CUDA GPU the kernels run under Triton's CPU interpreter on a
small problem (errors only, no times)."""

DEMO_EXAMPLES = """examples:
  leanfa demo                                  # llama3-8b activations, 4096 tokens on a GPU
  leanfa demo --preset qwen2.5-7b --seqlen 8192
  leanfa demo --seqlen 192 --heads 4           # a quick check on a CPU
"""

REPORT_HELP = """Write the markdown tables (and PNG plots) of result files from leanfa bench, accuracy
or profile again, next to each file and named after it; the JSON itself is not changed. Use it
after a run that was cut before its plots, or after editing a file's rows. Works anywhere.

A file that is not such a result (another JSON, a list, a file with malformed rows) is refused
with one line and exit status 2."""

REPORT_EXAMPLES = """examples:
  leanfa report bench/results/2026-11-30-h200/bench-quick.json
  leanfa report --no-plots bench/results/*/accuracy.json
"""


def version() -> str:
    """leanfa's version: the imported package's ``__version__``."""
    import leanfa

    return leanfa.__version__


def _parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def _use_interpreter_without_gpu() -> bool:
    """Without a GPU the kernels run under Triton's CPU interpreter (set before triton loads)."""
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _demo_inputs(preset: str, seqlen: int, device: str, heads: int | None):
    import torch

    from .activations import make_qkv

    # with `heads`, the preset's KV heads shrink in the same ratio (GQA kept)
    return make_qkv(preset, 1, seqlen, heads=heads, device=device, dtype=torch.bfloat16)


def demo(argv: list[str]) -> int:
    parser = _parser("leanfa demo", DEMO_HELP, DEMO_EXAMPLES)
    parser.add_argument("--preset", default="llama3-8b",
                        help="activation profile: gaussian, llama3-8b, mistral-7b, qwen2.5-7b, deepseek-v3-mla "
                             "(default llama3-8b)")
    parser.add_argument("--seqlen", type=int, default=None, help="tokens (default 4096 on a GPU, 256 on a CPU)")
    parser.add_argument("--heads", type=int, default=None,
                        help="use the preset's first HEADS query heads (default: all on a GPU, 8 on a CPU)")
    args = parser.parse_args(argv)
    cpu = _use_interpreter_without_gpu()  # before triton is imported

    import torch

    import leanfa
    from leanfa.reference import attention_ref

    device = "cpu" if cpu else "cuda"
    # on a CPU (interpreter) a small problem: 256 tokens so that FP8 keys exist past the
    # 128 BF16 sink keys of the "fp8+sink" row, and 8 query heads
    seqlen = args.seqlen or (256 if cpu else 4096)
    if cpu and not args.heads:
        args.heads = 8
    q, k, v = _demo_inputs(args.preset, seqlen, device, args.heads)
    where = "CPU (Triton interpreter; small shape)" if cpu else torch.cuda.get_device_name()
    print(f"leanfa {leanfa.__version__} demo: {args.preset}, B=1, S={seqlen}, Hq={q.shape[2]}, "
          f"Hkv={k.shape[2]}, d={q.shape[3]}/{v.shape[3]}, causal, on {where}")
    ref = attention_ref(q, k, v, causal=True)
    rows = []
    variants = {  # label -> keyword arguments of leanfa.attention
        "bf16": dict(precision="bf16"),
        "fp8": dict(precision="fp8"),
        "fp8+sink": dict(precision="fp8", bf16_sink_keys=128),  # first 128 keys in BF16
    }
    for precision, kw in variants.items():
        out = leanfa.attention(q, k, v, causal=True, **kw)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        ms = tflops = None
        if not cpu:
            from triton.testing import do_bench

            ms = do_bench(lambda kw=kw: leanfa.attention(q, k, v, causal=True, **kw),
                          warmup=25, rep=100, return_mode="median")
            flops = 2 * q.shape[0] * q.shape[2] * seqlen * seqlen * (q.shape[3] + v.shape[3]) / 2
            tflops = flops / ms / 1e9
        rows.append((precision, err, ms, tflops))
    print(f"{'precision':<10}{'rel L2 err vs fp64':>20}{'time ms':>10}{'TFLOP/s':>10}")
    # fp8+sink: attention(precision="fp8", bf16_sink_keys=128), the first 128 keys in BF16
    for precision, err, ms, tflops in rows:
        t = f"{ms:10.3f}{tflops:10.1f}" if ms is not None else f"{'-':>10}{'-':>10}"
        print(f"{precision:<10}{err:20.3e}{t}")
    if cpu:
        print("(no GPU: times are not shown; the interpreter checks correctness only)")
    return 0


def report(argv: list[str]) -> int:
    """``leanfa report FILE...``: 0 when every file was rendered; 2, with one line on stderr,
    at the first file that cannot be read or is not a result leanfa can render."""
    parser = _parser("leanfa report", REPORT_HELP, REPORT_EXAMPLES)
    parser.add_argument("files", nargs="+", metavar="FILE.json",
                        help="result JSON written by leanfa bench, accuracy or profile")
    parser.add_argument("--no-plots", action="store_true", help="write the markdown only")
    args = parser.parse_args(argv)
    from .bench.report import rerender

    for path in args.files:
        try:
            written = rerender(path, plots=not args.no_plots)
        except ValueError as e:
            print(f"leanfa report: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"leanfa report: {path}: cannot read ({e.strerror or e})", file=sys.stderr)
            return 2
        for w in written:
            print(f"wrote {w}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        print(f"leanfa {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "demo":
            start = time.time()
            rc = demo(rest)
            print(f"done in {time.time() - start:.1f} s")
            return rc
        if command == "report":
            return report(rest)
    except SystemExit as e:  # --help (0) or a usage error argparse already printed (2)
        return e.code if isinstance(e.code, int) else 2
    if command in ("bench", "accuracy", "profile"):
        from .bench.commands import main as bench_main

        return bench_main(command, rest)
    print(f"leanfa: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
