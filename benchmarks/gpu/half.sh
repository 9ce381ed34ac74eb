#!/usr/bin/env bash
# On the lent H200: half precision at full scale (issue 14) and the guard's latency (issue 17).
# Run `bash benchmarks/gpu/prepare.sh` here first and carry .weights and .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
python3 benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30 2>&1 | tee "$out/guard_latency.txt"
for geometry in 2048 1400; do
  for dtype in float32 float16 bfloat16; do
    mpsimpact run sentiment --device cuda --batch-size "$geometry" --dtype "$dtype" --out "/tmp/h-$geometry-$dtype" > "/tmp/h-$geometry-$dtype.txt" 2>&1 || tail -5 "/tmp/h-$geometry-$dtype.txt"
  done
done
python3 benchmarks/gpu/half_summary.py /tmp/h-* | tee "$out/half_summary.txt"
