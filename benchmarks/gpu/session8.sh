#!/usr/bin/env bash
# On the lent H200, one call (issues 31, 33, 35): the guard's cost at 8/64/512 x 128 beside strict's floor (a
# dispatch mode that only runs each op), 8 x 128 twice more at 60 repetitions (the ratio moves by a few
# hundredths between runs), then blocked_eager at the 16 GB Mac's demo (gpu/blocked_attention.sh).
# Run `bash benchmarks/gpu/prepare.sh` here first; carry .weights, .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
timeout 150 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30 \
  --function-mode 2>&1 | tee "$out/guard_latency.txt"
for i in 1 2; do
  timeout 100 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128 --reps 60 2>&1 | tail -1 | tee -a "$out/guard_latency.txt"
done
timeout 360 bash benchmarks/gpu/blocked_attention.sh
