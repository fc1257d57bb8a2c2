#!/usr/bin/env bash
# Everything one H200 session checks, in one call (device time is scarce): GPU tests,
# Hopper v2 check, a short bench and accuracy run, the fuzz campaign and the sanitizers.
# Each step has its own time limit; logs go to $OUT/r/<step>.log, tails to stdout.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash scripts/gpu_session.sh [steps...]
set -u
OUT=${OUT:-/tmp/leanfa-gpu-session}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
steps=${*:-"pytest hopper_v2 bench accuracy fuzz sanitize"}

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
    pytest) step pytest 170 14 env LEANFA_FUZZ_PROFILE=ci python3 -m pytest -q -p no:cacheprovider -rfE \
              tests/test_attention.py tests/test_quant.py tests/test_gpu_large.py tests/test_hopper.py \
              tests/test_ops.py tests/test_edge_cases.py tests/test_determinism.py tests/test_readme.py \
              tests/test_fuzz.py tests/test_validation.py ;;
    hopper_v2) step hopper_v2 120 30 python3 scripts/hopper_v2_gpu.py ;;
    bench) step bench 90 12 python3 -m leanfa.cli bench --quick --no-progress --sweep standard --seqlens 4k,16k \
              --causal true --impl 'leanfa-*,cudnn-bf16,cudnn-fp8' --out "$OUT/r/bench" ;;
    accuracy) step accuracy 55 30 python3 -m leanfa.cli accuracy --out "$OUT/r/accuracy" \
              --impl 'leanfa-portable-fp8,leanfa-portable-fp8-sink,leanfa-hopper-fp8,cudnn-fp8,cudnn-bf16' ;;
    fuzz) step fuzz 50 12 python3 scripts/gpu_fuzz_campaign.py --seconds 35 --seed 0 ;;
    sanitize) step sanitize 95 12 python3 scripts/sanitize.py --tools memcheck racecheck synccheck --timeout 30 ;;
  esac
done
tar czf "$OUT/session.tgz" -C "$OUT/r" . 2>/dev/null
