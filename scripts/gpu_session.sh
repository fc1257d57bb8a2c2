#!/usr/bin/env bash
# Everything one H200 session checks, in one call (device time is scarce): GPU tests,
# Hopper v2 check, a short bench and accuracy run, the fuzz campaign and the sanitizers.
# Each step has its own time limit; logs go to $OUT/r/<step>.log, tails to stdout.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash scripts/gpu_session.sh [steps|group]
# Groups sized for one device call each (< 10 min): `checks` (pytest, fuzz, sanitize) and
# `perf` (hopper_v2, bench, accuracy); `sweep` is the full standard bench sweep alone.
# Lessons from the 2026-11-29 session: the GPU test suite is dominated by Triton compiles
# (every constexpr combination compiles once), so pytest runs with xdist (-n 8, installed on
# the device image); the Hopper v2 correctness child alone needs > 120 s.
set -u
OUT=${OUT:-/tmp/leanfa-gpu-session}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
steps=${*:-"checks"}
steps=${steps/checks/pytest fuzz sanitize}
steps=${steps/perf/hopper_v2 bench accuracy}

step() {  # step NAME SECONDS TAIL_LINES CMD...
  local name=$1 secs=$2 tailn=$3; shift 3
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/r/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"
  grep -v -E "UserWarning|return F.scaled_dot|^\s*$" "$OUT/r/$name.log" | tail -n "$tailn"
}

for s in $steps; do
  case $s in
    pytest) step pytest 300 14 env LEANFA_FUZZ_PROFILE=ci python3 -m pytest -q -p no:cacheprovider -rfE -n 8 --dist loadfile \
              tests/test_attention.py tests/test_quant.py tests/test_gpu_large.py tests/test_hopper.py \
              tests/test_ops.py tests/test_edge_cases.py tests/test_determinism.py tests/test_readme.py \
              tests/test_fuzz.py tests/test_validation.py ;;
    hopper_v2) step hopper_v2 240 30 python3 scripts/hopper_v2_gpu.py ;;
    bench) step bench 200 12 python3 -m leanfa.cli bench --quick --no-progress --sweep standard --seqlens 4k,16k \
              --causal true --impl 'leanfa-*,cudnn-bf16,cudnn-fp8' --out "$OUT/r/bench" ;;
    accuracy) step accuracy 120 40 python3 -m leanfa.cli accuracy --out "$OUT/r/accuracy" \
              --impl 'leanfa-portable-fp8,leanfa-portable-fp8-sink,leanfa-hopper-fp8,cudnn-fp8,cudnn-bf16' ;;
    fuzz) step fuzz 150 12 python3 scripts/gpu_fuzz_campaign.py --seconds 130 --seed 0 ;;
    sanitize) step sanitize 110 12 python3 scripts/sanitize.py --tools memcheck racecheck synccheck --timeout 30 ;;
    sweep) step sweep 560 20 python3 -m leanfa.cli bench --no-progress --sweep standard --out "$OUT/r/sweep" ;;
  esac
done
tar czf "$OUT/session.tgz" -C "$OUT/r" . 2>/dev/null
