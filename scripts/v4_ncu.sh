#!/usr/bin/env bash
# Nsight Compute side by side (issue 21's diagnosis): one FP8 d128 causal 16K call of each implementation named
# (scripts/v4_proto.py --one: fa3 | cudnn | v3 | onewg-s2p ...), pipe utilizations, stall reasons and the
# executed instruction mix by opcode, as CSV under $OUT/ncu/<impl>.csv. Clocks are left as found.
set -u
mkdir -p "$OUT/ncu"
for impl in "$@"; do
  t0=$SECONDS
  timeout 150 ncu --clock-control none --profile-from-start off --target-processes all \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section Occupancy --section LaunchStats \
    --metrics sass__inst_executed_per_opcode,smsp__inst_executed_pipe_xu.sum,smsp__inst_executed.sum \
    --print-metric-instances values --csv --page details \
    python3 scripts/v4_proto.py --one "$impl" > "$OUT/ncu/$impl.csv" 2> "$OUT/ncu/$impl.err"
  echo "== ncu $impl rc=$? $((SECONDS - t0))s $(grep -c . "$OUT/ncu/$impl.csv") lines"
  grep -E '"Duration"|"Issue Slots Busy"|"Executed Ipc Active"|Registers Per Thread' "$OUT/ncu/$impl.csv" | cut -c1-200 | tail -4
done
