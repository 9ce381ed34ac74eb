#!/usr/bin/env bash
# Full-scale validation on one CUDA GPU (issue: full-scale validation). Writes a tarball of every
# run's report.json, report.md, logits.npz and error figure into $OUT.
source benchmarks/gpu/setup.sh
runs=/tmp/gpu-runs
mkdir -p $runs
run() {  # name, then mpsimpact run flags
  local name=$1; shift
  /usr/bin/env time -f "$name wall %e s, max RSS %M KB" mpsimpact run sentiment --device cuda --max-length 512 --out $runs/$name "$@" 2>&1 | tail -25
}
run control-2048 --no-emulate --batch-size 2048 --expect clean
run emulated-2048 --emulate --batch-size 2048 --expect corrupted
run emulated-4096 --emulate --batch-size 4096 --expect corrupted
run emulated-1365 --emulate --batch-size 1365 --guard off --expect clean
run emulated-1366 --emulate --batch-size 1366 --guard off --expect corrupted
if [ -n "${ROBERTA:-}" ]; then
  python3 benchmarks/gpu/random_roberta.py /tmp/roberta-random
  run roberta-random-emulated-2048 --emulate --batch-size 2048 --model /tmp/roberta-random --reference-device device --expect corrupted
fi
tar -czf $OUT/gpu-runs.tar.gz --exclude samples.jsonl --exclude report.html -C $runs .
ls -la $OUT
