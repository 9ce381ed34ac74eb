#!/usr/bin/env bash
# On the lent H200 (issues 31, 35): the guard's cost after the entering and strict hot-path changes of
# 2026-12-03, at 8/64/512 x 128 beside strict's floor, then 8 x 128 three more times at 60 repetitions.
# Run `bash benchmarks/gpu/prepare.sh` here first; carry .weights, .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
timeout 150 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30 \
  --function-mode 2>&1 | tee "$out/guard_latency.txt"
for i in 1 2 3; do
  timeout 100 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128 --reps 60 2>&1 | tail -1 | tee -a "$out/guard_latency.txt"
done
