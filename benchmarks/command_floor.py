"""check and plan against their import floor, measured in one run (issue 35): each command's CPU time (user
+ sys of its process) beside the CPU time of a process that only imports torch and transformers with the
model class the command builds, interleaved, each figure the median of --rounds. The difference is the
command's own work: tracing, scaling, the tables.

Run: python benchmarks/command_floor.py [--rounds 5]
Targets: check <= floor + 2 s (bert-base, a Llama-shaped config), plan sentiment <= floor + 1.5 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
CASES = {  # name -> (the command, the import floor of the model class it builds, the allowance in s)
    "check bert-base": (["check", str(DATA / "bert-base" / "config.json"), "--batch-size", "2048"],
                        "BertForSequenceClassification", 2.0),
    "check llama-style-32k": (["check", str(DATA / "llama-style-32k" / "config.json"), "--seq-len", "16384"],
                              "LlamaForCausalLM", 2.0),
    "plan sentiment": (["plan", "sentiment"], "BertModel", 1.5),
}


def cpu_seconds(argv: list[str]) -> float:
    """User + system CPU seconds of one child process (its own and its children's)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    command = shutil.which("mpsimpact") or sys.exit("mpsimpact is not on PATH")
    times: dict[str, dict[str, list[float]]] = {name: {"floor": [], "command": []} for name in CASES}
    for _ in range(args.rounds):
        for name, (words, model_class, _) in CASES.items():
            floor = f"import torch, transformers; from transformers import AutoConfig, {model_class}"
            times[name]["floor"].append(cpu_seconds([sys.executable, "-c", floor]))
            times[name]["command"].append(cpu_seconds([command, *words]))
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; median of {args.rounds} interleaved rounds")
    for name, (_, _, allowance) in CASES.items():
        floor, own = (statistics.median(times[name][k]) for k in ("floor", "command"))
        verdict = "within" if own - floor <= allowance else "OVER"
        print(f"{name}: {own:.2f} s CPU against the import floor's {floor:.2f} s: +{own - floor:.2f} s "
              f"({verdict} the +{allowance:g} s target)")


if __name__ == "__main__":
    main()
