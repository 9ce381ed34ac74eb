#!/usr/bin/env bash
# On the lent H200: half precision at 2048 x 512 with fp32 reductions in cuBLAS (issue 14).
set -uo pipefail
source benchmarks/gpu/setup.sh
rm -rf /tmp/h-*
for dtype in bfloat16 float16; do
  mpsimpact run sentiment --device cuda --batch-size 2048 --dtype "$dtype" --out "/tmp/h-2048-$dtype" > "/tmp/h-2048-$dtype.txt" 2>&1 || tail -5 "/tmp/h-2048-$dtype.txt"
done
python3 benchmarks/gpu/half_summary.py /tmp/h-* | tee "$OUT/half_summary2.txt"
