#!/usr/bin/env bash
# On the lent H200, after issue 21 (every op family): the emulated 22000 x 128 run under each guard
# condition (the FFN's first Linear takes a > 2**32-element input from 2.8.0: off aborts, raise stops,
# chunk splits every faulting call and stays clean), the published 4096 x 512 demo under 2.14.0 (2731 texts
# from 1365), the same under 2.13.0 (the scale on the scores aborts, inferred), and the guard's latency.
#   bash benchmarks/gpu/issue21.sh   (needs prepare.sh here; carry .weights and .whl)
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
runs=/tmp/gpu-runs
mkdir -p "$runs" "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
run() {  # name, then mpsimpact run flags
  local name=$1; shift
  /usr/bin/env time -f "$name wall %e s, max RSS %M KB" mpsimpact run sentiment --device cuda --emulate \
    --out "$runs/$name" "$@" 2>&1 | tail -30 | tee "$out/$name.txt"
}
run ffn-22000x128-2.14.0 --batch-size 22000 --max-length 128 --torch-profile 2.14.0 --reference-device device
run ffn-22000x128-2.7.1 --batch-size 22000 --max-length 128 --torch-profile 2.7.1 --guard off --reference-device device
run demo-4096-2.14.0 --batch-size 4096 --torch-profile 2.14.0 --expect corrupted
run demo-4096-2.13.0 --batch-size 4096 --torch-profile 2.13.0 --guard all
python3 benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30 2>&1 \
  | tee "$out/guard_latency.txt"
tar -czf "$out/issue21-runs.tar.gz" --exclude samples.jsonl --exclude report.html --exclude '*.npz' -C "$runs" .
ls -la "$out"
