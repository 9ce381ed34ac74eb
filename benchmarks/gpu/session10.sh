#!/usr/bin/env bash
# On the lent H200 (issue 35): strict gated. The guard's cost at 8 x 128 before (.old/src, the code before
# the change, first on PYTHONPATH) and after, alternating, 60 repetitions each run; 64 and 512 x 128 after;
# then the gated guard's checks with CUDA's real byte count (strict_gated_check.py).
# Run `bash benchmarks/gpu/prepare.sh` and `git archive <before> src | tar -x -C .old` here first;
# carry .weights, .whl, .old.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
for i in 1 2 3 4; do
  for code in before after; do
    path=/tmp/site
    [ "$code" = before ] && path=$PWD/.old/src:/tmp/site
    echo "== $code, run $i" | tee -a "$out/guard_latency.txt"
    PYTHONPATH=$path timeout 100 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128 --reps 60 --micro \
      2>&1 | tail -2 | tee -a "$out/guard_latency.txt"
  done
done
PYTHONPATH=/tmp/site timeout 120 python3 benchmarks/guard_latency.py --device cuda --shapes 64x128,512x128 --reps 30 \
  2>&1 | tail -2 | tee -a "$out/guard_latency.txt"
PYTHONPATH=/tmp/site timeout 200 python3 benchmarks/gpu/strict_gated_check.py 2>&1 | tail -8 | tee "$out/strict_gated_check.txt"
