"""``leanfa bench | accuracy | profile``: argument parsing and the three commands.

``leanfa.cli`` dispatches here with :func:`main`. Every command needs a CUDA GPU (profile
also Nsight Compute); without one it prints a one-line reason and returns 2. ``--help``,
``--list`` (implementations and whether they can run here) and ``bench --dry-run`` (the
cases a run would time) work anywhere. The user-facing help of each command is in
:data:`HELP` (description) and :data:`EXAMPLES` (epilog).
"""

from __future__ import annotations

import argparse
import os
import sys

COMMANDS = ("bench", "accuracy", "profile")
DEFAULT_PROFILE_IMPLS = "leanfa-hopper-fp8-kernel,leanfa-portable-fp8-kernel,cudnn-fp8,cudnn-bf16"

HELP = {
    "bench": """Time leanfa's attention against cuDNN and FlashAttention-3 (and others that are
installed) on this GPU.

Each implementation first runs once and is checked against a float64 reference (a wrong
result is reported FAILED, not timed), then it is timed: median of CUDA-event timings, inputs
rotated so they are not served from L2, SM clock and power sampled meanwhile. Sweeps:
"standard" (16K tokens per batch, 16 heads, head dims 128 and MLA 192/128, causal and not),
"models" (the heads of Llama-3-8B, Llama-3.1-70B, Mistral-7B, Qwen2.5-7B, DeepSeek-V3 MLA,
on model-like activations), "varlen" (one uneven prefill batch) and "serving" (packed batches as a
serving engine's flash_attn_varlen_func sees them: six of whole prompts -- one long among many short,
equal lengths, 64 and 256 chat-length prompts -- and two chunked-prefill batches, whose queries are
chunks attending causally, aligned bottom-right, to their cached prefix plus the chunk: 8 chunks of 2K
tokens after prefixes of 1.6K-11.7K, and 3 chunks after 6.5K-28.6K-token prefixes among 12 new prompts);
"chunked" is those two chunked-prefill batches alone. Paged K/V rows (K/V in shuffled 64- or 128-token
pages, the same batch) are opt-in: name them, e.g. --impl 'leanfa-*-paged*'.

Each leanfa row is reported in TFLOP/s and as a ratio to the best peer of its precision on
the same shape (FP8: cuDNN FP8 and FA3 FP8; BF16: cuDNN and FA3 BF16), naming that peer.
Results: JSON, markdown and PNG plots in bench/results/<date>-<gpu>/ (or --out).

Needs a CUDA GPU (leanfa's Hopper kernels and FA3: an H100/H200). --list shows which
implementations can run here and why the others cannot; --dry-run lists the cases.""",
    "accuracy": """Measure every implementation's error against a float64 reference on model-like
activations (and on captured ones with --inputs).

For each activation profile (gaussian and the model presets: outlier channels, attention
sinks, RoPE) at one shape (default B=1, S=2048, causal), every implementation gets the same
BF16 Q/K/V; the table gives relative L2 error, max abs error and the worst row's error, and
each row's error over that of the most accurate peer of its precision (cuDNN, FA3).
Results: JSON, markdown and a PNG in bench/results/<date>-<gpu>/ (or --out).

With --model, the error of a whole model instead: a Llama-shaped model with random weights (fixed seed,
nothing downloaded; Q and K get the outlier statistics of the activation profiles through its weights)
prefills one prompt per length with each attention implementation: transformers' SDPA (the reference),
leanfa BF16, leanfa FP8, FP8 Q.K with BF16 P.V, the FP8 accuracy levers (no K smoothing, Hadamard rotation,
the first 128 keys in BF16) and FlashAttention-3 FP8 where it is installed. For each: the prefill time,
attention's share of it, and the relative L2 error of the logits against the SDPA model in BF16 and in
float32. Results: JSON and markdown (model-accuracy.*).

Needs a CUDA GPU, except --model: without one it runs a tiny model on a short prompt under Triton's CPU
interpreter (errors only, no times).""",
    "profile": """Read the hardware counters of one attention call under Nsight Compute (ncu): kernel
time, SM clock, tensor-core, MUFU and issue utilization, registers, shared memory.

The implementations are profiled one after the other on one shape (--model, or --heads,
--head-dim, --seqlen...), each warmed up first; every kernel of the profiled call is reported
(--skip-kernels drops quantization kernels and the like). Results: JSON and markdown.

Needs a CUDA GPU and ncu on PATH.""",
}

EXAMPLES = {
    "bench": """examples:
  leanfa bench --quick                  # all sweeps at S = 1K, 4K, 16K: ~5 min on an H200
  leanfa bench --sweep standard         # the full standard sweep (S = 512 .. 32K)
  leanfa bench --sweep standard --seqlens 4k,16k --causal true \\
               --impl 'leanfa-hopper-*,cudnn-*,fa3-*'
  leanfa bench --sweep models --models llama3.1-70b --seqlens 8k
  leanfa bench --sweep serving          # packed serving batches, chunked prefill included
  leanfa bench --sweep chunked --quick --impl 'leanfa-*-bf16*,leanfa-*-fp8-kernel,leanfa-*-kvhead*,leanfa-*-paged*,fa3-*'
                                        # chunked prefill: paged K/V beside contiguous, and FA3
  leanfa bench --sweep window --impl 'leanfa-hopper-bf16,leanfa-hopper-fp8-kernel,fa3-*'
                                        # sliding window 4096 at 16K/32K beside causal 4K/8K (FLOPs of the band)
  leanfa bench --list                   # implementations, and why any cannot run here
  leanfa bench --dry-run --quick        # the cases, without running anything
""",
    "accuracy": """examples:
  leanfa accuracy                       # every profile, S = 2048, causal
  leanfa accuracy --seqlen 8192 --impl leanfa-hopper-fp8,cudnn-fp8,fa3-fp8
  leanfa accuracy --inputs layer3.safetensors --profiles gaussian
  leanfa accuracy --model               # 4 layers with Llama-3-8B's shapes at 8K and 32K tokens (GPU)
  leanfa accuracy --model --seqlens 8k,64k --layers 2 --impl 'leanfa*,fa3_fp8'
  leanfa accuracy --model --list        # the implementations it compares
""",
    "profile": """examples:
  leanfa profile --model llama3-8b --seqlen 8192
  leanfa profile --impl leanfa-hopper-fp8-kernel,cudnn-fp8,fa3-fp8 --seqlen 16384 --keep-report
""",
}


def _csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    return items or None


def _ints(text: str | None) -> list[int] | None:
    items = _csv(text)
    if items is None:
        return None
    out = []
    for t in items:
        t = t.lower()
        mult = 1024 if t.endswith("k") else 1
        out.append(int(t.rstrip("k")) * mult)
    return out


def _bool(text: str) -> bool:
    t = text.lower()
    if t in ("1", "true", "yes", "causal"):
        return True
    if t in ("0", "false", "no", "full"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", help="comma list of implementation names, families or globs "
                                  "(e.g. 'leanfa-*,cudnn-fp8,fa3-*'; see --list); default: all")
    p.add_argument("--precision", default="fp8,bf16", help="comma list of fp8,bf16 (default both)")
    p.add_argument("--out", help="output folder (default bench/results/<date>-<gpu>/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--list", action="store_true",
                   help="list the implementations, whether each can run here (and why not), and exit")


def build_parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"leanfa {command}", description=HELP.get(command),
                                epilog=EXAMPLES.get(command),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if command == "bench":
        _common(p)
        p.add_argument("--sweep", default="standard,models,varlen",
                       help="comma list of standard,models,varlen,serving,chunked,window (default "
                            "standard,models,varlen; chunked: the serving sweep's chunked-prefill batches alone; "
                            "window: causal sliding windows of 4096 keys at 16K/32K beside causal 4K/8K, "
                            "--seqlens sets the windowed lengths)")
        p.add_argument("--seqlens", help="comma list overriding the sweeps' sequence lengths "
                                         "(e.g. 1k,4k,16k)")
        p.add_argument("--causal", choices=("both", "true", "false"),
                       help="masks to run (default: both for standard, causal for models/varlen)")
        p.add_argument("--models", help="comma list of model presets for the models sweep: "
                                        "llama3-8b, llama3.1-70b, mistral-7b, qwen2.5-7b, deepseek-v3-mla "
                                        "(default all)")
        p.add_argument("--dims", help="comma list of head dims for the standard sweep: d128, mla, d64, d256 "
                                      "(default d128,mla)")
        p.add_argument("--quick", action="store_true",
                       help="S = 1K, 4K, 16K only and short timing (~5 min for all sweeps on H200)")
        p.add_argument("--warmup-ms", type=float, help="warm-up per row (default 200, quick 100)")
        p.add_argument("--rep-ms", type=float, help="timed time per row (default 1000, quick 200)")
        p.add_argument("--tol-bf16", type=float, help="check tolerance, relative L2 (default 2e-2)")
        p.add_argument("--tol-fp8", type=float, help="check tolerance, relative L2 (default 2.5e-1)")
        p.add_argument("--no-gemm", action="store_true", help="skip the GEMM reference rates")
        p.add_argument("--no-plots", action="store_true", help="write JSON and markdown only")
        p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
        p.add_argument("--name", help="file stem (default bench[-<sweeps>][-quick])")
        p.add_argument("--dry-run", action="store_true", help="print the cases and exit")
    elif command == "accuracy":
        _common(p)
        p.set_defaults(precision=None)  # fp8,bf16; None tells that --precision was not given (--model refuses it)
        p.add_argument("--profiles", help="comma list of activation presets (default: all)")
        p.add_argument("--inputs", action="append", default=[], metavar="FILE.safetensors",
                       help="captured activations (repeatable; see leanfa.activations)")
        p.add_argument("--seqlen", type=int, help="tokens per sequence (default 2048)")
        p.add_argument("--batch", type=int, help="sequences (default 1)")
        p.add_argument("--causal", type=_bool, help="true or false (default true)")
        p.add_argument("--no-plots", action="store_true", help="write JSON and markdown only")
        m = p.add_argument_group(
            "the model-level measurement (--model)",
            "--impl then picks among sdpa, leanfa, leanfa_fp8, leanfa_fp8qk, leanfa_fp8_no_smooth_k, "
            "leanfa_fp8_rotate, leanfa_fp8_sink128, fa3_fp8, identity (names or globs; sdpa, the reference, "
            "always runs). Shape defaults: Llama-3-8B's on a GPU (4 layers), a tiny model on a CPU.")
        m.add_argument("--model", action="store_true",
                       help="measure a whole (random, Llama-shaped) model's prefill instead of single calls")
        m.add_argument("--seqlens", help="comma list of prompt lengths (default 8k,32k on a GPU, 256 on a CPU)")
        m.add_argument("--layers", type=int, help="decoder layers (default 4 on a GPU, 2 on a CPU)")
        m.add_argument("--hidden", type=int, help="hidden size (default 4096; CPU 64)")
        m.add_argument("--heads", type=int, help="query heads (default 32; CPU 4)")
        m.add_argument("--kv-heads", type=int, help="key/value heads (default 8; CPU 2)")
        m.add_argument("--head-dim", type=int, help="head dim (default 128; CPU 64)")
        m.add_argument("--intermediate", type=int, help="MLP size (default 14336; CPU 128)")
        m.add_argument("--vocab", type=int, help="vocabulary (default 128256; CPU 256)")
        m.add_argument("--massive", type=float,
                       help="magnitude of the massive Q/K pair in units of the token std (default 14, as "
                            "measured on Llama-3-8B; 0: none)")
        m.add_argument("--reps", type=int, default=3, help="timed prefills per row (default 3)")
        m.add_argument("--no-fp32-ref", action="store_true",
                       help="skip the float32 reference model (saves its memory and time)")
    elif command == "profile":
        p.add_argument("--impl", default=DEFAULT_PROFILE_IMPLS,
                       help=f"comma list of implementations, profiled one by one (default "
                            f"{DEFAULT_PROFILE_IMPLS})")
        p.add_argument("--model", help="model preset: sets heads, head dims and the activations")
        p.add_argument("--preset", default="gaussian", help="activation profile without --model "
                                                            "(default gaussian)")
        p.add_argument("--seqlen", type=int, default=8192, help="tokens per sequence (default 8192)")
        p.add_argument("--batch", type=int, help="default 16384 // seqlen (at least 1)")
        p.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
        p.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
        p.add_argument("--head-dim", type=int, default=128, help="Q/K head dim (default 128)")
        p.add_argument("--head-dim-v", type=int, help="V head dim (default: --head-dim)")
        p.add_argument("--causal", type=_bool, default=True, help="true or false (default true)")
        p.add_argument("--warmup", type=int, default=3, help="calls before the profiled one")
        p.add_argument("--kernel-regex", help="profile only kernels matching (ncu --kernel-name regex:)")
        p.add_argument("--launch-skip", type=int, default=0)
        p.add_argument("--launch-count", type=int)
        p.add_argument("--skip-kernels", help="regex of kernels to leave out of the report "
                                              "(e.g. 'quant')")
        p.add_argument("--keep-report", action="store_true", help="keep the .ncu-rep next to the results")
        p.add_argument("--out", help="output folder (default bench/results/<date>-<gpu>/)")
        p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
        p.add_argument("--list", action="store_true",
                       help="list the implementations, whether each can run here (and why not), and exit")
    return p


def _missing_requirements(command: str) -> str | None:
    """One-line reason this machine cannot run ``command``, or None."""
    try:
        import torch
    except ImportError:
        return f"leanfa {command} needs torch; it is not installed"
    if not torch.cuda.is_available():
        return f"leanfa {command} needs a CUDA GPU; none found"
    if command == "profile":
        from .profile import find_ncu

        if find_ncu() is None:
            return "leanfa profile needs Nsight Compute (ncu) on PATH; none found"
    return None


def _print_impls(impls) -> int:
    """One line per implementation: name, precision, variant, whether it can run here (the
    reason when not), what it is. Without a CUDA GPU a first line says that the commands need
    one, and rows that run on CPU tensors are marked as such."""
    from .impls import cuda_capability

    gpu = cuda_capability() is not None
    if not gpu:
        print("No CUDA GPU here: leanfa bench, accuracy and profile need one. What each "
              "implementation needs:")
    for i in impls:
        ok, why = i.available()
        if ok:
            state = "available" if gpu else "CPU tensors only (Triton interpreter: checks, not timings)"
        else:
            state = f"unavailable: {why}"
        print(f"{i.name:<28} {i.precision:<5} {i.variant:<7} {state} — {i.description}")
    return 0


def _select_impls(args):
    from .impls import all_impls, select

    precisions = _csv(args.precision or "fp8,bf16")
    bad = [p for p in precisions or [] if p not in ("fp8", "bf16")]
    if bad:
        raise ValueError(f"--precision takes fp8,bf16; got {bad}")
    impls = select(all_impls(), _csv(args.impl), precisions)
    if not impls:
        raise ValueError(f"no implementation matches --impl {args.impl!r} --precision {args.precision!r}")
    return impls


def main(command: str, argv: list[str]) -> int:
    """Run ``leanfa <command> <argv>``; returns the exit status."""
    if command not in COMMANDS:
        print(f"leanfa: unknown command {command!r} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        args = build_parser(command).parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed by argparse
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    try:
        if command == "profile" and args.list:
            from .impls import all_impls

            return _print_impls(all_impls())
        if command == "accuracy" and args.model:
            return _model_accuracy(args)
        if command == "accuracy":
            _refuse_model_options(args)
        if command != "profile" and args.list:
            return _print_impls(_select_impls(args))
        if command == "bench" and args.dry_run:
            return _dry_run(args)
        reason = _missing_requirements(command)
        if reason:
            print(reason, file=sys.stderr)
            return 2
        return {"bench": _bench, "accuracy": _accuracy, "profile": _profile}[command](args)
    except (ValueError, FileNotFoundError) as e:
        print(f"leanfa {command}: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------- commands


def _cases(args):
    from .shapes import SWEEPS, build_cases

    sweeps = _csv(args.sweep) or list(SWEEPS)
    return sweeps, build_cases(sweeps, quick=args.quick, seqlens=_ints(args.seqlens), causal=args.causal,
                               models=_csv(args.models), dims=_csv(args.dims))


def _dry_run(args) -> int:
    sweeps, cases = _cases(args)
    impls = _select_impls(args)
    from .shapes import flops

    for c in cases:
        print(f"{c.name:<70} {flops(c) / 1e12:8.2f} TFLOP")
    print(f"{len(cases)} cases x {len(impls)} implementations ({', '.join(i.name for i in impls)})")
    return 0


def _out_dir(args) -> str:
    from .env import default_out_dir

    return args.out or default_out_dir()


def _stem(sweeps, quick: bool) -> str:
    from .shapes import SWEEPS

    stem = "bench" if sorted(sweeps) == sorted(SWEEPS) else "bench-" + "+".join(sweeps)
    return stem + ("-quick" if quick else "")


def _bench(args) -> int:
    from .env import environment
    from .gemm import gemm_rates
    from .report import peer_markdown, write_bench
    from .runner import BenchConfig, add_ratios, run_bench

    sweeps, cases = _cases(args)
    impls = _select_impls(args)
    cfg = BenchConfig.quick(seed=args.seed) if args.quick else BenchConfig(seed=args.seed)
    if args.warmup_ms is not None:
        cfg.warmup_ms = args.warmup_ms
    if args.rep_ms is not None:
        cfg.rep_ms = args.rep_ms
    if args.tol_bf16 is not None:
        cfg.check_tol["bf16"] = args.tol_bf16
    if args.tol_fp8 is not None:
        cfg.check_tol["fp8"] = args.tol_fp8
    out_dir = _out_dir(args)
    stem = args.name or _stem(sweeps, args.quick)
    env = environment()
    print(f"leanfa bench: {len(cases)} cases x {len(impls)} implementations on {env.get('gpu')} "
          f"-> {out_dir}/{stem}.*", flush=True)
    gemm = {}
    if not args.no_gemm:
        # long enough for the GEMMs to reach the power cap, where they settle (docs/design.md §1.3)
        gemm = gemm_rates(warmup_ms=max(cfg.warmup_ms, 500.0), rep_ms=max(cfg.rep_ms, 500.0),
                          seed=args.seed)
        for k, g in gemm.items():
            print(f"GEMM {k}: " + (f"{g['tflops']:.0f} TFLOP/s at {g.get('sm_clock_mhz')} MHz, "
                                   f"{g.get('power_w')} W" if "tflops" in g else g.get("error", "")))
    payload = {"kind": "bench", "env": env, "config": cfg.to_dict(), "argv": sys.argv[1:],
               "sweeps": sweeps, "quick": args.quick, "gemm": gemm,
               "impls": [{**i.to_dict(), "description": i.description, "baseline": i.baseline}
                         for i in impls], "rows": []}

    def save(rows, plots=False):
        payload["rows"] = add_ratios([dict(r) for r in rows], gemm)
        return write_bench(out_dir, {**payload, "stem": stem}, plots=plots, stem=stem)

    rows = run_bench(cases, impls, cfg, progress=not args.no_progress,
                     on_case_done=lambda rows: save(rows))
    files = save(rows, plots=not args.no_plots)
    headline = peer_markdown(payload["rows"])
    if headline:
        print("\nleanfa against the best peer of its precision on each shape "
              "(x best peer > 1: faster than every peer):\n" + headline)
    counts = {s: sum(r["status"] == s for r in payload["rows"]) for s in ("ok", "n/a", "FAILED")}
    print(f"rows: {counts['ok']} ok, {counts['n/a']} n/a, {counts['FAILED']} FAILED")
    for f in files:
        print(f"wrote {f}")
    return 1 if counts["ok"] == 0 and counts["FAILED"] else 0


def _accuracy(args) -> int:
    from .accuracy import default_impls, list_profiles, run_accuracy
    from .env import environment
    from .report import write_accuracy

    impls = _select_impls(args)
    if not args.impl:
        impls = default_impls(impls)
    profiles = _csv(args.profiles) or list_profiles()
    for f in args.inputs:
        if not os.path.exists(f):
            raise FileNotFoundError(f"--inputs {f}: no such file")
    env = environment()
    seqlen, batch = args.seqlen or 2048, args.batch or 1
    causal = True if args.causal is None else args.causal
    rows = run_accuracy(profiles, args.inputs, impls, batch=batch, seqlen=seqlen, causal=causal, seed=args.seed)
    payload = {"kind": "accuracy", "env": env, "argv": sys.argv[1:], "seqlen": seqlen,
               "batch": batch, "causal": causal, "rows": rows}
    for f in write_accuracy(_out_dir(args), payload, plots=not args.no_plots):
        print(f"wrote {f}")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


#: accuracy options of the model-level measurement (their argparse dests), and those of per-call accuracy
MODEL_OPTIONS = ("seqlens", "layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "massive")
CALL_OPTIONS = ("profiles", "inputs", "seqlen", "batch", "causal", "precision")


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _refuse_model_options(args) -> None:
    given = [_option(d) for d in MODEL_OPTIONS if getattr(args, d) is not None]
    given += ["--no-fp32-ref"] * args.no_fp32_ref + ["--reps"] * (args.reps != 3)
    if given:
        raise ValueError(f"{', '.join(given)}: only with --model (the model-level measurement)")


def _model_spec(args, cpu: bool):
    from .model_accuracy import ModelSpec

    given = {d: getattr(args, d) for d in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                           "vocab", "massive") if getattr(args, d) is not None}
    spec = ModelSpec.tiny(**given) if cpu else ModelSpec(**given)
    spec.check()
    return spec


def _model_accuracy(args) -> int:
    """``leanfa accuracy --model``: on a GPU, or without one under Triton's CPU interpreter (set here, before
    triton is imported)."""
    wrong = [_option(d) for d in CALL_OPTIONS if getattr(args, d) not in (None, [])]
    if wrong:
        hint = " (use --seqlens)" if "--seqlen" in wrong else ""
        raise ValueError(f"{', '.join(wrong)}: not an option of --model{hint}")
    from .model_accuracy import ROWS, row_available, select_rows

    if args.list:
        for r in ROWS:
            ok, why = row_available(r.name)
            print(f"{r.name:<24} {r.precision:<6} {'available' if ok else 'unavailable: ' + why} — {r.description}")
        return 0
    import torch

    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # leanfa's kernels are imported later, by the first call
    seqlens = _ints(args.seqlens) or ([256] if cpu else [8192, 32768])
    rows = select_rows(_csv(args.impl))
    spec = _model_spec(args, cpu)
    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    import dataclasses

    from .env import environment
    from .model_accuracy import run_model_accuracy
    from .report import model_accuracy_markdown, write_model_accuracy

    where = "CPU (Triton interpreter; errors only)" if cpu else torch.cuda.get_device_name()
    print(f"leanfa accuracy --model: {spec.layers} layers, hidden {spec.hidden}, heads {spec.heads}/{spec.kv_heads} "
          f"d{spec.head_dim}, S = {', '.join(map(str, seqlens))}, on {where}", flush=True)
    out = run_model_accuracy(spec, seqlens, rows, device="cpu" if cpu else "cuda", seed=args.seed, reps=args.reps,
                             fp32_reference=not args.no_fp32_ref)
    payload = {"kind": "model-accuracy", "env": environment(), "argv": sys.argv[1:],
               "model": {**dataclasses.asdict(spec), "q_std": spec.q_token_std}, "seed": args.seed,
               "seqlens": seqlens, "reps": args.reps, "timed": not cpu, "rows": out}
    print("\n" + model_accuracy_markdown(payload).split("\n\n")[-1])
    for f in write_model_accuracy(_out_dir(args), payload):
        print(f"wrote {f}")
    return 0 if all(r["status"] != "FAILED" for r in out) else 1


def _profile(args) -> int:
    from .env import environment
    from .impls import NotApplicable, all_impls
    from .profile import profile
    from .profile_child import child_args
    from .shapes import MODELS, STANDARD_TOKENS, Case, activation_preset

    if args.model:
        if args.model not in MODELS:
            raise ValueError(f"unknown --model {args.model!r}; choose from {tuple(MODELS)}")
        hq, hkv, dqk, dv = MODELS[args.model]
        preset = activation_preset(args.model)
    else:
        hq, dqk = args.heads, args.head_dim
        hkv, dv, preset = args.kv_heads or hq, args.head_dim_v or dqk, args.preset
    batch = args.batch or max(1, STANDARD_TOKENS // args.seqlen)
    case = Case("profile", args.model or f"d{dqk}", preset, batch, args.seqlen, hq, hkv, dqk, dv,
                args.causal)
    names = _csv(args.impl) or []
    known = {i.name for i in all_impls()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown implementation(s) {unknown}; see leanfa profile --list")
    env, out_dir, status = environment(), _out_dir(args), 1
    for name in names:
        stem = f"profile-{name}-{case.label}-S{case.seqlen}-{'causal' if case.causal else 'full'}"
        try:
            payload, files = profile(child_args(case, name, args.warmup, args.seed), out_dir=out_dir,
                                     stem=stem, env=env, case_name=case.name, impl=name,
                                     kernel_regex=args.kernel_regex, launch_skip=args.launch_skip,
                                     launch_count=args.launch_count, skip_regex=args.skip_kernels,
                                     keep_report=args.keep_report)
        except NotApplicable as e:
            print(f"{name}: n/a ({e})")
            continue
        except Exception as e:
            print(f"{name}: FAILED ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        status = 0
        for k in payload["kernels"]:
            m = k["metrics"]
            print(f"{name}: {k['short_name'][:60]:<60} " + ", ".join(
                f"{lbl}={m[lbl]:.4g}" for lbl in ("duration_us", "sm_clock_mhz", "tensor_gmma_pct",
                                                   "tensor_pct", "xu_pct", "issue_pct", "registers")
                if isinstance(m.get(lbl), float)))
        for f in files:
            print(f"wrote {f}")
    return status


if __name__ == "__main__":  # python -m leanfa.bench.commands bench --quick
    sys.exit(main(sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else main("", []))
