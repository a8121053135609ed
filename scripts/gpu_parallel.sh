#!/usr/bin/env bash
# Several gpu_check.sh jobs at once, one per GPU of the host (device tool, a multi-GPU kind): the bundle
# is unpacked once, then job i runs on GPU i with its own OUT, port range and deadline. With fewer GPUs
# than jobs, the jobs run one after another on GPU 0. The device tool brings back only a few files,
# so each job's OUT comes back as one archive: $OUT/gpu<i>.tar.xz, its console log $OUT/gpu<i>.log.
#   JOB0='STEPS="tests migration" TESTS=test/gpu' JOB1='STEPS="layer ttft"' bash scripts/gpu_parallel.sh
# Each JOBi is a list of VAR=value words for gpu_check.sh (quoted as in the shell); DEADLINE_S applies to each.
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu_parallel_out}; mkdir -p "$OUT"
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

OUT=/tmp/out/setup STEPS="" NO_JITPACK=1 DEADLINE_S=60 bash scripts/gpu_check.sh || { cat /tmp/out/setup/install.log; exit 2; }
cp /tmp/out/setup/doctor.txt "$OUT/" 2>/dev/null
ngpu=$(nvidia-smi -L | grep -c '^GPU')
jobs=()
for i in 0 1 2 3 4 5 6 7; do v="JOB$i"; [ -n "${!v:-}" ] && jobs+=("$i"); done
say "$ngpu GPUs, jobs: ${jobs[*]}"

run_job() {  # $1 job index, $2 GPU
  local i=$1 g=$2 v="JOB$1"
  mkdir -p "/tmp/out/gpu$i"
  ( eval "export ${!v}"
    export CUDA_VISIBLE_DEVICES=$g NO_SETUP=1 NO_JITPACK=1 OUT=/tmp/out/gpu$i SGLANG_H20_PORT_OFFSET=$(( i * 1000 ))
    timeout -s KILL $(( ${DEADLINE_S:-540} + 25 )) bash scripts/gpu_check.sh ) > "$OUT/gpu$i.log" 2>&1
  local rc=$?
  tar -cJf "$OUT/gpu$i.tar.xz" -C "/tmp/out/gpu$i" . 2>/dev/null
  say "job $i (GPU $g) rc=$rc: $(tail -1 "$OUT/gpu$i.log")"
  return $rc
}

rc=0
if [ "${#jobs[@]}" -le "$ngpu" ]; then
  pids=()
  for n in "${!jobs[@]}"; do run_job "${jobs[$n]}" "$n" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
else  # fewer GPUs than jobs: one after another on GPU 0
  for i in "${jobs[@]}"; do run_job "$i" 0 || rc=1; done
fi
python3 scripts/pack_jitcache.py "$OUT/jitcache.tar.xz"
say "done rc=$rc; OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $rc
