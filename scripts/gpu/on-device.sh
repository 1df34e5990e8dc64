#!/usr/bin/env bash
# Runs on the GPU machine (carried in .gpu-build/, from the repository root): points the
# dynamic loader at the CUDA 13 libraries of the machine's Python environment, then runs the
# correctness check, the cuda-ipc and nccl checks (two processes), tandem's GPU benchmark, the same
# shapes through PyTorch/transformers, and a 1P1D deployment on one GPU (green contexts,
# KV over cuda-ipc) under tandem-bench (seed 002's `# Prefill` and `# Decode` blocks), with
# its greedy outputs compared to aggregated ones; then seed 000's shape (scripts/gpu/seed000.sh).
# STEPS picks a subset, e.g. STEPS="ipc serve"; PREFILL_PROMPTS, DECODE_PROMPTS and
# GATE_PROMPTS size the serve step, LOG_DIR takes its workers' logs.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# The binaries travel gzip'd (scripts/build-gpu); unpack them beside nothing else.
bin=$(mktemp -d)
tar -xzf "$here/bin.tar.gz" -C "$bin"
libs=$(python3 - <<'PY'
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
export LD_LIBRARY_PATH="${libs}:/usr/local/cuda/lib64:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
steps="${STEPS:-check ipc nccl bench torch serve seed000}"
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
  { cat "$config"; printf '\n[security]\nsecret_file = "%s"\n' "$secrets/secret"; } > "$secrets/deploy.toml"
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
