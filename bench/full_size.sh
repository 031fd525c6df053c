#!/usr/bin/env bash
# The released sizes (full preset, 2.66 B parameters) served on this machine's CPU: see bench/full_size.py.
# Writes the full preset with random weights once (float32, the official layout, Base only: ~10.6 GB in
# cache/full_size/), serves it with the launcher (--models base) and prints one table: each model's time
# to ready, the RSS of every process, the KV pool, one short request through tritonserver and the gateway.
# Refuses, with the numbers, when free memory (MemAvailable) or disk is too low. Minutes; not in make test.
#   bench/full_size.sh                    # write (first run only), serve, measure
#   bench/full_size.sh --write-only       # only the checkpoint
#   bench/full_size.sh --out results/full_size.md
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec nice -n "${NICE:-5}" "$PY" -m bench.full_size "$@"
