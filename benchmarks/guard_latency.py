"""Guard cost on latency-bound inference, as ratios measured in one run: the embedded classifier
(all-MiniLM-L6-v2 + head) on B texts x L tokens, plain vs guard "raise" (entry points, the default)
vs guard "raise" strict (the dispatch mode on every op: the route before issue 17).

Run: python benchmarks/guard_latency.py [--device cpu --threads 1 --shapes 1x16 --reps 30]
     python benchmarks/guard_latency.py --device cuda --shapes 8x128,64x128,512x128 --reps 30
Each condition's figure is the median of `reps` interleaved repetitions (order rotating), after
warm-up. On CUDA every repetition synchronises before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from mpsimpact.models.classifier import load_embedded_classifier
from mpsimpact.modes.guard import guard


def conditions(device: str) -> dict[str, object]:
    return {
        "off": contextlib.nullcontext,
        "raise": lambda: guard("raise", devices=(device,)),
        "raise_strict": lambda: guard("raise", devices=(device,), strict=True),
    }


def measure(module, ids, mask, device: str, reps: int) -> dict[str, float]:
    conds = conditions(device)
    names = list(conds)
    times: dict[str, list[float]] = {name: [] for name in names}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(5):
            module(ids, mask)
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                with conds[name]():
                    sync()
                    start = time.perf_counter()
                    module(ids, mask)
                    sync()
                    times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shapes", default="1x16")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_embedded_classifier()
    module = model.module.to(args.device)
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads")
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        ids = torch.randint(1000, 20000, (batch, length), device=args.device)
        mask = torch.ones_like(ids)
        med = measure(module, ids, mask, args.device, args.reps)
        print(f"{batch} x {length}: off {med['off'] * 1e3:.2f} ms; guard raise {med['raise'] * 1e3:.2f} ms "
              f"({med['raise'] / med['off']:.3f}x); strict (dispatch on every op) {med['raise_strict'] * 1e3:.2f} ms "
              f"({med['raise_strict'] / med['off']:.3f}x)")


if __name__ == "__main__":
    main()
