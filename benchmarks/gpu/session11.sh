#!/usr/bin/env bash
# On the lent H200 (issues 46 and 50): the raise guard's cost at 8 x 128 (MiniLM, guard_latency.py) after
# the nested-tensor change and the plugin's work, six runs of 60 repetitions; 64 and 512 x 128 once.
# Run `bash benchmarks/gpu/prepare.sh` here first; carry .weights and .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
for i in 1 2 3 4 5 6; do
  echo "== run $i" | tee -a "$out/guard_latency.txt"
  PYTHONPATH=/tmp/site timeout 100 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128 --reps 60 \
    2>&1 | tail -3 | tee -a "$out/guard_latency.txt"
done
PYTHONPATH=/tmp/site timeout 150 python3 benchmarks/guard_latency.py --device cuda --shapes 64x128,512x128 --reps 30 \
  2>&1 | tail -3 | tee -a "$out/guard_latency.txt"
