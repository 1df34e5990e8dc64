# Shared by the measuring scripts under scripts/ (and by deploy/experiments/lib.sh): the smoke
# mode, the build profile that goes with it, and how to build. Sourced, not run.
#
# Smoke mode: SMOKE=1 in the environment (unset, empty or 0: off). A script in smoke mode runs
# its whole path (build, servers, clients, the analysis that prints its table and its JSON
# line) on the tiny model (`tiny` / `dummy:tiny`, seeded weights, no download) or at its
# smallest sizes, in seconds, and fails on any error. It builds nothing new: it uses the
# dev-profile artifacts in target/debug that CI has built before it (`cargo build --workspace
# --bins`, and `cargo test --workspace`, which also builds every example), and asks cargo for
# exactly those (a no-op when they are fresh), never for a release build (~10 minutes for the
# workspace on 2 cores). The figures of a smoke run mean nothing: it proves that the script
# still runs and still prints every figure. `scripts/smoke` runs every script this way in CI
# and checks the shape of what each prints.
#
# Sets: ROOT (the repository), PROFILE (release, or debug in smoke mode), BIN (target/PROFILE),
# TANDEM_CACHE (default ROOT/.cache, as CI has it), ENGINE_BENCH_SMOKE_ARGS (the sizes that make
# engine_bench take about a second: 32-token prompts, 16-token decode prompts, 2 decode
# steps, small floors).

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TANDEM_CACHE="${TANDEM_CACHE:-$ROOT/.cache}"

# smoke: true in smoke mode.
smoke() {
  [ -n "${SMOKE:-}" ] && [ "${SMOKE}" != 0 ]
}

if smoke; then PROFILE=debug; else PROFILE=release; fi
BIN="$ROOT/target/$PROFILE"
ENGINE_BENCH_SMOKE_ARGS=(--prompt-len 32 --decode-prompt-len 16 --decode-steps 2 --copy-mib 16
  --matmul-size 256)

# cargo_build ARGS...: builds what a script runs, quietly, progress on stderr. Normally
# `cargo build --release ARGS`. In smoke mode ARGS only say whether binaries (`--bin`, `--bins`)
# and examples (`--example`, `--examples`) are wanted, and the build is CI's own:
# `cargo build --workspace --bins` and `cargo build --workspace --examples` (the examples with
# the feature set `cargo test --workspace` built them with), so that nothing is compiled again.
cargo_build() {
  if smoke; then
    local bins="" examples="" arg
    for arg in "$@"; do
      case "$arg" in
        --bin | --bins) bins=1 ;;
        --example | --examples) examples=1 ;;
      esac
    done
    if [ -n "$bins" ]; then (cd "$ROOT" && cargo build --quiet --workspace --bins) >&2; fi
    if [ -n "$examples" ]; then (cd "$ROOT" && cargo build --quiet --workspace --examples) >&2; fi
  else
    (cd "$ROOT" && cargo build --release --quiet "$@") >&2
  fi
}

# hush CMD ARGS...: runs CMD with its stderr (progress lines) dropped, as the scripts print
# only results; in smoke mode stderr stays, so that a failure explains itself.
hush() {
  if smoke; then "$@"; else "$@" 2>/dev/null; fi
}
