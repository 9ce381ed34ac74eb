"""Summarises half-precision runs (issue 14): corrupted sets, the judging margins (clean texts' largest
difference from the same-dtype reference, corrupted texts' smallest), and peak memory against the
estimate. Usage: python benchmarks/gpu/half_summary.py RUN_FOLDER..."""

import json
import sys
from pathlib import Path

import numpy as np

from mpsimpact.runs.metrics import relative_error
from mpsimpact.prediction.memory import estimate_peak_bytes
from mpsimpact.prediction.demo_size import DTYPE_BYTES

for folder in map(Path, sys.argv[1:]):
    if not (folder / "report.json").is_file():
        continue
    report = json.loads((folder / "report.json").read_text())
    logits = np.load(folder / "logits.npz")
    g, conds = report["geometry"], {c["guard"]: c for c in report["conditions"]}
    off, first = logits["guard_off"], conds["off"]["first_corrupted_index"]
    err = relative_error(off, logits["reference"])
    clean_max = float(err[:first].max()) if first else float(err.max())
    corrupt_min = float(err[first:].min()) if first is not None else None
    chunk_max = float(relative_error(logits["guard_chunk"], logits["reference"]).max()) if "guard_chunk" in logits else None
    peak = max(c.get("peak_device_memory_gib", 0) for c in report["conditions"])
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=384, num_attention_heads=12, intermediate_size=1536, vocab_size=30522, num_hidden_layers=6)
    estimate = estimate_peak_bytes(config, g["batch_size"], g["max_length"], DTYPE_BYTES[g["dtype"]]) / 2**30
    print(json.dumps({
        "run": folder.name, "dtype": g["dtype"], "batch": g["batch_size"], "judged_against": report["reference"]["judged_against"],
        "threshold": report["reference"]["threshold"], "off": [conds["off"]["corrupted_count"], first], "raise": conds["raise"]["status"],
        "chunk_corrupted": conds["chunk"]["corrupted_count"], "clean_max_rel": clean_max, "corrupted_min_rel": corrupt_min,
        "chunk_max_rel": chunk_max, "flips_vs_fp32": conds["off"].get("flips_vs_fp32"), "peak_gib": peak, "estimate_gib": round(estimate, 1),
    }))
