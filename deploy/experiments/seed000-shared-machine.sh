#!/usr/bin/env bash
# Seed 000 on a CPU: one server alone on both cores, then two servers sharing the machine
# with the cores split (one each, the CPU analogue of MPS / green-context shares), each driven
# by its own benchmark client at the same time; one block per client. Each request: 1000
# input and 100 output tokens, as in the seed (fewer requests, for 2 cores).
source "$(dirname "$0")/lib.sh"
build
cfg="$(dirname "$0")/configs"
n="${REQUESTS:-16}"
args=(--layout old --random-input-len 1000 --random-output-len 100 --ignore-eos --num-prompts "$n")
echo "Single Server (cores 0-1):"
up alone "$cfg/seed000-alone.toml"
bench --base-url http://127.0.0.1:8100 "${args[@]}"
down
echo
echo "Two Servers (core 0 and core 1), two clients at once:"
up server-a "$cfg/seed000-server-a.toml"
up server-b "$cfg/seed000-server-b.toml"
bench --base-url http://127.0.0.1:8101 "${args[@]}" >"$OUT/seed000-a.txt" &
a=$!
bench --base-url http://127.0.0.1:8102 "${args[@]}" >"$OUT/seed000-b.txt" &
b=$!
wait $a $b
echo "Server A:"
cat "$OUT/seed000-a.txt"
echo "Server B:"
cat "$OUT/seed000-b.txt"
