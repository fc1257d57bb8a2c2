#!/usr/bin/env bash
# Everything one H200 session checks, in one call (device time is scarce): GPU tests,
# Hopper kernel configurations check, bench sweeps, accuracy, profiles, the fuzz campaign and the sanitizers.
# Each step has its own time limit; logs go to $OUT/r/<step>.log, tails to stdout.
# Usage (repo root, on the GPU machine): OUT=/some/dir bash scripts/gpu_session.sh [steps|group]
#   ... or lanes separated by "::", each on its own GPU, run in parallel:
#   bash scripts/gpu_session.sh sweep :: checks     (lane 0 on GPU 0, lane 1 on GPU 1)
# Lane 0 is pinned to 4 CPU cores and the other lanes share the rest, so lane 0 can time
# while another lane compiles (compiles are CPU-bound). Groups sized for one call (< 10 min):
# `checks` (pytest, fuzz), `perf` (hopper_configs, bench, accuracy); `sweep` is the full standard
# bench sweep alone (~8 min), `models` the model-preset and varlen sweeps; `fuzz_long` a ~7 min
# campaign, `bench_host` the short-sequence rows where host time matters (S = 512, 4K, 16K).
# Lessons from the 2026-11-29 sessions: the GPU test suite is dominated by Triton compiles
# (every constexpr combination compiles once), so pytest runs with xdist; a Hopper configuration's
# correctness child alone needs > 120 s.
set -u
OUT=${OUT:-/tmp/leanfa-gpu-session}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
# Wheels shipped with the checkout (.whl/: the fa3-fwd FlashAttention-3 wheel, the cuDNN frontend)
# go to /tmp/site, ahead of the image's packages on PYTHONPATH. One pip call per wheel, so a wheel
# that does not fit this Python (e.g. a cp312-only one) does not keep the others out.
if compgen -G ".whl/*.whl" > /dev/null; then
  for w in .whl/*.whl; do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w"
    rc=$?
    echo "== wheel ${w#.whl/} -> /tmp/site: pip rc=$rc"
  done
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
FA3_IMPLS='leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,cudnn-fp8,cudnn-bf16,fa3-fp8,fa3-bf16'  # kernels vs peers
WORKERS=${WORKERS:-8}

step() {  # step NAME SECONDS TAIL_LINES CMD...
  local name=$1 secs=$2 tailn=$3; shift 3
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/r/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0))s"
  grep -v -E "UserWarning|return F.scaled_dot|^\s*$" "$OUT/r/$name.log" | tail -n "$tailn"
}

run_steps() {
  local steps="$*"
  steps=${steps/checks/pytest fuzz}
  steps=${steps/perf/hopper_configs bench accuracy}
  for s in $steps; do
    case $s in
      pytest) step pytest "${PYTEST_LIMIT:-360}" 16 env LEANFA_FUZZ_PROFILE=ci python3 -m pytest -q -p no:cacheprovider -rfEs \
                -n "$WORKERS" --dist loadfile tests --ignore tests/test_packaging.py \
                --deselect tests/test_readme.py::test_api_docs_build_without_warnings ;;
      pytest_hopper) step pytest_hopper "${PYTEST_LIMIT:-420}" 16 env LEANFA_FUZZ_PROFILE=ci python3 -m pytest -q \
                -p no:cacheprovider -rfEs -n "$WORKERS" tests/test_hopper.py tests/test_fuzz.py ;;  # half 1 (not loadfile:
                # two files, so --dist loadfile ran each on one worker and 400 s did not finish them, run 59)
      pytest_rest) step pytest_rest "${PYTEST_LIMIT:-420}" 16 env LEANFA_FUZZ_PROFILE=ci python3 -m pytest -q \
                -p no:cacheprovider -rfEs -n "$WORKERS" --dist loadfile tests --ignore tests/test_packaging.py \
                --ignore tests/test_hopper.py --ignore tests/test_fuzz.py \
                --deselect tests/test_readme.py::test_api_docs_build_without_warnings ;;  # half 2 of the GPU suite
      pytest_long) step pytest_long 240 10 python3 -m pytest -q -p no:cacheprovider -rfEs \
                tests/test_edge_cases.py -k "131k or 2_31" ;;
      serving_close) step serving_gpu 300 16 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs -n "$WORKERS" \
                tests/test_hopper_seqused.py tests/test_paged_kv.py  # seqused_q on the Hopper kernel; paged tests
                for c in True-True-True False-True-True False-False-False; do  # FP8 varlen causal, FP8 dense causal, BF16 dense
                  step "seqused_q_memcheck_$c" 100 3 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 /usr/local/cuda/bin/compute-sanitizer \
                    --tool memcheck --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider \
                    "tests/test_hopper_seqused.py::test_gpu_seqused_q[$c]"; done ;;
      fa2_tests) for part in 0 1; do  # flash-attn 2's tests (FA2_SRC: its tests/ folder's files), a 1/250 sample in two
                # parts; the step's limit leaves pytest 30 s after --timeout's SIGINT to write the summary (runs 102-103)
                step "fa2_part$part" 260 30 python3 scripts/flash_attn_tests.py --suite fa2 --src "${FA2_SRC:?}" \
                  --every 250 --part "$part/2" --timeout 200 -- -n 12; done ;;
      hopper_configs) step hopper_configs 560 30 python3 scripts/hopper_configs_gpu.py ;;  # the default's check + timings
      varlen) step varlen 300 20 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_hopper.py \
                tests/test_attention.py -k varlen
                step bench_varlen 240 24 python3 -m leanfa.cli bench --no-progress --sweep varlen \
                --impl 'leanfa-*,cudnn-*,sdpa-*' --name bench-varlen --out "$OUT/r/bench_varlen" ;;
      persist) step persist 560 60 python3 scripts/hopper_configs_gpu.py --check v3-persist:small --check-timeout 200 \
                --time v3,v3-persist ;;  # one program per SM, heaviest tiles first
      persist_check) step persist_check 420 40 python3 scripts/hopper_configs_gpu.py --check v3-persist \
                --check-timeout 300 --no-bench --sanitize ;;
      bench_d64) step bench_d64 200 16 python3 -m leanfa.cli bench --quick --no-progress --sweep standard \
                --dims d64,d128,mla,d256 --seqlens 4k,16k --causal true --impl 'leanfa-hopper-*,cudnn-bf16,cudnn-fp8' \
                --name bench-dims --out "$OUT/r/bench_dims" ;;  # the bench table, head dims 64 and 256 included
      models_quick) step models_quick 300 24 python3 -m leanfa.cli bench --quick --no-progress --sweep models \
                --seqlens 4k,16k --impl 'leanfa-hopper-fp8,leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,cudnn-bf16,cudnn-fp8' \
                --name bench-models --out "$OUT/r/models_quick" ;;  # the model presets (GQA, MLA) at 4K and 16K
      bench_d256) step bench_d256 200 16 python3 -m leanfa.cli bench --quick --no-progress --sweep standard \
                --dims d256,d128 --seqlens 4k,16k --causal true \
                --impl 'leanfa-hopper-fp8,leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,leanfa-portable-fp8-kernel,leanfa-portable-bf16,cudnn-*,sdpa-*' \
                --name bench-d256 --out "$OUT/r/bench_d256" ;;  # head dim 256 on Hopper against cuDNN
      d256_stages) for st in 2 3; do  # FP8 d256: the 2-slot ring against 3 slots (LEANFA_HOPPER_STAGES; BF16 fits 2 only)
                step "d256_stages$st" 150 8 env LEANFA_HOPPER_STAGES=$st python3 -m leanfa.cli bench --quick --no-progress \
                  --sweep standard --dims d256 --seqlens 4k,16k --causal true --impl 'leanfa-hopper-fp8-kernel,cudnn-fp8' \
                  --name "bench-d256-stages$st" --out "$OUT/r/d256_stages$st"; done ;;
      trace_d256) step trace_d256 300 40 python3 scripts/hopper_trace.py --out "$OUT/r/trace_d256" \
                --cases fp8-d256-16k,fp8-d256-16k-stages3,bf16-d256-16k,fp8-d128-16k ;;
      sink_check) step sink_check 300 20 env LEANFA_HOPPER_SINK=1 python3 -m pytest -q -p no:cacheprovider -rfEs \
                -n "$WORKERS" tests/test_hopper.py tests/test_attention.py -k sink ;;  # BF16 sink keys in v3 (sink.py)
      sink_sanitize) for tool in memcheck synccheck; do  # the sink path's small cases under compute-sanitizer
                step "sink_$tool" 200 12 env LEANFA_HOPPER_SINK=1 /usr/local/cuda/bin/compute-sanitizer --tool $tool \
                  --error-exitcode 3 python3 -m pytest -q -p no:cacheprovider tests/test_hopper.py \
                  -k "v3_bf16_sink_keys and (300-700 or 100-100)"; done ;;
      bench_sink) step bench_sink 200 16 env LEANFA_HOPPER_SINK=1 python3 -m leanfa.cli bench --quick --no-progress \
                --sweep standard --dims d128,d64 --seqlens 4k,16k --causal true \
                --impl 'leanfa-hopper-fp8,leanfa-hopper-fp8-sink,leanfa-portable-fp8-sink,leanfa-hopper-bf16,cudnn-*' \
                --name bench-sink --out "$OUT/r/bench_sink" ;;
      accuracy_sink) step accuracy_sink 150 40 env LEANFA_HOPPER_SINK=1 python3 -m leanfa.cli accuracy \
                --out "$OUT/r/accuracy_sink" ;;  # leanfa-hopper-fp8-sink rows: the v3 in-kernel sink
      early_q_check) step early_q_check 470 40 python3 scripts/hopper_configs_gpu.py --check v3,v3-persist:small \
                --check-timeout 300 --no-bench --sanitize ;;  # the Q box handed back after the last QK (both grids)
      tma_check) step tma_check 470 40 python3 scripts/hopper_configs_gpu.py --check v3-tma,v3-tma-persist:small \
                --check-timeout 300 --no-bench --sanitize ;;  # the TMA-store epilogue (LEANFA_HOPPER_STORE_TMA=1)
      tma_validate) step tma_validate 420 40 env LEANFA_CHECK_DTYPES=fp8 python3 scripts/hopper_configs_gpu.py \
                --check v3-tma-persist,v3-tma:small,v3-persist:small --check-timeout 250 --no-bench --sanitize ;;
      short_grid) for tma in 0 1; do for p in 0 1; do  # 1K-4K: per-tile cost (grid x epilogue), no other lane
                step "short_t${tma}p$p" 150 12 env LEANFA_HOPPER_STORE_TMA=$tma LEANFA_HOPPER_PERSISTENT=$p python3 -m leanfa.cli \
                  bench --quick --no-progress --sweep standard --dims d128,mla --seqlens 1k,2k,4k,16k --causal true \
                  --impl 'leanfa-hopper-fp8-kernel,cudnn-fp8' --name "short-t${tma}p$p" --out "$OUT/r/short_t${tma}p$p"; done; done ;;
      short_time) step short_time 200 20 python3 scripts/short_time.py ;;  # kernel alone: grid/persistent x epilogue
      short_bf16) step short_bf16 200 20 python3 scripts/short_time.py --dtype bf16 ;;  # BF16: grid/persistent x epilogue
      bf16_tma) step bf16_tma 300 16 env LEANFA_HOPPER_STORE_TMA=2 LEANFA_CHECK_DTYPES=bf16 python3 scripts/hopper_configs_gpu.py \
                --check v3-tma2,v3-tma2-persist:small --check-timeout 240 --no-bench --sanitize ;;  # BF16 TMA store
      tma_sync) step tma_sync 150 12 env LEANFA_CHECK_DTYPES=fp8 LEANFA_HOPPER_STORE_TMA=1 LEANFA_HOPPER_PERSISTENT=1 \
                /usr/local/cuda/bin/compute-sanitizer --tool synccheck --error-exitcode 3 python3 scripts/hopper_configs_gpu.py \
                --child v3-tma-persist --small --child-sanitize ;;
      trace_short) step trace_short 240 60 python3 scripts/hopper_trace.py --out "$OUT/r/trace_short" \
                --cases fp8-d128-1k,fp8-d128-1k-persist,fp8-d128-1k-tma,fp8-d128-1k-tma-persist,fp8-d128-4k,fp8-d128-4k-tma-persist,fp8-d128-16k,fp8-d128-16k-tma ;;  # per-tile cost
      sink_short) step sink_short 150 16 python3 -m leanfa.cli bench --quick --no-progress --sweep standard \
                --dims d128,d64 --seqlens 1k,4k --causal true \
                --impl 'leanfa-hopper-fp8,leanfa-hopper-fp8-sink,leanfa-portable-fp8-sink,cudnn-fp8' \
                --name sink-short --out "$OUT/r/sink_short" ;;  # the v3 sink at short S, no other lane
      d64_kernels) step d64_kernels 150 16 python3 -m leanfa.cli bench --quick --no-progress --sweep standard \
                --dims d64 --seqlens 4k,16k --causal true \
                --impl 'leanfa-hopper-fp8-kernel,leanfa-portable-fp8-kernel,cudnn-fp8,leanfa-hopper-bf16,leanfa-portable-bf16,cudnn-bf16' \
                --name d64-kernels --out "$OUT/r/d64_kernels" ;;  # run 45: the portable FP8 sink beat v3 at d64 16K
      host_ab) for c in 0 1; do  # the plan cache off / on (plan_cache.py): host time per call, and the profile with it on
                step "host_plan$c" 120 14 env LEANFA_HOPPER_PLAN_CACHE=$c python3 scripts/host_time.py --shapes 16x1024,4x4096 \
                  $([ "$c" = 1 ] && echo --profile); done ;;
      short_e2e) for c in 0 1; do  # the end-to-end rows at S = 1K/2K, where host time showed (run 47), cache off / on
                step "short_e2e$c" 150 16 env LEANFA_HOPPER_PLAN_CACHE=$c python3 -m leanfa.cli bench --quick --no-progress \
                  --sweep standard --dims d128,mla --seqlens 1k,2k --causal true \
                  --impl 'leanfa-hopper-fp8,leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,cudnn-fp8,cudnn-bf16' \
                  --name "short-e2e$c" --out "$OUT/r/short_e2e$c"; done ;;
      prepared_cache) step prepared_cache 420 16 env LEANFA_HOPPER_PLAN_CACHE=2 LEANFA_FUZZ_PROFILE=ci python3 -m pytest \
                -q -p no:cacheprovider -rfEs -n "$WORKERS" tests/test_hopper_host.py tests/test_hopper.py \
                tests/test_attention.py tests/test_edge_cases.py tests/test_fuzz.py ;;  # varlen / copied-V plans kept
      host_prepared) for c in 1 2; do  # varlen plans kept (2) or not (1): host time per call
                step "host_prepared$c" 120 14 env LEANFA_HOPPER_PLAN_CACHE=$c python3 scripts/host_time.py \
                  --shapes 16x1024,4x4096; done ;;
      direct_launch) step direct_launch 300 16 env LEANFA_DIRECT_LAUNCH=1 python3 -m pytest -q -p no:cacheprovider -rfEs \
                -n "$WORKERS" tests/test_launcher.py tests/test_quant.py tests/test_attention.py tests/test_accuracy_levers.py ;;
      host_direct) for c in 0 1; do  # the quantizer's launches through the JIT (0) or direct (1): host time per call
                step "host_direct$c" 120 14 env LEANFA_DIRECT_LAUNCH=$c python3 scripts/host_time.py \
                  --shapes 16x1024,4x4096; done ;;
      varlen_persist) for p in 0 1; do  # varlen on the persistent grid (emulator-checked; varlen keeps the one-tile grid)
                step "varlen_persist$p" 150 16 env LEANFA_HOPPER_PERSISTENT=$p python3 -m leanfa.cli bench --quick \
                  --no-progress --sweep varlen --impl 'leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,cudnn-fp8,cudnn-bf16' \
                  --name "varlen-persist$p" --out "$OUT/r/varlen_persist$p"; done
                step varlen_persist_check 300 12 env LEANFA_HOPPER_PERSISTENT=1 python3 -m pytest -q -p no:cacheprovider \
                  -rfEs -n "$WORKERS" -k varlen tests/test_hopper.py tests/test_flash_attn_compat.py tests/test_attention.py ;;
      varlen_v_time) step varlen_v_time 200 40 python3 scripts/varlen_v_time.py ;;  # the FP8 varlen V re-pack per tile
      host_time) step host_time 200 20 python3 scripts/host_time.py --profile --shapes 16x1024,4x4096,1x16384 ;;  # CPU time per call vs GPU time
      quant_time) step quant_time 200 40 python3 scripts/quant_time.py ;;  # FP8 end-to-end: quantizer kernels, GB/s
      ablate) step ablate 300 60 python3 scripts/hopper_configs_gpu.py --check "" \
                --time v3,v3-noexp,v3-nomax,v3-nosoftmax,v3-onewg ;;  # what the softmax parts cost; one warpgroup alone
      stalls_ablate) step stalls_ablate 240 60 env LEANFA_HOPPER_ABLATE=exp,max python3 scripts/ncu_stalls.py \
                --impl leanfa-hopper-fp8-kernel --out "$OUT/r/stalls_ablate" ;;  # where it waits without the softmax math
      bench_persist) step bench_persist 200 12 env LEANFA_HOPPER_PERSISTENT=1 python3 -m leanfa.cli bench --quick \
                --no-progress --sweep standard --seqlens 4k,16k --causal true \
                --impl 'leanfa-hopper-*,cudnn-bf16,cudnn-fp8' --name bench-persist --out "$OUT/r/bench_persist" ;;
      d256_check) step d256_check 420 40 env LEANFA_CHECK_DIMS=256/256 python3 scripts/hopper_configs_gpu.py --check v3 \
                --check-timeout 240 --no-bench --sanitize ;;  # head dim 256: its grid + varlen, sanitizers
      hopper_v3_check) step hopper_v3_check 420 40 python3 scripts/hopper_configs_gpu.py --check v3 --check-timeout 300 \
                --no-bench --sanitize ;;
      bench_v3) step bench_v3 200 12 python3 -m leanfa.cli bench --quick --no-progress \
                --sweep standard --seqlens 4k,16k --causal true --impl 'leanfa-hopper-*,cudnn-bf16,cudnn-fp8' \
                --name bench-v3 --out "$OUT/r/bench_v3" ;;
      stalls) step stalls 240 120 python3 scripts/ncu_stalls.py --out "$OUT/r/stalls" ;;  # which SASS waits, on what
      profile_v3) step profile_v3 150 30 python3 -m leanfa.cli profile \
                --out "$OUT/r/profile_v3" --impl leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,cudnn-fp8 ;;
      v3_safety) step v3_safety 330 20 python3 scripts/hopper_configs_gpu.py --check v3 --check-timeout 240 --no-bench \
                --sanitize ;;
      racecheck_ws) step racecheck_ws 120 20 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 3 \
                python3 scripts/racecheck_ws_minimal.py  # is the warp-specialized kernels' racecheck report Triton's?
                step racecheck_ws_bar 120 20 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --error-exitcode 3 \
                python3 scripts/racecheck_ws_minimal.py --thread-barrier ;;
      fuzz_v3) step fuzz_v3 200 16 python3 scripts/gpu_fuzz_campaign.py --seconds 160 --seed 3 --workers "$WORKERS" ;;
      rates) step rates 120 20 python3 -m leanfa.bench.rates --json "$OUT/r/rates.json" ;;
      bench) step bench 200 12 python3 -m leanfa.cli bench --quick --no-progress --sweep standard --seqlens 4k,16k \
                --causal true --impl 'leanfa-*,cudnn-bf16,cudnn-fp8' --out "$OUT/r/bench" ;;
      accuracy) step accuracy 150 40 python3 -m leanfa.cli accuracy --out "$OUT/r/accuracy" ;;
      profile) step profile 150 30 python3 -m leanfa.cli profile --out "$OUT/r/profile" \
                --impl leanfa-hopper-fp8-kernel,leanfa-portable-fp8-kernel,cudnn-fp8 ;;
      profile_hopper) step profile_hopper 200 30 python3 -m leanfa.cli profile --out "$OUT/r/profile_hopper" \
                --impl leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,cudnn-fp8,cudnn-bf16 ;;  # ncu: the Hopper kernels vs cuDNN
      fuzz_long) step fuzz_long 470 14 python3 scripts/gpu_fuzz_campaign.py --seconds 430 --seed 2 --workers "$WORKERS" ;;
      bench_host) step bench_host 300 14 python3 -m leanfa.cli bench --quick --no-progress --sweep standard \
                --seqlens 512,4k,16k --causal true --impl 'leanfa-*,cudnn-bf16,cudnn-fp8,cudnn-fp8-e2e' \
                --name bench-host --out "$OUT/r/bench_host" ;;
      fuzz_replay) step fuzz_replay 120 12 python3 scripts/gpu_fuzz_campaign.py \
                --replay 1890464196 900346328 1265751251 ;;  # run 17's failures (empty varlen batches on Hopper)
      fuzz_short) step fuzz_short 100 14 python3 scripts/gpu_fuzz_campaign.py --seconds 60 --seed 5 --workers "$WORKERS" ;;
      fuzz) step fuzz 190 14 python3 scripts/gpu_fuzz_campaign.py --seconds 150 --seed 1 --workers "$WORKERS" ;;
      sanitize) step sanitize 110 12 python3 scripts/sanitize.py --tools memcheck racecheck synccheck --timeout 30 ;;
      sweep) step sweep 560 20 python3 -m leanfa.cli bench --no-progress --sweep standard --out "$OUT/r/sweep" ;;
      sweep_causal) step sweep_causal 330 20 python3 -m leanfa.cli bench --no-progress --sweep standard --causal true \
                --name bench-standard-causal --out "$OUT/r/sweep" ;;
      sweep_full) step sweep_full 330 20 python3 -m leanfa.cli bench --no-progress --sweep standard --causal false \
                --name bench-standard-full --out "$OUT/r/sweep" ;;
      pytest:*) step pytest_subset 300 12 python3 -m pytest -q -p no:cacheprovider -rfEs -n "$WORKERS" \
                $(echo "${s#pytest:}" | tr ',' ' ') ;;
      persist_time) step persist_time 300 60 python3 scripts/hopper_configs_gpu.py --check "" \
                --time v3,v3-persist ;;  # the persistent grid again, with no other lane (run 37's trace: +4.6% at 4K)
      persist_short) for p in 0 1; do step "persist_short$p" 150 12 env LEANFA_HOPPER_PERSISTENT=$p python3 -m leanfa.cli \
                bench --quick --no-progress --sweep standard --dims d128,mla --seqlens 1k,2k,4k --causal true \
                --impl 'leanfa-hopper-fp8-kernel,leanfa-hopper-bf16,cudnn-fp8,cudnn-bf16' --name "persist$p" \
                --out "$OUT/r/persist_short$p"; done ;;
      bench_varlen) step bench_varlen 200 16 python3 -m leanfa.cli bench --quick --no-progress --sweep varlen \
                --impl 'leanfa-hopper-*,leanfa-portable-fp8-kernel,cudnn-bf16,cudnn-fp8' --name bench-varlen \
                --out "$OUT/r/bench_varlen" ;;  # the uneven prefill batch: FP8 varlen now on the Hopper kernel
      trace) step trace 420 120 python3 scripts/hopper_trace.py --out "$OUT/r/trace" ;;  # cycles per phase of the key loop
      py:*) f=${s#py:}; step "$(basename "$f" .py)" 150 30 python3 "$f" ;;  # a one-off script
      models) step models 420 24 python3 -m leanfa.cli bench --no-progress --sweep models,varlen --out "$OUT/r/models" ;;
      bench_fa3) step bench_fa3 560 80 python3 -m leanfa.cli bench --quick --no-progress --sweep standard \
                --dims d128,mla --seqlens 1k,4k,16k,32k --impl "$FA3_IMPLS" --name bench-fa3 \
                --out "$OUT/r/bench_fa3" ;;  # leanfa kernels vs cuDNN and FA3 (FP8, BF16), causal and not
      bench_fa3_causal) step bench_fa3_causal 400 50 python3 -m leanfa.cli bench --quick --no-progress \
                --sweep standard --dims d128,mla --seqlens 1k,4k,16k,32k --causal true --impl "$FA3_IMPLS" \
                --name bench-fa3-causal --out "$OUT/r/bench_fa3_causal" ;;  # the same, causal only (half the rows)
      bench_fa3_models) step bench_fa3_models 400 50 python3 -m leanfa.cli bench --quick --no-progress \
                --sweep models,varlen --models llama3-8b,llama3.1-70b,deepseek-v3-mla --seqlens 4k,16k \
                --impl "$FA3_IMPLS" --name bench-fa3-models --out "$OUT/r/bench_fa3_models" ;;  # GQA 32/8, 64/8, MLA
      accuracy_fa3) step accuracy_fa3 200 40 python3 -m leanfa.cli accuracy --no-plots \
                --impl 'leanfa-hopper-fp8,leanfa-hopper-bf16,cudnn-fp8,cudnn-bf16,fa3-fp8,fa3-bf16' \
                --out "$OUT/r/accuracy_fa3" ;;  # FA3's error vs float64 beside cuDNN and leanfa
      model_accuracy) step model_accuracy 300 30 python3 -m leanfa.cli accuracy --model --seqlens 8k,32k \
                --out "$OUT/r/model_accuracy" ;;  # a random 4-layer Llama-3-8B-shaped model: time, attention share, logits error
      stalls_fa3) step stalls_fa3 300 150 python3 scripts/ncu_stalls.py \
                --impl leanfa-hopper-fp8-kernel,cudnn-fp8,fa3-fp8 --out "$OUT/r/stalls_fa3" ;;  # ncu: all three FP8
    esac
  done
}

args="${*:-checks}"
IFS='|' read -r -a lanes <<< "${args//::/|}"
if [ "${#lanes[@]}" -eq 1 ]; then
  run_steps ${lanes[0]}
else
  ngpu=$(nvidia-smi -L | wc -l)
  ncpu=$(nproc)
  for i in "${!lanes[@]}"; do
    cores=$([ "$i" -eq 0 ] && echo "0-3" || echo "4-$((ncpu - 1))")
    (taskset -cp "$cores" $BASHPID > /dev/null; export CUDA_VISIBLE_DEVICES=$((i % ngpu)); run_steps ${lanes[$i]} > "$OUT/r/lane$i.txt" 2>&1) &
  done
  wait
  for i in "${!lanes[@]}"; do echo "######## lane $i: ${lanes[$i]}"; cat "$OUT/r/lane$i.txt"; done
fi
tar czf "$OUT/session.tgz" -C "$OUT/r" . 2>/dev/null
