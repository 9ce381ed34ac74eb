#!/usr/bin/env bash
# On the lent H200 (issue 46): the raise guard's cost at 8 x 128 before the good-guest work (.old/src: the
# source of fef3d3c, first on PYTHONPATH) and after (HEAD), alternating, 60 repetitions a run, with --micro
# (one guarded F.linear over the plain call on this host); 64 and 512 x 128 after.
# Run `bash benchmarks/gpu/prepare.sh` and `git archive fef3d3c src | tar -x -C .old` here first;
# carry .weights, .whl, .old.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
for i in 1 2 3 4 5; do
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
