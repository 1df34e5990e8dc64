#!/usr/bin/env bash
# Seed 002 on this machine: the `# Prefill` and `# Decode` blocks against the CPU 1P1D
# deployment (prefill on core 0, decode on core 1, KV over shared memory).
# Prefill: long random prompts, one output token. Decode: one input token, 128 output tokens,
# many concurrent requests, EOS ignored. Scaled from 512 requests to what 2 cores finish in a
# few minutes.
source "$(dirname "$0")/lib.sh"
build
up 1p1d "$ROOT/deploy/local/cpu-1p1d.toml"
bench --base-url http://127.0.0.1:8000 --preset prefill --random-input-len 2048 --num-prompts "${PREFILL_PROMPTS:-16}"
echo
bench --base-url http://127.0.0.1:8000 --preset decode --random-output-len 128 --num-prompts "${DECODE_PROMPTS:-64}"
