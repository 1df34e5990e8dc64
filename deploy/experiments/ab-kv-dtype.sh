#!/usr/bin/env bash
# The KV cache's element type at 16 concurrent: the same deployment
# (configs/aggregated-chunk512.toml in `compute = "fast"`) and the same load (random
# 512-token prompts, 128 output tokens, EOS ignored, 16 at a time, seed 7) once per KV_DTYPES
# entry (default "f32 bf16"), one deployment at a time. At 512-640 tokens of context, 16
# decode rows read ~26 MB of f32 K and V each a step: a 16-bit cache halves that.
# Prints one line per type: output tok/s, mean TTFT, median and P99 inter-token latency.
# N sets the request count (default 48).
source "$(dirname "$0")/lib.sh"
build
for kv in ${KV_DTYPES:-f32 bf16}; do
  config="$OUT/ab-kv-$kv.toml"
  awk -v kv="$kv" '{ print } /^\[model\]/ { print "compute = \"fast\""; print "kv_dtype = \"" kv "\"" }' \
    "$(dirname "$0")/configs/aggregated-chunk512.toml" >"$config"
  up "ab-kv-$kv" "$config"
  bench --base-url http://127.0.0.1:8000 --dataset-name random --random-input-len 512 \
    --random-output-len 128 --ignore-eos --max-concurrency 16 --num-prompts "${N:-48}" \
    --seed 7 --percentile-metrics ttft,itl --metric-percentiles 50,99 >"$OUT/ab-kv-$kv.txt"
  down
  awk -v kv="$kv" '
    /Output token throughput/ { tput = $NF }
    /Mean TTFT/ { ttft = $NF }
    /Median ITL/ { itl50 = $NF }
    /P99 ITL/ { itl99 = $NF }
    END { printf "kv_dtype %s: %s output tok/s, mean TTFT %s ms, ITL median %s ms, P99 %s ms\n", kv, tput, ttft, itl50, itl99 }
  ' "$OUT/ab-kv-$kv.txt"
done
