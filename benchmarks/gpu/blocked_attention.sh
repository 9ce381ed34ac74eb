#!/usr/bin/env bash
# On the lent H200: blocked_eager at the 16 GB Mac's demo (issue 33). First the recommended command's forward
# per attention (benchmarks/blocked_attention.py): its peak beside the estimate, blocked_eager against eager
# bit for bit, and the emulated corruption of each at the same batch; then the command itself, emulated at
# full scale on the GPU (each condition's report entry carries its pass's peak_device_memory_gib).
# Run `bash benchmarks/gpu/prepare.sh` here first and carry .weights and .whl.
set -uo pipefail
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
start=$SECONDS
python3 benchmarks/blocked_attention.py --device cuda --memory 16GB --torch-profile 2.14.0 --out "$out" 2>&1 \
  | tee "$out/blocked_attention.txt"
echo "forwards: $((SECONDS - start)) s wall" | tee -a "$out/blocked_attention.txt"
command=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['command'])" "$out/blocked_attention.json")
start=$SECONDS
$command --device cuda --torch-profile 2.14.0 --reference-device device --out /tmp/blocked-16gb \
  > "$out/run-16gb.txt" 2>&1 || tail -5 "$out/run-16gb.txt"
echo "$command: $((SECONDS - start)) s wall" | tee -a "$out/run-16gb.txt"
cp /tmp/blocked-16gb/report.json "$out/run-16gb-report.json" 2>/dev/null
python3 - "$out/run-16gb-report.json" <<'PY' | tee -a "$out/run-16gb.txt"
import json, sys
report = json.load(open(sys.argv[1]))
for c in report["conditions"]:
    print(c["guard"], c["status"], "corrupted", c.get("corrupted_count"), "first", c.get("first_corrupted_index"),
          "peak", c.get("peak_device_memory_gib"), "GiB")
PY
