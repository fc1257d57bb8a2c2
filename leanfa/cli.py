"""The ``leanfa`` command: ``demo`` (the main job, any machine), and the GPU measurement tools
``bench``, ``accuracy`` and ``profile`` (see ``leanfa <command> --help``)."""

from __future__ import annotations

import argparse
import os
import sys
import time

USAGE = """usage: leanfa <command> [options]

commands:
  demo       model-like prefill attention in BF16 and FP8: error vs float64 (and time on a GPU)
  bench      time leanfa against cuDNN, FlashAttention and others (GPU)
  accuracy   error vs float64 of every implementation on every activation profile (GPU)
  profile    Nsight Compute counters of one attention call (GPU)
  report     re-render the markdown and plots of result JSON files (any machine)
"""


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
    cpu = _use_interpreter_without_gpu()
    parser = argparse.ArgumentParser(prog="leanfa demo", description="Model-like prefill attention in BF16 and FP8.")
    parser.add_argument("--preset", default="llama3-8b", help="activation profile (see leanfa.activations)")
    parser.add_argument("--seqlen", type=int, default=None, help="tokens (default 4096 on a GPU, 256 on a CPU)")
    parser.add_argument("--heads", type=int, default=None,
                        help="use the preset's first HEADS query heads (default: all on a GPU, 8 on a CPU)")
    args = parser.parse_args(argv)

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
    parser = argparse.ArgumentParser(prog="leanfa report",
                                     description="Re-render the markdown and plots of leanfa result JSON files.")
    parser.add_argument("files", nargs="+", help="bench/accuracy/profile JSON written by leanfa")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    from .bench.report import rerender

    for path in args.files:
        try:
            written = rerender(path, plots=not args.no_plots)
        except (OSError, ValueError) as e:
            print(f"leanfa report: {e}", file=sys.stderr)
            return 1
        for w in written:
            print(f"wrote {w}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        start = time.time()
        rc = demo(rest)
        print(f"done in {time.time() - start:.1f} s")
        return rc
    if command == "report":
        return report(rest)
    if command in ("bench", "accuracy", "profile"):
        from .bench.cli import main as bench_main

        return bench_main(command, rest)
    print(f"leanfa: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
