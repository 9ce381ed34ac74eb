#!/usr/bin/env bash
# The op-level sweep at full 32-bit scale on one CUDA GPU: the control (no emulation: every cell
# should be ok) and the emulator (every cell should agree with the fault model); and, with
# ROBERTA=1, the sentiment run on a RoBERTa-base-shaped model with random weights.
source benchmarks/gpu/setup.sh
if [ -n "${ROBERTA:-}" ]; then
  python3 benchmarks/gpu/random_roberta.py /tmp/roberta-random
  timeout 200 mpsimpact run sentiment --device cuda --emulate --max-length 512 --batch-size 2048 --model /tmp/roberta-random \
    --reference-device device --out /tmp/roberta-run --expect corrupted 2>&1 | tail -22
  tar -czf $OUT/roberta-run.tar.gz --exclude samples.jsonl --exclude report.html -C /tmp/roberta-run .
fi
timeout ${SWEEP_TIMEOUT:-180} mpsimpact sweep --device cuda --no-emulate --quick --out $OUT/sweep-cuda-control 2>&1 | tail -30 || true
timeout ${SWEEP_TIMEOUT:-180} mpsimpact sweep --device cuda --emulate --quick --out $OUT/sweep-cuda-emulated 2>&1 | tail -30 || true
