#!/usr/bin/env bash
# On the lent H200, one call: the guard's cost at 8/64/512 x 128 (issues 31 and 35: raise <= 1.10x, strict
# <= 1.5x at 8 x 128; the TorchFunctionMode design beside them), then blocked_eager at the 16 GB Mac's demo
# (issue 33, gpu/blocked_attention.sh). Run `bash benchmarks/gpu/prepare.sh` here first; carry .weights, .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
timeout 150 python3 benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30 \
  --function-mode 2>&1 | tee "$out/guard_latency.txt"
timeout 420 bash benchmarks/gpu/blocked_attention.sh
