#!/usr/bin/env bash
# On a lent CUDA GPU (after issues 46, 49, 50, 2026-12-05): the main command as typed, and the fault boundary
# emulated at full scale, on HEAD's code: does the refactoring of issue 49 still give the published counts?
# Run `bash benchmarks/gpu/prepare.sh` here first; carry .weights and .whl. Writes each run's report.md and the
# console's last lines into $OUT.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
runs=/tmp/gpu-runs
mkdir -p "$out" "$runs"
run() {  # name, then mpsimpact arguments
  local name=$1; shift
  /usr/bin/env time -f "$name: exit %x, wall %e s, max RSS %M KB" timeout 280 mpsimpact "$@" --out "$runs/$name" \
    >"$out/$name.console.txt" 2>&1
  tail -1 "$out/$name.console.txt"
  cp "$runs/$name/report.md" "$out/$name.report.md" 2>/dev/null || echo "$name: no report.md"
}
run as-typed run sentiment --batch-size 4096
run emulated-1365 run sentiment --device cuda --emulate --batch-size 1365 --max-length 512 --guard off --expect clean
run emulated-1366 run sentiment --device cuda --emulate --batch-size 1366 --max-length 512 --guard off --expect corrupted
run control-2048 run sentiment --device cuda --no-emulate --batch-size 2048 --max-length 512 --expect clean
