"""Compares a full-scale GPU run with the scaled CPU run of the same texts, text by text.

Run: python benchmarks/gpu/compare.py GPU_RUN_DIR CPU_RUN_DIR
Both folders come from `mpsimpact run sentiment` with the same --batch-size (and the same weights).
Prints, per guard condition present in both: the corrupted sets (each against its own reference)
and whether they are identical, and the largest logit difference between the two devices, over
the texts the scaled run saw whole: it leaves out texts the reduced length truncated, and texts
whose wrapped rows read a truncated text (batch-head j reads j mod 2**32/L**2 at both scales).
"""

import json
import sys
from pathlib import Path

import numpy as np


def load(folder: Path):
    report = json.loads((folder / "report.json").read_text())
    return report, np.load(folder / "logits.npz")


def affected_by_truncation(report: dict, heads: int = 12) -> set[int]:
    truncated = set(report["tokens"]["truncated_by_reduced_length"])
    period = 2**32 // report["geometry"]["max_length"] ** 2
    batch = report["geometry"]["batch_size"]
    affected = set(truncated)
    for text in range(batch):
        sources = {((text * heads + h) % period) // heads for h in range(heads) if text * heads + h >= period}
        if sources & truncated:
            affected.add(text)
    return affected


def main() -> None:
    gpu_dir, cpu_dir = map(Path, sys.argv[1:3])
    (gpu_report, gpu), (cpu_report, cpu) = load(gpu_dir), load(cpu_dir)
    threshold = gpu_report["config"]["threshold"]
    print(f"GPU: {gpu_report['geometry']['mode']} | CPU: {cpu_report['geometry']['mode']}")
    ref_diff = np.abs(gpu["reference"] - cpu["reference"]).max()
    print(f"references (CPU fp32 at 512 vs at {cpu_report['geometry']['run_length']} tokens): max |diff| {ref_diff:.2e}")
    skip = affected_by_truncation(cpu_report)
    keep = np.array([i for i in range(len(cpu["reference"])) if i not in skip])
    print(f"left out of the logit comparison: {len(skip)} texts touched by the reduced length's truncation")
    for key in sorted(set(gpu.files) & set(cpu.files)):
        if not key.startswith("guard_"):
            continue
        sets = []
        for data in (gpu, cpu):
            err = np.abs(data[key] - data["reference"]).max(axis=1) / np.abs(data["reference"]).max(axis=1)
            sets.append(set(np.flatnonzero(err > threshold).tolist()))
        diff = np.abs(gpu[key][keep] - cpu[key][keep])
        scale = np.abs(cpu[key][keep]).max()
        flips = int((gpu[key][keep].argmax(1) != cpu[key][keep].argmax(1)).sum())
        print(f"{key}: corrupted GPU {len(sets[0])} (first {min(sets[0], default=None)}), CPU {len(sets[1])} "
              f"(first {min(sets[1], default=None)}), identical sets: {sets[0] == sets[1]}; "
              f"max |logit diff| {diff.max():.2e} (relative {diff.max() / scale:.2e}); predictions differing: {flips}")


if __name__ == "__main__":
    main()
