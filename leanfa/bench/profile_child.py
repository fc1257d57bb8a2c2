"""Child process of ``leanfa profile`` (run under ncu): one attention call between
``cudaProfilerStart`` and ``cudaProfilerStop``, after a warm-up outside that window.

``python -m leanfa.bench.profile_child --impl NAME --preset P --batch B --seqlen S --heads H
--kv-heads HKV --head-dim D --head-dim-v DV [--no-causal] [--warmup N] [--seed N]``

Exit status: 0 profiled; 3 the implementation does not apply to this case (message on
stderr); 1 anything else.
"""

from __future__ import annotations

import argparse
import sys


def child_args(case, impl: str, warmup: int, seed: int) -> list[str]:
    """The argument list for this module that reproduces ``case``."""
    args = ["--impl", impl, "--preset", case.preset, "--batch", str(case.batch), "--seqlen",
            str(case.seqlen), "--heads", str(case.heads), "--kv-heads", str(case.kv_heads),
            "--head-dim", str(case.head_dim), "--head-dim-v", str(case.head_dim_v),
            "--warmup", str(warmup), "--seed", str(seed)]
    return args + ([] if case.causal else ["--no-causal"])


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m leanfa.bench.profile_child")
    p.add_argument("--impl", required=True)
    p.add_argument("--preset", default="gaussian")
    for name in ("batch", "seqlen", "heads", "kv-heads", "head-dim", "head-dim-v"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from .impls import NotApplicable, all_impls
    from .inputs import make_inputs
    from .shapes import Case

    case = Case("profile", a.preset, a.preset, a.batch, a.seqlen, a.heads, a.kv_heads, a.head_dim,
                a.head_dim_v, not a.no_causal)
    impl = next((i for i in all_impls() if i.name == a.impl), None)
    if impl is None:
        print(f"unknown implementation {a.impl!r}", file=sys.stderr)
        return 1
    try:
        ok, why = impl.available()
        if not ok:
            raise NotApplicable(why)
        x = make_inputs(case, device="cuda", seed=a.seed)
        p = impl.prepare(case, x)
        for _ in range(max(1, a.warmup)):
            p.run()
        torch.cuda.synchronize()
        cudart = torch.cuda.cudart()
        cudart.cudaProfilerStart()
        p.run()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
    except NotApplicable as e:
        print(f"n/a: {e}", file=sys.stderr)
        return 3
    print(f"profiled {impl.name} on {case.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
