#!/usr/bin/env bash
# On the lent H200: long context (issue 25) and the guard's latency after it.
#   bash benchmarks/gpu/long_context.sh 70k      # acceptance run: 70,000 tokens, one head's scores > 2**32
#   bash benchmarks/gpu/long_context.sh ratios   # 8k/16k/32k bf16: median times, ratios to eager, peaks
#   bash benchmarks/gpu/long_context.sh memory   # issue 36: 8k/16k/32k/64k bf16, 4 query / 2 kv heads: peaks
#                                                #   and times of eager, mps_safe_eager, guard chunk, sdpa
#   bash benchmarks/gpu/long_context.sh latency  # guard latency (needs prepare.sh here; carry .weights, .whl)
#   bash benchmarks/gpu/long_context.sh all
# On the H200 (2026-12-01) the 70k run took 17 s, the ratios 25 s, the latency about 35 s with setup (figures:
# benchmarks/README.md, "Long context (issue 25)"; outputs: gpu/results/long-context, guard-latency).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
what=${1:-all}
if [[ $what == 70k || $what == all ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
  start=$SECONDS
  PYTHONPATH=src python3 benchmarks/long_context.py --device cuda --check-70k \
    --json "$out/long_context_70k.json" 2>&1 | tee "$out/long_context_70k.txt"
  echo "70k: $((SECONDS - start)) s wall" | tee -a "$out/long_context_70k.txt"
fi
if [[ $what == ratios || $what == all ]]; then
  start=$SECONDS
  PYTHONPATH=src python3 benchmarks/long_context.py --device cuda --lengths 8192,16384,32768 --reps 5 \
    --dtype bfloat16 --json "$out/long_context_ratios.json" 2>&1 | tee "$out/long_context_ratios.txt"
  echo "ratios: $((SECONDS - start)) s wall" | tee -a "$out/long_context_ratios.txt"
fi
if [[ $what == memory || $what == all ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
  start=$SECONDS
  PYTHONPATH=src python3 benchmarks/long_context.py --device cuda --lengths 8192,16384,32768,65536 --reps 3 \
    --heads 4 --kv-heads 2 --dtype bfloat16 --json "$out/long_context_memory.json" 2>&1 \
    | tee "$out/long_context_memory.txt"
  echo "memory: $((SECONDS - start)) s wall" | tee -a "$out/long_context_memory.txt"
fi
if [[ $what == latency || $what == all ]]; then
  (source benchmarks/gpu/setup.sh \
    && python3 benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30) 2>&1 \
    | tee "$out/guard_latency.txt"
fi
