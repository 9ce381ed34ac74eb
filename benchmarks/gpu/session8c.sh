#!/usr/bin/env bash
# On the lent H200, one call (issues 31, 36): the guard's cost at 8 x 128 with its two parts apart (--micro),
# then long context within memory (gpu/long_context.sh memory: 8k..64k, 4 query / 2 kv heads, bf16; and 70k:
# one head past 2**32, emulated eager wrong, mps_safe_eager equal). Run `bash benchmarks/gpu/prepare.sh`
# here first; carry .weights, .whl.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
(source benchmarks/gpu/setup.sh >/dev/null 2>&1
 for i in 1 2; do
   timeout 120 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128 --reps 60 --micro 2>&1 | tail -2
 done) | tee "$out/guard_latency.txt"
timeout 300 bash benchmarks/gpu/long_context.sh memory
timeout 150 bash benchmarks/gpu/long_context.sh 70k
