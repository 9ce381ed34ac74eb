#!/usr/bin/env bash
# On the lent H200's host CPU (16 cores, nobody else on it): benchmarks/run_speed.py, the main command
# against a warmed plain pass, as ratios measured in one run (the GPU is not used).
source benchmarks/gpu/setup.sh
out=${OUT:-/tmp/out}
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)" | tee "$out/cpu.txt"
python3 benchmarks/run_speed.py --batch 4096 --passes 3 2>&1 | tee "$out/run_speed.txt"
