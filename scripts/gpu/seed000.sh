#!/usr/bin/env bash
# Seed 000's shape on one GPU (run by on-device.sh; BIN is the folder of the tandem binaries):
# one server alone on the whole GPU, then two servers sharing it, each driven by its own
# tandem-bench client at the same time, one result block per client: under MPS (50/50 thread
# percentage), and each confined to a green context (64/64 and 96/36 SMs). A server is an
# aggregated deployment: one decode worker on the GPU behind its own router. Every request:
# 1000 input and 100 output tokens, EOS ignored, as in the seed.
# CHECK_ONLY=1 writes the deployment files and runs `tandem check` on them, nothing else.
set -uo pipefail
BIN="${BIN:?set BIN to the folder of the tandem binaries}"
MODEL="${MODEL:-dummy:llama-3.1-8b}"
KV_MB="${KV_MB:-12000}"
N="${REQUESTS:-64}"
dir=$(mktemp -d)
args=(--tokenizer byte-level --disable-tqdm --layout old --random-input-len 1000
  --random-output-len 100 --ignore-eos --num-prompts "$N")

# server NAME INDEX SHARE: writes $dir/NAME.toml, a server on router port 8100+INDEX whose
# decode worker gets SHARE (`whole`, `mps:PERCENT` or `green:SMS`) of GPU 0.
server() {
  local name=$1 i=$2 share=$3 mps=false extra=""
  case "$share" in
    mps:*) mps=true; extra="mps_thread_percentage = ${share#mps:}" ;;
    green:*) extra="green_context_sms = ${share#green:}" ;;
  esac
  cat >"$dir/$name.toml" <<EOF
description = "seed 000 on one GPU: $name ($share)"
[model]
name = "$MODEL"
weights = "bf16"
[gpu]
count = 1
sms = 132
mps = $mps
[router]
port = $((8100 + i))
agg_threshold = 1000000000
[[decode]]
port = $((7300 + 10 * i))
kv_tcp_port = $((7301 + 10 * i))
gpu = 0
kv_budget_mb = $KV_MB
$extra
EOF
}

pids=()
up() {
  "$BIN/tandem" up "$dir/$1.toml" --bin-dir "$BIN" >"$dir/$1.up" 2>"$dir/$1.err" &
  pids+=($!)
  for _ in $(seq 1 600); do
    grep -q "tandem is up" "$dir/$1.up" && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || { cat "$dir/$1.err"; return 1; }
    sleep 1
  done
  return 1
}
down() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
}
trap 'down; rm -rf "$dir"' EXIT

# pair NAME TITLE SHARE_A SHARE_B: two servers at once, one client each.
pair() {
  local name=$1
  echo "$2"
  server "$name-a" 1 "$3"
  server "$name-b" 2 "$4"
  if [ -n "${CHECK_ONLY:-}" ]; then return; fi
  up "$name-a" && up "$name-b" || { down; return; }
  "$BIN/tandem-bench" --base-url http://127.0.0.1:8101 "${args[@]}" >"$dir/$name-a.txt" 2>&1 &
  local a=$!
  "$BIN/tandem-bench" --base-url http://127.0.0.1:8102 "${args[@]}" >"$dir/$name-b.txt" 2>&1 &
  wait $a $!
  echo "Server A ($3):"; cat "$dir/$name-a.txt"
  echo "Server B ($4):"; cat "$dir/$name-b.txt"
  down
}

echo "Single Server (whole GPU):"
server alone 0 whole
if [ -z "${CHECK_ONLY:-}" ] && up alone; then
  "$BIN/tandem-bench" --base-url http://127.0.0.1:8100 "${args[@]}"
  down
fi
pair mps "Two Servers under MPS (50/50):" mps:50 mps:50
pair green64 "Two Servers in green contexts (64/64 SMs):" green:64 green:64
pair green96 "Two Servers in green contexts (96/36 SMs):" green:96 green:36
if [ -n "${CHECK_ONLY:-}" ]; then
  "$BIN/tandem" check --cores 16 "$dir"/*.toml
fi
