#!/usr/bin/env bash
# The A/B that justifies disaggregation: the same two cores, aggregated vs disaggregated,
# under a mixed load: many streams decoding (client A: 16-token prompts, 256 output tokens,
# 16 at a time) while long prompts keep arriving (client B: 2048-token prompts, one output
# token, at RATE per second). Reported per deployment: client A's TPOT and ITL (how smooth
# the streams are), both clients' TTFT, and throughput; one block per client.
#
# Deployments: disaggregated with every prompt through the prefill worker; disaggregated with
# prompts under 256 tokens run on the decode worker (a 16-token prompt should not queue behind
# 2048-token prompts); aggregated with 2048-token and with 512-token prefill chunks (vLLM's
# usual knob against TPOT spikes), so the baseline is not a strawman.
# RATES lists the long-prompt arrival rates to run (default "0.25 0.5").
source "$(dirname "$0")/lib.sh"
build
cfg="$(dirname "$0")/configs"
streams=(--random-input-len 16 --random-output-len 256 --ignore-eos --num-prompts "${STREAMS:-48}" --max-concurrency 16 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99)
run() {
  local name=$1 config=$2 rate=$3
  local prompts=(--random-input-len 2048 --random-output-len 1 --num-prompts "${PROMPTS:-8}" --request-rate "$rate" --burstiness 100 --percentile-metrics ttft,e2el --metric-percentiles 50,99)
  up "$name" "$config"
  bench --base-url http://127.0.0.1:8000 "${streams[@]}" --ready-check-timeout-sec 0 >"$OUT/ab-$name-$rate-streams.txt" &
  local a=$!
  sleep 5 # the streams are decoding when the first long prompt arrives
  bench --base-url http://127.0.0.1:8000 "${prompts[@]}" --ready-check-timeout-sec 0 >"$OUT/ab-$name-$rate-prompts.txt" &
  local b=$!
  wait $a $b
  down
  echo "## $name, long prompts at $rate/s: decode streams (client A)"
  cat "$OUT/ab-$name-$rate-streams.txt"
  echo "## $name, long prompts at $rate/s: long prompts (client B)"
  cat "$OUT/ab-$name-$rate-prompts.txt"
  echo
}
value() { grep -m1 "$2" "$1" | awk '{print $NF}'; }
summary=()
first=1
for rate in ${RATES:-0.25 0.5}; do
  for pair in "disaggregated:$ROOT/deploy/local/cpu-1p1d.toml" \
              "disaggregated-short-local:$cfg/cpu-1p1d-short-local.toml" \
              "aggregated-chunk2048:$ROOT/deploy/local/aggregated.toml" \
              "aggregated-chunk512:$cfg/aggregated-chunk512.toml"; do
    name=${pair%%:*}
    # Every prompt through the prefill worker: shown once, at the first rate (its lesson is
    # the streams' TTFT, which conditional disaggregation fixes).
    if [ "$name" = disaggregated ] && [ "$first" = 0 ]; then continue; fi
    run "$name" "${pair#*:}" "$rate"
    s="$OUT/ab-$name-$rate-streams.txt"; p="$OUT/ab-$name-$rate-prompts.txt"
    summary+=("$(printf '| %s | %s | %s | %s | %s | %s | %s | %s |' "$rate" "$name" \
      "$(value "$s" 'P50 TPOT')" "$(value "$s" 'P99 TPOT')" "$(value "$s" 'P99 ITL')" \
      "$(value "$s" 'P50 TTFT')" "$(value "$p" 'P50 TTFT')" "$(value "$s" 'Output token throughput')")")
  done
done
echo "| long prompts/s | deployment | streams P50 TPOT (ms) | streams P99 TPOT (ms) | streams P99 ITL (ms) | streams P50 TTFT (ms) | long prompts P50 TTFT (ms) | streams tok/s |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
printf '%s\n' "${summary[@]}"
