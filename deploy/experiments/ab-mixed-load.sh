#!/usr/bin/env bash
# The A/B that justifies disaggregation: the same two cores, aggregated vs disaggregated,
# under a mixed load: many streams decoding (client A: short prompts, 256 output tokens,
# 16 at a time) while long prompts keep arriving (client B: 2048-token prompts, one output
# token, one every 4 s). Reported: client A's TPOT/ITL (the streams' smoothness), and both
# clients' TTFT and throughput, one block per client per deployment.
# The disaggregated deployment runs twice: every prompt through the prefill worker, and with
# prompts under 256 tokens run on the decode worker (conditional disaggregation), since a
# stream's 16-token prompt should not wait behind 2048-token prompts in the prefill queue.
# The aggregated baseline runs twice: with 2048-token prefill chunks and with 512-token
# chunks (vLLM's usual knob against TPOT spikes), so the comparison is not against a strawman.
source "$(dirname "$0")/lib.sh"
build
cfg="$(dirname "$0")/configs"
streams=(--random-input-len 16 --random-output-len 256 --ignore-eos --num-prompts "${STREAMS:-48}" --max-concurrency 16 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99)
prompts=(--random-input-len 2048 --random-output-len 1 --num-prompts "${PROMPTS:-8}" --request-rate 0.25 --burstiness 100 --percentile-metrics ttft,e2el --metric-percentiles 50,99)
run() {
  local name=$1 config=$2 port=$3
  up "$name" "$config"
  bench --base-url "http://127.0.0.1:$port" "${streams[@]}" --ready-check-timeout-sec 0 >"$OUT/ab-$name-streams.txt" &
  local a=$!
  sleep 5 # the streams are decoding when the first long prompt arrives
  bench --base-url "http://127.0.0.1:$port" "${prompts[@]}" --ready-check-timeout-sec 0 >"$OUT/ab-$name-prompts.txt" &
  local b=$!
  wait $a $b
  down
  echo "## $name: decode streams (client A)"
  cat "$OUT/ab-$name-streams.txt"
  echo "## $name: long prompts (client B)"
  cat "$OUT/ab-$name-prompts.txt"
  echo
}
run disaggregated "$ROOT/deploy/local/cpu-1p1d.toml" 8000
run disaggregated-short-local "$cfg/cpu-1p1d-short-local.toml" 8000
run aggregated-chunk2048 "$ROOT/deploy/local/aggregated.toml" 8000
run aggregated-chunk512 "$cfg/aggregated-chunk512.toml" 8000
