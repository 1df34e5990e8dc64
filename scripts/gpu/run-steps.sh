#!/usr/bin/env bash
# Runs on the GPU machine (carried in .gpu-build/): on-device.sh one step at a time, each in a
# process group of its own under a time limit, so a step that overruns (an 8B dummy model takes
# ~2 minutes to load) is cut off without eating the next steps' share of a short lease, and
# whatever it leaves running is killed before the next starts. Each step's output goes to
# $OUT/STEP.log (the serve step's worker logs to $OUT/serve-logs.tgz, the profile step's ncu
# launch list to $OUT/profile.csv.gz), the GPU memory still in
# use after each to $OUT/summary.txt; the last lines of each log are printed as it ends.
# PLAN="STEP:SECONDS ..." picks the steps and their limits; PREFILL_PROMPTS, DECODE_PROMPTS,
# GATE_PROMPTS and REQUESTS size the serve and seed000 steps.
# SMOKE=1 (scripts/smoke, no GPU): PLAN defaults to "serve:120 seed000:60", run the CPU way
# (see on-device.sh) at small sizes, and nothing is killed by name afterwards: on a shared
# machine that would hit other people's processes (each step stops its own deployment, and
# the time limit's signal reaches the launcher, which stops its workers).
# Last, scripts/gpu/summary.py prints one JSON line of the goal ratios from the steps' logs.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:?OUT names the folder that comes back}"
smoke() { [ -n "${SMOKE:-}" ] && [ "${SMOKE}" != 0 ]; }
if smoke; then
  export PREFILL_PROMPTS="${PREFILL_PROMPTS:-4}" DECODE_PROMPTS="${DECODE_PROMPTS:-4}"
  export GATE_PROMPTS="${GATE_PROMPTS:-2}" REQUESTS="${REQUESTS:-2}"
  plan="${PLAN:-serve:120 seed000:60}"
else
  export PREFILL_PROMPTS="${PREFILL_PROMPTS:-64}" DECODE_PROMPTS="${DECODE_PROMPTS:-128}"
  export GATE_PROMPTS="${GATE_PROMPTS:-8}" REQUESTS="${REQUESTS:-32}"
  plan="${PLAN:-check:50 ipc:30 nccl:30 bench:80 torch:80 serve:240 seed000:240}"
fi
scratch=$(mktemp -d)
for spec in $plan; do
  step=${spec%%:*}
  limit=${spec##*:}
  start=$(date +%s)
  echo "### $step (limit ${limit}s)" >>"$out/summary.txt"
  # timeout leads a process group of its own and signals all of it (rc 124 when cut off).
  LOG_DIR="$scratch/tandem-logs" OUT="$scratch" STEPS="$step" \
    timeout -k 5 "$limit" bash "$here/on-device.sh" >"$out/$step.log" 2>&1
  rc=$?
  # `tandem up` puts its children in process groups of their own: end them by name.
  if ! smoke; then
    for name in tandem tandem-prefill tandem-decode tandem-router tandem-bench \
      gpu_check gpu_bench gpu_ipc_check gpu_nccl_check; do
      pkill -KILL -x "$name"
    done
    sleep 2
  fi
  if [ -d "$scratch/tandem-logs" ]; then
    tar -czf "$out/serve-logs.tgz" -C "$scratch" tandem-logs
  fi
  if [ -f "$scratch/profile.csv" ]; then gzip -c "$scratch/profile.csv" >"$out/profile.csv.gz"; fi
  {
    echo "### $step rc=$rc in $(($(date +%s) - start)) s; GPU memory in use after it:"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  } >>"$out/summary.txt"
  echo "### $step rc=$rc in $(($(date +%s) - start)) s"
  grep -vE '^\s*$' "$out/$step.log" | tail -n 40
done
rm -rf "$scratch"
# The run's verdict: one JSON line of ratios from the steps' logs (BENCHMARKS.md quotes it;
# in smoke mode, where no step measures, all nulls).
echo "### summary"
python3 "$here/summary.py" "$out" | tee "$out/summary.json"
