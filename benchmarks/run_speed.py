"""Speed of the main command, as ratios measured in one run.

Run: python benchmarks/run_speed.py [--batch 4096] [--torch-profile 2.14.0]
Measures, in this order: a plain eager forward pass of the same texts as one batch at the same
length the command runs at (no emulation, no guard), warmed up first (the first pass pays for
allocations and kernel selection: 116 s cold vs about 63 s warm on the 2-core CPU), the median of
`--passes`; the whole `mpsimpact run sentiment` command in a subprocess with an empty reference
cache (start-up, three guard conditions, reference, reports); the same command again with the
reference cached. Prints both ratios to the warmed pass.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time

import torch


def plain_forward_seconds(batch: int, passes: int) -> tuple[float, int]:
    from mpsimpact.models.classifier import load_embedded_classifier
    from mpsimpact.models.dataset import load_embedded
    from mpsimpact.runs.device_pass import REDUCED_LENGTH, Geometry, build_batch, tokenize

    model = load_embedded_classifier()
    data = load_embedded("heldout")
    texts, _, _ = build_batch(data.texts, data.labels, batch)
    geometry = Geometry("cpu", False, batch, 512, REDUCED_LENGTH)
    inputs, _ = tokenize(model.tokenizer, texts, geometry)
    times = []
    with torch.inference_mode():
        model.module(**inputs)  # warm-up
        for _ in range(passes):
            start = time.perf_counter()
            model.module(**inputs)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], geometry.run_length


def command_seconds(batch: int, cache: str, profile: str) -> float:
    out = tempfile.mkdtemp()
    start = time.perf_counter()
    subprocess.run(
        ["mpsimpact", "run", "sentiment", "--batch-size", str(batch), "--device", "cpu", "--torch-profile", profile,
         "--out", f"{out}/run"],
        check=True, env={**__import__("os").environ, "MPSIMPACT_CACHE": cache}, capture_output=True,
    )
    elapsed = time.perf_counter() - start
    shutil.rmtree(out)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--passes", type=int, default=3, help="Warmed plain passes; the median is the baseline.")
    parser.add_argument("--torch-profile", default="2.14.0", help="The published demo's release: off and chunk "
                        "run every layer (under 2.13.0 the unguarded pass aborts in layer 0, which is cheaper).")
    args = parser.parse_args()
    plain, length = plain_forward_seconds(args.batch, args.passes)
    cache = tempfile.mkdtemp()
    cold = command_seconds(args.batch, cache, args.torch_profile)
    warm = command_seconds(args.batch, cache, args.torch_profile)
    shutil.rmtree(cache)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, run length {length}, "
          f"rules of {args.torch_profile}, on the CPU")
    print(f"plain forward (warmed, median of {args.passes}) {plain:.1f}s; command cold {cold:.1f}s "
          f"({cold / plain:.2f}x); command with cached reference {warm:.1f}s ({warm / plain:.2f}x)")


if __name__ == "__main__":
    main()
