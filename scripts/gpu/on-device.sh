#!/usr/bin/env bash
# Runs on the GPU machine (carried in .gpu-build/, from the repository root): points the
# dynamic loader at the CUDA 13 libraries of the machine's Python environment, then runs the
# correctness check, the cuda-ipc and nccl checks (two processes), tandem's GPU benchmark, the same
# shapes through PyTorch/transformers, and a 1P1D deployment on one GPU (green contexts,
# KV over cuda-ipc) under tandem-bench (seed 002's `# Prefill` and `# Decode` blocks), with
# its greedy outputs compared to aggregated ones; then seed 000's shape (scripts/gpu/seed000.sh).
# `torchs` runs the gpt-fast-style baselines (SDPA flash prefill, static-KV decode in CUDA
# graphs, torch.compile). `profile` (not in the default list) times every kernel of one prefill and two decode steps
# under ncu. STEPS picks a subset, e.g. STEPS="ipc serve"; PREFILL_PROMPTS, DECODE_PROMPTS and
# GATE_PROMPTS size the serve step, LOG_DIR takes its workers' logs.
# SMOKE=1 (scripts/smoke, on a machine without a GPU, from `SMOKE=1 scripts/build-gpu`'s
# folder): the CPU plumbing only. STEPS defaults to "serve seed000"; the serve step runs
# CONFIG made CPU-only (the tiny model, no [gpu] section or GPU shares, KV over shm, 64 MB KV
# budgets) at small sizes, with the second router and the greedy gate as on the GPU; seed000
# writes and checks its deployment files (CHECK_ONLY=1) without starting them.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
smoke() { [ -n "${SMOKE:-}" ] && [ "${SMOKE}" != 0 ]; }
if smoke; then
  export CHECK_ONLY=1
  : "${INPUT_LEN:=64}" "${OUTPUT_LEN:=8}" "${PREFILL_PROMPTS:=4}" "${DECODE_PROMPTS:=4}" "${GATE_PROMPTS:=2}"
fi
# The binaries travel gzip'd (scripts/build-gpu); unpack them beside nothing else.
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
tar -xzf "$here/bin.tar.gz" -C "$bin"
libs=$(python3 - 2>/dev/null <<'PY'
import os, glob
import nvidia
roots = [os.path.dirname(p) for p in nvidia.__path__]
found = set()
for r in roots:
    for so in glob.glob(os.path.join(r, "nvidia", "**", "lib", "*.so*"), recursive=True):
        found.add(os.path.dirname(so))
print(":".join(sorted(found)))
PY
)
[ -n "$libs" ] || echo "no CUDA libraries in the Python environment (no nvidia packages)" >&2
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi: no GPU here"
if smoke; then steps="${STEPS:-serve seed000}"; else steps="${STEPS:-check ipc nccl bench torch serve seed000}"; fi
want() { [[ " $steps " == *" $1 "* ]]; }
if want check; then
  echo "== gpu_check (tiny)"; "$bin/gpu_check" --model tiny
  echo "== gpu_check (dummy smollm2 shape)"; "$bin/gpu_check" --model dummy:smollm2-135m
fi
if want ipc; then echo "== gpu_ipc_check (cuda-ipc between two processes)"; "$bin/gpu_ipc_check"; fi
if want nccl; then
  # NCCL wants the name libnccl.so; the machine's Python environment ships libnccl.so.2.
  nccl_dir=$(mktemp -d)
  for d in ${LD_LIBRARY_PATH//:/ }; do
    if [ -e "$d/libnccl.so.2" ]; then ln -sf "$d/libnccl.so.2" "$nccl_dir/libnccl.so"; break; fi
  done
  echo "== gpu_nccl_check (nccl between two processes; needs two GPUs, says SKIP on one)"
  LD_LIBRARY_PATH="$nccl_dir:$LD_LIBRARY_PATH" timeout 180 "$bin/gpu_nccl_check"
fi
if want bench; then echo "== gpu_bench"; "$bin/gpu_bench"; fi
if want torch; then echo "== PyTorch/transformers, same shapes"; python3 "$here/torch_bench.py"; fi
if want torchs; then
  # gpt-fast's recipe: SDPA flash prefill, static-KV decode in CUDA graphs, torch.compile.
  echo "== PyTorch, static KV cache: graphs and torch.compile"
  PYTHONUNBUFFERED=1 python3 "$here/torch_static.py"
fi
if want profile; then
  # ncu times every kernel of one prefill and two decode steps (gpu_bench --profile), at the
  # clocks the card runs at; kernel_profile.py splits them per pass and ranks them.
  echo "== ncu: kernels of a 2048-token prefill and decode steps at batch 1 and 128 (8B dummy)"
  csv="${OUT:-/tmp}/profile.csv"
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  "${ncu:-ncu}" --profile-from-start off --clock-control none --csv --page raw \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \
    "$bin/gpu_bench" --profile >"$csv" 2>"${OUT:-/tmp}/ncu.err" || tail -n 20 "${OUT:-/tmp}/ncu.err"
  python3 "$here/kernel_profile.py" "$csv"
fi
if want serve; then
  # 1P1D on one GPU: prefill 96 SMs, decode 36, KV over cuda-ipc; the `# Prefill` and
  # `# Decode` blocks come from tandem-bench.
  config="${CONFIG:-deploy/gpu/green-ctx-1gpu.toml}"
  logs="${LOG_DIR:-${OUT:-/tmp}/tandem-logs}"
  echo "== 1P1D on the GPU: $config"
  # A second router joins this deployment below: both take the internal secret from one
  # private file (tandem up would otherwise draw a secret only its own processes know).
  secrets=$(mktemp -d)
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$secrets/secret"
  chmod 600 "$secrets/secret"
  gpu_or_cpu() { # smoke mode: CONFIG on the CPU (see the header)
    if ! smoke; then cat "$1"; return; fi
    awk '
      /^\[/ { section = $0 }
      section == "[gpu]" { next }
      section == "[model]" && /^[ \t]*name[ \t]*=/ { print "name = \"tiny\""; next }
      section == "[model]" && /^[ \t]*(weights|kv_dtype)[ \t]*=/ { next }
      /^[ \t]*(gpu|green_context_sms|mps_thread_percentage)[ \t]*=/ { next }
      /^[ \t]*transport[ \t]*=/ { print "transport = \"shm\""; next }
      /^[ \t]*kv_budget_mb[ \t]*=/ { print "kv_budget_mb = 64"; next }
      { print }
    ' "$1"
  }
  { gpu_or_cpu "$config"; printf '\n[security]\nsecret_file = "%s"\n' "$secrets/secret"; } > "$secrets/deploy.toml"
  config="$secrets/deploy.toml"
  "$bin/tandem" up "$config" --bin-dir "$bin" --log-dir "$logs" >/tmp/tandem-up.out 2>&1 &
  up=$!
  started=$(date +%s)
  for _ in $(seq 1 300); do
    grep -q "tandem is up" /tmp/tandem-up.out && break
    kill -0 "$up" 2>/dev/null || break
    sleep 1
  done
  cat /tmp/tandem-up.out
  echo "(up after $(( $(date +%s) - started )) s)"
  # Seed 002's two blocks: long prompts with one output token, then one-token prompts with
  # many output tokens (EOS ignored).
  bench=("$bin/tandem-bench" --tokenizer byte-level --base-url http://127.0.0.1:8000 --disable-tqdm)
  "${bench[@]}" --preset prefill --random-input-len "${INPUT_LEN:-2048}" --num-prompts "${PREFILL_PROMPTS:-128}" || true
  "${bench[@]}" --preset decode --random-output-len "${OUTPUT_LEN:-128}" --num-prompts "${DECODE_PROMPTS:-256}" || true
  # The same decode worker behind a second router with no prefill worker: aggregated. Greedy
  # outputs of both side by side.
  TANDEM_INTERNAL_SECRET_FILE="$secrets/secret" \
    "$bin/tandem-router" --port 8001 --decode http://127.0.0.1:7201 --agg-threshold 1000000 \
    >/tmp/tandem-agg-router.log 2>&1 &
  agg=$!
  sleep 3
  python3 "$here/greedy_gate.py" http://127.0.0.1:8000 http://127.0.0.1:8001 "${GATE_PROMPTS:-16}" || true
  kill -TERM "$agg" 2>/dev/null; wait "$agg" 2>/dev/null
  kill -TERM "$up" 2>/dev/null; wait "$up" 2>/dev/null
  rm -rf "$secrets"
  tail -n 5 "$logs"/*.log 2>/dev/null || true
fi
if want seed000; then
  echo "== seed 000 on one GPU: alone, two under MPS, two in green contexts"
  BIN="$bin" bash "$here/seed000.sh"
fi
