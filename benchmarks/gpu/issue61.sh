#!/usr/bin/env bash
# On a lent GPU (issue 61): the guard's cost at 8 x 128 (MiniLM, guard_latency.py) before the table of ops
# (.old/src: the source of 8fd8baa, main before issue 61, first on PYTHONPATH) and after (this tree), alternating,
# 5 rounds, 60 repetitions a run, each run with a 3 GiB fp16 tensor held on the device (--resident 3): `raise`
# (the entry points; a resident tensor changes nothing there) and `strict`, which then watches every op from its
# entry (Note [Strict, gated]). Targets: raise <= 1.05x, strict <= 1.5x (medians). Then the medians of each
# column per code (latency_medians.py), and strict_gated_check.py on this tree (CUDA's real byte count).
# Here first: `bash benchmarks/gpu/prepare.sh` and `mkdir -p .old && git archive 8fd8baa src | tar -x -C .old`;
# carry .weights, .whl, .old. Run: `bash benchmarks/gpu/issue61.sh` (about 4 minutes on an H100).
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
for i in 1 2 3 4 5; do
  order="before after"
  [ $((i % 2)) -eq 0 ] && order="after before"
  for code in $order; do
    path=/tmp/site
    [ "$code" = before ] && path=$PWD/.old/src:/tmp/site
    echo "== $code, round $i" | tee -a "$out/guard_latency.txt"
    PYTHONPATH=$path timeout 150 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128 --reps 60 \
      --resident 3 --micro 2>&1 | tail -3 | tee -a "$out/guard_latency.txt"
  done
done
python3 benchmarks/gpu/latency_medians.py "$out/guard_latency.txt" | tee "$out/medians.txt"
PYTHONPATH=/tmp/site timeout 200 python3 benchmarks/gpu/strict_gated_check.py 2>&1 | tail -8 | tee "$out/strict_gated_check.txt"
