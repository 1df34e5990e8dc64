#!/usr/bin/env bash
# Seed 001 on this machine, against the CPU 1P1D deployment:
# 1. a --num-prompts sweep at 80-token prompts (one block per value, summary, plot),
# 2. a sweep at long prompts (2048 tokens),
# 3. single requests with prompts near SmolLM2's 8192-token context (chunked prefill).
source "$(dirname "$0")/lib.sh"
build
up 1p1d "$ROOT/deploy/local/cpu-1p1d.toml"
url=http://127.0.0.1:8000
echo "num_prompts: 1, 2, 4, 8, 16, 32, 64"
echo "seq_length: 80"
bench --base-url $url --layout old --random-input-len 80 --random-output-len 64 --random-range-ratio 0.5 \
  --num-prompts 1,2,4,8,16,32,64 --plot-file "$ROOT/docs/seed001-sweep-80.svg"
echo
echo "num_prompts: 1, 2, 4, 8"
echo "seq_length: 2048"
bench --base-url $url --layout old --random-input-len 2048 --random-output-len 32 \
  --num-prompts 1,2,4,8 --plot-file "$ROOT/docs/seed001-sweep-2048.svg"
for len in 4096 8000; do
  echo
  echo "num_prompt:1"
  echo "seq_length: $len"
  bench --base-url $url --layout old --random-input-len $len --random-output-len 32 --num-prompts 1 --no-plot
done
