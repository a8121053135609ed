#!/usr/bin/env bash
# The one-command GPU check, run ON the offline GPU host from the checkout root (device tool):
#   1. unpack ../shared/devkit's bundle (.devkit/: sglang 0.5.17, sgl-kernel, flashinfer, deps) to /tmp/site
#   2. install this package there (entry point visible to SGLang), generate the two standard models
#   3. pytest -m gpu
#   4. launch the real server with and without the plugin on dsv3-4l (plugin_parity.py): greedy ids,
#      plugin log lines, applied hooks, bench_serving throughput; JSON to $OUT
#   (STEPS kernels) benchmark/kernels/bench_*.py ${KERNEL_ARGS:---quick} -> $OUT/bench_<name>.json (+ PNG)
#   (STEPS calibrate) python -m sglang_h20 calibrate mha-mla on this GPU -> $OUT/mha_mla_<gpu>.json
#   (STEPS ttft) benchmark/serving/prefix_ttft.py: TTFT with prefix hits, our MHA/MLA policy vs upstream
#   (STEPS profile) benchmark/serving/prefill_profile.py: torch-profiler totals of the same prefills, MHA vs MLA
#   (STEPS mlacuda) the CUDA MLA decode kernels: v2 smoke in its own process, tests of v1 and v2, bench_mla_decode
#     (MLA_ARGS, default --quick) with ours-cuda, ours-cuda-v2 and FlashMLA -> $OUT/bench_mla_cuda.json
#   (STEPS wsprobe) benchmark/kernels/probe_ws_walk.py ${WSPROBE_ARGS}: config ws case by case, each in its own
#     process under a timeout (stage reached, error, µs against the plain and TMA walks) -> $OUT/probe_ws_walk.json
#   (STEPS ncu) benchmark/kernels/profile_mla_decode.py ${NCU_ARGS}: Nsight Compute counters of one decode step
#   (STEPS ggprof) benchmark/kernels/profile_grouped_gemm.py: counters of the MoE grouped GEMMs at one point, once per
#     ";"-separated argument list in GGPROF_ARGS -> $OUT/profile_grouped_gemm_<i>.json (+ .log; reports not kept)
#   (STEPS mlaablate) benchmark/kernels/mla_cuda_ablation.py ${ABLATE_ARGS}: the CUDA MLA kernels' ablation builds
#     (-DMLA_ABLATE_*) timed against the default, where the time goes -> $OUT/mla_ablation.json (+ .log)
#   (STEPS ggablate) benchmark/kernels/grouped_gemm_cuda_ablation.py ${GGABLATE_ARGS}: the CUDA grouped GEMM's
#     ablation builds (no loads after the first ring, no wgmma) against its normal build and DeepGEMM masked
#   (STEPS mlatrace) benchmark/kernels/trace_mla_decode.py ${TRACE_ARGS}: per-warp timeline of one CTA of the v2
#     kernel (-DMLA_TRACE clock64 stamps) -> $OUT/mla_trace.json + .png (+ .log)
#   (STEPS layer) benchmark/attention/mha_mla_layer.py; (swapab) swapab_e2e.py; (fp8mla) fp8_mla_e2e.py;
#   (parity_ep) plugin_parity.py with --tp/--ep-size/--dp = all visible GPUs, DP attention (multi-GPU kinds),
#     phases PHASES (default: upstream features; 'policy' and 'observe' run each of the two features alone)
#   (affinity) affinity_remote_share.py: tokens leaving their GPU, upstream EPLB vs affinity, and each rebalance's
#     stall; AFFINITY_ARGS="--arms none deepseek deepseek+async deepseek+async-thread --fraction 0 --hang-s 60":
#     upstream's blocking stall vs our migration, transfers posted by the decode loop or by a thread (multi-GPU);
#     arm deepseek+async-shuffle makes every rebalance a full re-placement (use --rebalance-iterations >= 600: the
#     passes are counted from the previous move's end, so the 512-pass steady window then holds none of that move);
#     a server whose log stays silent --hang-s seconds during a bench leaves every thread's stack
#     -> $OUT/affinity_stacks_<arm>.txt;
#     each arm's server log lines (EPLB, errors) -> $OUT/affinity_server_<arm>.txt; starts only with more than
#     AFFINITY_MIN_S (default 150) seconds left; AFFINITY_MODEL (default dsv3-4l) names the model under /tmp/models
#   (migration) benchmark/eplb/migration_step_time.py: decode step time during an expert re-placement
#   ${MIGRATION_ARGS}, e.g. MIGRATION_ARGS="--world 2": experts move between 2 GPUs (NCCL, one process per
#   GPU; needs them visible: a multi-GPU kind running gpu_check.sh itself, not a gpu_parallel.sh job)
#   (fp8smoke) scripts/fp8_mla_smoke.py: the h20_fp8_mla backend serves greedy requests on SMOKE_MODEL (default
#     dsv3-4l; e.g. SMOKE_MODEL=dsv3-tp8-4l MAKE_MODELS=dsv3-tp8-4l: 16 heads, kernel version 3)
#   (sbo) the SBO GPU tests (SBO_K: a pytest -k filter; all of them take ~5 min; SBO_TESTS=0: none),
#     bench_sbo.py --layer-only --shared on dsv3-ep16-slice's 16 experts (SBO_BATCHES, default 8 16 32; our shared
#     expert also capped at SBO_SHARED_SMS, e.g. "16 32 132", default none) -> $OUT/sbo_layer_shared.json (+ .png),
#     then swapab_e2e.py --arms SBO_ARMS (default off sbo; "off sbo off sbo" repeats the pair; sbo+on+cap caps at
#     SBO_E2E_SHARED_SMS, default swapab_e2e's 32) at SBO_CONC (default 16 32) -> $OUT/sbo_e2e.json (the e2e starts
#     only with more than 300 s left)
#   (decodeprof) benchmark/serving/decode_profile.py: torch-profiler kernels of steady decode steps per arm: an
#     attention backend, optionally with plugin features on (DECODEPROF_MODEL, default dsv3-ep16-slice;
#     DECODEPROF_ARGS, e.g. "--arms ours flashmla-fp8 --batch 32" or "--arms ours ours+swapab --batch 4")
#     -> $OUT/decode_profile.json (the traces stay on the host)
#   (observe) benchmark/serving/observe_overhead.py: one server, observation flipped on/off in windows
#   (overhead ratio + CI, stage sum vs step time, /metrics series) -> $OUT/observe_overhead.json
#   5. JIT caches back to $OUT/jitcache.tar.xz (carry it next time as .devkit/jitcache.tar.xz); when $OUT holds
#      more than the 8 files the device tool brings back, every file but check.log, the JIT cache and the JSON
#      records goes into $OUT/logs.tar.xz
# Knobs (env): NO_SETUP=1 NO_JITPACK=1 (gpu_parallel.sh) STEPS="tests parity" LAYER_S=240 PHASES="upstream plugin-off"
#   PARITY_ARGS="--observe-fraction 0.5 --repeats 1" DEADLINE_S=540 GIT_COMMIT=...
#   TESTS="test/gpu/test_x.py" (default: test) TESTS_K="not equals_plain" (a pytest -k expression; TESTS is split
#   on spaces, this is not) BENCHES="mla_decode grouped_gemm" (default: all of benchmark/kernels)
#   MIGRATION_ARGS="--world 2 --presets ep16-slice" (extra args of migration_step_time.py)
#   LAYER_ARGS="--kv-b-proj fp8" (extra args of mha_mla_layer.py)
#   EP_ARGS="--attention-backend flashmla --enable-dp-lm-head" (server flags parity_ep adds last, so they win)
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu_check_out}; mkdir -p "$OUT"
DK=${DK:-.devkit}
STEPS=${STEPS-"tests parity"}
DEADLINE_S=${DEADLINE_S:-540}
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
# an earlier call's records in OUT (a warm host keeps /tmp) would be taken for this call's: the record copy below
# keeps a JSON already there, and the bundle would swallow the old logs.tar.xz (session 72 lost a record so)
stale=$(cd "$OUT" && ls -d ./*.json ./*.tar.xz ./*/ 2>/dev/null | tr '\n' ' ')
if [ -n "$stale" ]; then
  echo "gpu_check: OUT=$OUT already holds an earlier call's results (${stale% }); give an empty folder" >&2
  exit 2
fi

export MPLBACKEND=Agg PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export SGLANG_H20_EXPECT_GPU=1  # test/conftest.py: a GPU the guard cannot see stops pytest (not 157 skips)
export SGLANG_ENABLE_JIT_DEEPGEMM=${SGLANG_ENABLE_JIT_DEEPGEMM:-0} SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
export SGL_KERNEL_FLASHINFER=${SGL_KERNEL_FLASHINFER:-0} SGLANG_OPT_USE_JIT_KERNEL_GROUPED_TOPK=1
export TRITON_CACHE_DIR=/tmp/jit/triton TVM_FFI_CACHE_DIR=/tmp/jit/tvm-ffi DG_JIT_CACHE_DIR=/tmp/jit/deep_gemm
export FLASHINFER_WORKSPACE_BASE=/tmp/jit/flashinfer
# SGLang's triton MoE path and top-k run torch.compile'd helpers: Inductor's caches (FX graphs, its Triton kernels)
# beside the others, so they are packed too (each call's first server start took 137-209 s, the second 75 s)
export TORCHINDUCTOR_CACHE_DIR=/tmp/jit/inductor
# Measured since (2026-12-01): with Inductor's cache carried the first start still took 187 s (175 s without it), so
# that was not it, nor the CUDA driver's PTX cache (kept here all the same; it stayed empty). Found 2026-12-02: ninja
# rebuilt FlashInfer's prefill module in every call (restored objects ~100 ns newer than its deps log); with mtimes
# packed rounded down (pack_jitcache.py) the first server starts in 63-65 s, the second in 57-73 s
export CUDA_CACHE_PATH=/tmp/jit/cuda-compute CUDA_CACHE_MAXSIZE=1073741824
mkdir -p /tmp/jit /tmp/site /tmp/dg

if [ -z "${NO_SETUP:-}" ]; then  # scripts/gpu_parallel.sh sets up once, then runs one job per GPU
  say "host: $(nproc) cores, $(python3 -V 2>&1), $(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader 2>&1)"
  tar -xJf "$DK/site.tar.xz" -C /tmp/site || { say "FAIL: unpack $DK/site.tar.xz (build it with ../shared/devkit/build_devkit.sh)"; exit 2; }
  [ -f "$DK/deepgemm.tar.xz" ] && tar -xJf "$DK/deepgemm.tar.xz" -C /tmp/dg
  [ -f "$DK/jitcache.tar.xz" ] && tar -xJf "$DK/jitcache.tar.xz" -C /tmp/jit && say "restored JIT cache"
  export PYTHONPATH=/tmp/site:/tmp/dg
  python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /tmp/site . > "$OUT/install.log" 2>&1 \
    || { say "FAIL: install sglang-h20"; cat "$OUT/install.log"; exit 2; }
  python3 scripts/make_model.py /tmp/models --models dsv3-4l dsv3-ep16-slice ${MAKE_MODELS:-} > /dev/null \
    || { say "FAIL: make_model"; exit 2; }
  # the bundle ships no bytecode (build_devkit.sh strips __pycache__): compile it once on all cores here, so no
  # server process compiles sglang/transformers on its first import (a suspect for the slow first start; timed)
  tc=$(date +%s); python3 -m compileall -q -j 0 /tmp/site > /dev/null 2>&1
  say "byte-compiled /tmp/site in $(( $(date +%s) - tc ))s"
  say "unpacked + installed; doctor:"
  (cd /tmp && python3 -m sglang_h20 doctor 2>&1 | grep -v Warning | tee "$OUT/doctor.txt")

else
  export PYTHONPATH=/tmp/site:/tmp/dg
  say "GPU ${CUDA_VISIBLE_DEVICES:-all}: $(nvidia-smi --query-gpu=name --format=csv,noheader -i ${CUDA_VISIBLE_DEVICES:-0} 2>&1)"
fi
# the dummy DeepSeek-V3 servers' flags every server step shares (each adds its attention backend)
SERVER_ARGS="--load-format dummy --sampling-backend pytorch --moe-runner-backend triton --fp8-gemm-backend triton --grammar-backend none --mem-fraction-static 0.6 --cuda-graph-max-bs 64"
rc=0
touch /tmp/steps_began  # what the steps write outside /tmp/jit is listed at the end (caches a call does not carry)
if [[ " $STEPS " == *" tests "* ]]; then
  say "pytest -m gpu"
  # the log says what ran, where and when (it is kept as a result: benchmark/results/*/gpu_tests_*.log)
  { echo "# command: python3 -m pytest -m gpu ${TESTS:-test}${TESTS_K:+ -k \"$TESTS_K\"} -q -p no:cacheprovider -s"
    echo "# git commit: ${GIT_COMMIT:-unknown}; GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1 | head -1);" \
      "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; } > "$OUT/pytest_gpu.log"
  # under a timeout: a kernel that never completes (config ws's first run, 2026-12-02) must not take the call
  timeout -k 10 "${TESTS_TIMEOUT_S:-$(( $(left) - 60 ))}" \
    python3 -m pytest -m gpu ${TESTS:-test} ${TESTS_K:+-k "$TESTS_K"} -q -p no:cacheprovider -s 2>&1 \
    | tee -a "$OUT/pytest_gpu.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" mlacuda "* ]]; then  # the CUDA MLA kernels: v2 smoke alone first (a device trap poisons the
  t=test/gpu/test_mla_decode_cuda_gpu.py  # process's CUDA context), then both versions' tests, then the bench
  say "CUDA MLA decode: v2 smoke, tests (v1, v2), bench vs FlashMLA"
  { python3 -m pytest -m gpu "$t" -q -p no:cacheprovider -k "v2 and (single_lengths or emulation)" 2>&1 | tail -5
    python3 -m pytest -m gpu "$t" -q -p no:cacheprovider 2>&1 | tail -8; } | tee "$OUT/pytest_mla_cuda.log"
  python3 benchmark/kernels/bench_mla_decode.py ${MLA_ARGS:---quick} --providers ours-cuda flashmla-bf16 flashmla-fp8 \
    ours-cuda-v2 --json "$OUT/bench_mla_cuda.json" 2>&1 | tee "$OUT/bench_mla_cuda.log" | grep -v Warn | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" ncu "* ]] && [ "$(left)" -gt 90 ]; then  # counters of one decode step, ours vs FlashMLA
  say "ncu on the MLA decode kernels ${NCU_ARGS:-}"
  timeout -k 10 $(( $(left) - 20 )) python3 benchmark/kernels/profile_mla_decode.py --out "$OUT/ncu" \
    --timeout-s $(( $(left) - 40 )) ${NCU_ARGS:-} 2>&1 | tee "$OUT/profile_mla_decode.log" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" ggprof "* ]]; then  # counters of the grouped GEMMs, ours vs upstream, one point per list
  i=0
  IFS=';' read -ra GGPROF_RUNS <<< "${GGPROF_ARGS:-}"
  for gargs in "${GGPROF_RUNS[@]:-}"; do
    [ "$(left)" -gt 90 ] || { say "ggprof: no time left for run $i ($gargs)"; break; }
    say "ncu on the grouped GEMMs ($gargs)"
    timeout -k 10 $(( $(left) - 20 )) python3 benchmark/kernels/profile_grouped_gemm.py --out "$OUT/ggprof$i" \
      --timeout-s $(( $(left) - 40 )) $gargs 2>&1 | tee "$OUT/profile_grouped_gemm_$i.log" | tail -80
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    cp "$OUT/ggprof$i/profile_grouped_gemm.json" "$OUT/profile_grouped_gemm_$i.json" 2>/dev/null
    cp "$OUT/ggprof$i/source_sass.csv.xz" "$OUT/profile_grouped_gemm_${i}_source_sass.csv.xz" 2>/dev/null
    rm -rf "$OUT/ggprof$i"
    i=$(( i + 1 ))
  done
fi
if [[ " $STEPS " == *" mlaablate "* ]] && [ "$(left)" -gt 120 ]; then  # children time the variants: a fault costs one
  say "CUDA MLA decode ablations ${ABLATE_ARGS:-}"
  timeout $(( $(left) - 20 )) python3 benchmark/kernels/mla_cuda_ablation.py --deadline-s $(( $(left) - 60 )) \
    ${ABLATE_ARGS:-} --json "$OUT/mla_ablation.json" 2>&1 | tee "$OUT/mla_ablation.log" | grep -v Warn | tail -90
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" ggablate "* ]] && [ "$(left)" -gt 90 ]; then  # which side sets the CUDA grouped GEMM's time
  say "CUDA grouped GEMM ablations ${GGABLATE_ARGS:-}"
  timeout $(( $(left) - 20 )) python3 benchmark/kernels/grouped_gemm_cuda_ablation.py ${GGABLATE_ARGS:-} \
    --json "$OUT/grouped_gemm_cuda_ablation.json" 2>&1 | tee "$OUT/grouped_gemm_cuda_ablation.log" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" mlatrace "* ]] && [ "$(left)" -gt 60 ]; then  # which wait serializes v2's parts
  say "CUDA MLA decode v2 timeline ${TRACE_ARGS:-}"
  timeout $(( $(left) - 20 )) python3 benchmark/kernels/trace_mla_decode.py ${TRACE_ARGS:-} --json "$OUT/mla_trace.json" \
    2>&1 | tee "$OUT/mla_trace.log" | grep -v Warn | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" kernels "* ]]; then
  benches=benchmark/kernels/bench_*.py
  [ -n "${BENCHES:-}" ] && benches=$(printf "benchmark/kernels/bench_%s.py " $BENCHES)
  for b in $benches; do
    name=$(basename "$b" .py)
    # a --tune writes its table to this user's cache, which the plugin reads before the shipped one: later steps of
    # this call would serve the tune's entries, not the checkout's table (session 41's e2e did), so it goes to $OUT
    table_out=()
    [[ $name == bench_grouped_gemm && " ${KERNEL_ARGS:-} " == *" --tune "* && " ${KERNEL_ARGS:-} " != *" --table-out "* ]] \
      && table_out=(--table-out "$OUT/grouped_gemm_tuned_table.json")
    say "$name ${KERNEL_ARGS:---quick} ${table_out[*]}"
    timeout $(( $(left) - 30 )) python3 "$b" ${KERNEL_ARGS:---quick} "${table_out[@]}" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  done
fi
if [[ " $STEPS " == *" wsprobe "* ]]; then  # config ws, each case in its own process under a timeout
  say "probe_ws_walk ${WSPROBE_ARGS:-}"
  python3 benchmark/kernels/probe_ws_walk.py --json "$OUT/probe_ws_walk.json" --deadline-s $(( $(left) - 30 )) \
    ${WSPROBE_ARGS:-} 2>&1 | tee "$OUT/probe_ws_walk.log" | tail -12
fi
if [[ " $STEPS " == *" parity "* ]]; then
  say "plugin parity (phases must fit in $(( $(left) - 60 ))s; the JSON is written after each)"
  timeout -k 25 $(( $(left) - 45 )) python3 benchmark/serving/plugin_parity.py --model /tmp/models/dsv3-4l \
    --out "$OUT/parity" --phases ${PHASES:-upstream plugin-off} --deadline-s $(( $(left) - 60 )) ${PARITY_ARGS:-} \
    --server-args "$SERVER_ARGS --attention-backend triton --log-level info" \
    2>&1 | tee "$OUT/parity.log" | grep -v "^\[.*bench:" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  cp "$OUT/parity/plugin_parity.json" "$OUT/" 2>/dev/null
  (cd "$OUT/parity" && tar -cJf "$OUT/parity_logs.tar.xz" --exclude sharegpt.json . 2>/dev/null)
  rm -rf "$OUT/parity"
fi
if [[ " $STEPS " == *" layer "* ]] && [ "$(left)" -gt 90 ]; then
  lay=${LAYER_S:-$(( $(left) - 60 ))}
  say "MHA/MLA layer-level bench (deadline ${lay}s)"
  python3 benchmark/attention/mha_mla_layer.py --json "$OUT/mha_mla_layer.json" --write-table "$OUT/mha_mla_table_layer.json" \
    --deadline-s $lay ${LAYER_ARGS:-} 2>&1 | tee "$OUT/mha_mla_layer.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  # the servers started after this (ttft) use the table just measured
  [ -f "$OUT/mha_mla_table_layer.json" ] && cp "$OUT/mha_mla_table_layer.json" \
    "$(python3 -c 'from sglang_h20 import compat; from sglang_h20.attention.mha_mla import table_path; print(table_path(compat.gpu().name))' 2>/dev/null)"
fi
if [[ " $STEPS " == *" parity_ep "* ]]; then  # the multi-GPU issue: EP = DP attention = every GPU visible
  # an EP-2 server with flashmla took ~165 s to start and a phase ~275 s with 2 bench repeats: two phases fit one
  # call only with PARITY_ARGS="--repeats 1" and DEADLINE_S near 590
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  say "plugin parity with EP=$n, DP attention (phases must fit in $(( $(left) - 60 ))s; the JSON is written after each)"
  NCCL_NVLS_ENABLE=0 timeout -k 25 $(( $(left) - 45 )) python3 benchmark/serving/plugin_parity.py \
    --model /tmp/models/dsv3-4l --out "$OUT/parity_ep" \
    --phases ${PHASES:-upstream features} --deadline-s $(( $(left) - 60 )) ${PARITY_ARGS:-} \
    --server-args "$SERVER_ARGS --attention-backend triton --log-level info \
--tp $n --ep-size $n --enable-dp-attention --dp $n ${EP_ARGS:-}" 2>&1 | tee "$OUT/parity_ep.log" | grep -v "^\[.*bench:" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  cp "$OUT/parity_ep/plugin_parity.json" "$OUT/plugin_parity_ep.json" 2>/dev/null
  (cd "$OUT/parity_ep" && tar -cJf "$OUT/parity_ep_logs.tar.xz" --exclude sharegpt.json . 2>/dev/null)
  rm -rf "$OUT/parity_ep"
fi
# multi-GPU: tokens leaving their GPU and decode passes during a move, upstream EPLB vs ours; one arm takes ~150 s on a
# set-up machine (server ~90 s, 1024 prompts), two ~300 s: AFFINITY_MIN_S is the time it needs left to start
if [[ " $STEPS " == *" affinity "* ]] && [ "$(left)" -gt "${AFFINITY_MIN_S:-150}" ]; then
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  say "expert-affinity placement in the server, EP=$n"
  rm -rf /tmp/affinity  # a warm machine keeps the last call's: its JSON must not pass for this one's
  NCCL_NVLS_ENABLE=0 timeout $(( $(left) - 20 )) python3 benchmark/serving/affinity_remote_share.py --model "/tmp/models/${AFFINITY_MODEL:-dsv3-4l}" \
    --out /tmp/affinity --gpus "$n" ${AFFINITY_ARGS:-} --server-args "$SERVER_ARGS --attention-backend triton" 2>&1 | tee "$OUT/affinity.log" | grep -v "bench:" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  cp /tmp/affinity/affinity_remote_share.json /tmp/affinity/affinity_remote_share.png "$OUT/" 2>/dev/null
  for log in /tmp/affinity/*/server.log; do  # each arm's server log, its errors and EPLB lines (not the request spam)
    [ -f "$log" ] || continue
    arm=$(basename "$(dirname "$log")" | tr '+' '_')
    grep -E "EPLB|eplb|rebalance|sglang-h20|Error|error|Traceback" "$log" | tail -300 > "$OUT/affinity_server_$arm.txt"
    # a hung or crashed arm's thread stacks (faulthandler), as affinity_remote_share.py cut them from its log
    cp "$(dirname "$log")/stacks.txt" "$OUT/affinity_stacks_$arm.txt" 2>/dev/null
  done
fi
if [[ " $STEPS " == *" calibrate "* ]]; then
  say "calibrate mha-mla"
  python3 -m sglang_h20 calibrate mha-mla --grid ${GRID:-quick} --work-dir /tmp/calib --out "$OUT/mha_mla_table.json" 2>&1 \
    | tee "$OUT/calibrate.log" | grep -v "bench:" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || { rc=1; tail -40 /tmp/calib/server-*.log; }
  # the servers started after this use the table just measured
  [ -f "$OUT/mha_mla_table.json" ] && cp "$OUT/mha_mla_table.json" \
    "$(python3 -c 'from sglang_h20 import compat; from sglang_h20.attention.mha_mla import table_path; print(table_path(compat.gpu().name))' 2>/dev/null)"
fi
if [[ " $STEPS " == *" ttft "* ]] && [ "$(left)" -gt 200 ]; then
  say "prefix TTFT (deadline for new phases: $(( $(left) - 130 ))s from now)"
  python3 benchmark/serving/prefix_ttft.py --model /tmp/models/dsv3-4l --out /tmp/ttft --deadline-s $(( $(left) - 130 )) ${TTFT_ARGS:-} \
    --server-args "$SERVER_ARGS --attention-backend flashmla" 2>&1 | tee "$OUT/ttft.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || { rc=1; tail -30 /tmp/ttft/server-*.log; }
  cp /tmp/ttft/prefix_ttft.json "$OUT/" 2>/dev/null
fi
if [[ " $STEPS " == *" profile "* ]] && [ "$(left)" -gt 150 ]; then  # what MHA's extra per-prefill cost is made of
  say "prefill profile, MHA vs MLA on dsv3-4l"
  timeout $(( $(left) - 20 )) python3 benchmark/serving/prefill_profile.py --model /tmp/models/dsv3-4l --out /tmp/profile ${PROFILE_ARGS:-} \
    --server-args "$SERVER_ARGS --attention-backend flashmla" 2>&1 | tee "$OUT/prefill_profile.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || { rc=1; tail -30 /tmp/profile/server.log; }
  cp /tmp/profile/prefill_profile.json "$OUT/" 2>/dev/null
fi
if [[ " $STEPS " == *" swapab "* ]] && [ "$(left)" -gt 120 ]; then
  say "swapAB e2e on dsv3-ep16-slice (arms ${SWAPAB_ARMS:-off forced})"
  python3 benchmark/serving/swapab_e2e.py --model /tmp/models/dsv3-ep16-slice --out "$OUT/swapab_e2e" \
    --deadline-s $(( $(left) - 40 )) --arms ${SWAPAB_ARMS:-off forced} ${SWAPAB_ARGS:-} 2>&1 | tee "$OUT/swapab_e2e.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" sbo "* ]]; then  # single-batch overlap: tests, the layer beside the shared expert, e2e
  if [ "${SBO_TESTS:-1}" != 0 ]; then
    say "SBO GPU tests"
    python3 -m pytest -m gpu test/gpu/test_sbo_gpu.py -q -p no:cacheprovider ${SBO_K:+-k "$SBO_K"} 2>&1 \
      | tee "$OUT/sbo_gpu_tests.log" | tail -3
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
  say "bench_sbo --layer-only --shared (batches ${SBO_BATCHES:-8 16 32}${SBO_SHARED_SMS:+, our shared expert also as $SBO_SHARED_SMS slim programs})"
  python3 benchmark/kernels/bench_sbo.py --layer-only --shared --experts 16 --batches ${SBO_BATCHES:-8 16 32} \
    ${SBO_SHARED_SMS:+--shared-sms $SBO_SHARED_SMS} \
    --model /tmp/models/dsv3-ep16-slice --json "$OUT/sbo_layer_shared.json" > "$OUT/sbo_layer_shared.log" 2>&1 \
    || { rc=1; tail -20 "$OUT/sbo_layer_shared.log"; }
  grep "share of (combine" "$OUT/sbo_layer_shared.log"
  if [ "$(left)" -gt 300 ]; then
    python3 benchmark/serving/swapab_e2e.py --model /tmp/models/dsv3-ep16-slice --out /tmp/sbo_e2e \
      --deadline-s $(( $(left) - 40 )) --arms ${SBO_ARMS:-off sbo} --concurrency ${SBO_CONC:-16 32} --waves 3 --no-layer \
      ${SBO_E2E_SHARED_SMS:+--shared-sms $SBO_E2E_SHARED_SMS} \
      2>&1 | tee "$OUT/sbo_e2e.log" | grep -E "tok/s|ratio"
    cp /tmp/sbo_e2e/swapab_e2e.json "$OUT/sbo_e2e.json" 2>/dev/null || rc=1
  fi
fi
if [[ " $STEPS " == *" fp8smoke "* ]] && [ "$(left)" -gt 120 ]; then
  say "h20_fp8_mla smoke on ${SMOKE_MODEL:-dsv3-4l}"
  timeout $(( $(left) - 20 )) python3 scripts/fp8_mla_smoke.py /tmp/models/${SMOKE_MODEL:-dsv3-4l} "$OUT/fp8_smoke" 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || { rc=1; grep -A20 Traceback "$OUT/fp8_smoke/server.log" | tail -25; }
fi
if [[ " $STEPS " == *" fp8mla "* ]] && [ "$(left)" -gt 120 ]; then
  say "FP8 MLA backend e2e on dsv3-ep16-slice"
  python3 benchmark/serving/fp8_mla_e2e.py --model /tmp/models/dsv3-ep16-slice --out "$OUT/fp8_mla_e2e" \
    --deadline-s $(( $(left) - 40 )) ${FP8MLA_ARGS:-} 2>&1 | tee "$OUT/fp8_mla_e2e.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [[ " $STEPS " == *" observe "* ]] && [ "$(left)" -gt 150 ]; then
  say "observe overhead on dsv3-ep16-slice (one server, on/off windows; deadline $(( $(left) - 40 ))s)"
  python3 benchmark/serving/observe_overhead.py --model /tmp/models/dsv3-ep16-slice --out /tmp/observe \
    --deadline-s $(( $(left) - 40 )) ${OBSERVE_ARGS:-} 2>&1 | tee "$OUT/observe_overhead.log" | grep -v "bench:" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || { rc=1; tail -30 /tmp/observe/server.log; }
  cp /tmp/observe/observe_overhead.json "$OUT/" 2>/dev/null
  (cd /tmp/observe && tar -cJf "$OUT/observe_logs.tar.xz" server.log dump control ./*.log 2>/dev/null)
fi
if [[ " $STEPS " == *" decodeprof "* ]] && [ "$(left)" -gt 150 ]; then  # traces stay here: only the summary returns
  say "decode-step profile per arm on ${DECODEPROF_MODEL:-dsv3-ep16-slice} ${DECODEPROF_ARGS:-}"
  timeout $(( $(left) - 20 )) python3 benchmark/serving/decode_profile.py --model /tmp/models/${DECODEPROF_MODEL:-dsv3-ep16-slice} \
    --out /tmp/decode_profile ${DECODEPROF_ARGS:-} 2>&1 | tee "$OUT/decode_profile.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  cp /tmp/decode_profile/decode_profile.json "$OUT/" 2>/dev/null
  (cd /tmp/decode_profile && tar -cJf "$OUT/decode_profile_logs.tar.xz" ./*/server.log 2>/dev/null)
fi
if [[ " $STEPS " == *" migration "* ]] && [ "$(left)" -gt 90 ]; then
  say "EPLB migration step time (deadline $(( $(left) - 40 ))s)"
  timeout -s KILL $(( $(left) - 10 )) python3 benchmark/eplb/migration_step_time.py --json "$OUT/migration_step_time.json" \
    --deadline-s $(( $(left) - 40 )) ${MIGRATION_ARGS:-} 2>&1 | tee "$OUT/migration_step_time.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
by_folder() {  # "size dir" lines -> files and MB per folder of the first $1 path levels, largest first
  awk -v levels="$1" '{split($2, p, "/"); d = ""; for (i = 2; i <= levels + 1; i++) d = d "/" p[i]; n[d]++; b[d] += $1}
       END {for (d in n) printf "%8d files %10.1f MB  %s\n", n[d], b[d] / 1e6, d}' | sort -k3 -rn | head -25
}
# files the steps wrote outside the carried caches, by folder (a cache that is not carried shows here)
find / -xdev \( -path /proc -o -path /sys -o -path /dev -o -path "$OUT" -o -path /tmp/jit -o -path /tmp/models \) -prune \
  -o -type f -newer /tmp/steps_began -printf '%s %h\n' 2>/dev/null | by_folder 4 > "$OUT/new_files.txt"
# and inside them: what the restored caches lacked (2026-12-02: nothing was written outside /tmp/jit during a call
# whose first server took 179 s and its second 53 s, so the misses, if any, are here)
{ echo "# inside /tmp/jit (the carried caches' misses), by cache:"
  find /tmp/jit -type f -newer /tmp/steps_began -printf '%s %h\n' 2>/dev/null | by_folder 3
} >> "$OUT/new_files.txt"
say "files written since the steps began (top folders, outside and inside /tmp/jit): $(wc -l < "$OUT/new_files.txt") lines in new_files.txt"
[ -z "${NO_JITPACK:-}" ] && python3 scripts/pack_jitcache.py "$OUT/jitcache.tar.xz"
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then  # the device tool brings back 8 files, folders' files counted:
  for f in "$OUT"/*/*.json; do  # a step's record JSON comes back on its own, the rest of the logs in one archive
    [ -e "$f" ] && [ ! -e "$OUT/$(basename "$f")" ] && cp "$f" "$OUT/"
  done
  (cd "$OUT" && ls | grep -vE '^(check\.log|jitcache\.tar\.xz|logs\.tar\.xz|.*\.json)$' > /tmp/out_bundle.list \
    && tar -cJf logs.tar.xz -T /tmp/out_bundle.list && xargs rm -rf < /tmp/out_bundle.list \
    && say "bundled into logs.tar.xz: $(tr '\n' ' ' < /tmp/out_bundle.list)")
fi
say "done rc=$rc; OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
