#!/usr/bin/env bash
# On the lent H200: the guard's latency cost (issue 17) and full-scale SDPA runs per release (issue 12).
# Run `bash benchmarks/gpu/prepare.sh` here first and carry .weights and .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
python3 benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30 2>&1 | tee "$out/guard_latency.txt"
for profile in 2.12.1 2.13.0; do
  mpsimpact run sentiment --device cuda --batch-size 2048 --attention both --torch-profile "$profile" --out "/tmp/sdpa-$profile" > "$out/sdpa-$profile.txt" 2>&1
  cp "/tmp/sdpa-$profile/report.json" "$out/sdpa-$profile.json"; tail -40 "$out/sdpa-$profile.txt"
done
