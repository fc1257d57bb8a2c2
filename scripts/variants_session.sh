#!/usr/bin/env bash
# One device call for kernel candidates (the fifteenth session): GPU checks of each config (small case set) and
# compiles in parallel, then kernel-alone timing against FA3 and cuDNN, then FP8 error vs float64.
# Usage (repo root, GPU machine): OUT=dir CONFIGS=a,b,c SHAPES=... bash scripts/variants_session.sh
set -u
OUT=${OUT:-/tmp/variants}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w"; done
export PYTHONPATH=/tmp/site:$PYTHONPATH
CONFIGS=${CONFIGS:-v3}; SHAPES=${SHAPES:-d128-4k,d128-16k,mla-16k}
t0=$SECONDS
for c in ${CHECK:-${CONFIGS//,/ }}; do
  timeout ${CHECK_S:-300} python scripts/hopper_configs_gpu.py --check "$c:small" --no-bench > "$OUT/check-$c.log" 2>&1 &
done
for c in ${CONFIGS//,/ }; do
  timeout 300 python scripts/kernel_variants.py --warm --configs "$c" --shapes "$SHAPES" ${BF16:+--bf16} > "$OUT/warm-$c.log" 2>&1 &
done
wait
echo "== checks + compiles: $((SECONDS - t0)) s"
for f in "$OUT"/check-*.log; do echo "$f: $(grep -E '^correctness' "$f" | tail -1) $(grep -cE 'FAIL|mismatch' "$f") fail-lines"; done
grep -l Traceback "$OUT"/warm-*.log | head
timeout ${TIME_S:-240} python scripts/kernel_variants.py --configs "$CONFIGS" --shapes "$SHAPES" --rounds ${ROUNDS:-1} ${BF16:+--bf16} > "$OUT/time.log" 2>&1
sed -n '/=== summary/,$p' "$OUT/time.log"
echo "== timing done: $((SECONDS - t0)) s"
if [ -n "${ERR_S:-}" ]; then
  timeout 120 python scripts/kernel_variants.py --configs "${ERR_CONFIGS:-$CONFIGS}" --error "$ERR_S" > "$OUT/error.log" 2>&1
  grep -E "^error|Error" "$OUT/error.log" | head -20
fi
echo "== total: $((SECONDS - t0)) s"
