"""Wall time of `mpsimpact run retrieval` against `mpsimpact run sentiment` at the same batch, as a
ratio measured in one run.

Run: python benchmarks/retrieval_speed.py [--batch 4096] [--keep DIR]
Runs both commands back to back in subprocesses, each with a fresh, empty MPSIMPACT_CACHE (so
both compute their CPU reference), and prints each wall time and retrieval / sentiment. With
--keep, the two report folders are left in DIR (DIR/sentiment, DIR/retrieval) for inspection.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def command_seconds(scenario: str, batch: int, out: Path) -> float:
    cache = tempfile.mkdtemp(prefix=f"mpsimpact-cache-{scenario}-")
    start = time.perf_counter()
    subprocess.run(
        ["mpsimpact", "run", scenario, "--batch-size", str(batch), "--out", str(out / scenario)],
        check=True, env={**os.environ, "MPSIMPACT_CACHE": cache, "HF_HUB_OFFLINE": "1"}, capture_output=True,
    )
    elapsed = time.perf_counter() - start
    shutil.rmtree(cache)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--keep", default=None, help="Leave the report folders here.")
    args = parser.parse_args()
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp())
    sentiment = command_seconds("sentiment", args.batch, out)
    retrieval = command_seconds("retrieval", args.batch, out)
    if not args.keep:
        shutil.rmtree(out)
    print(f"batch {args.batch}, fresh reference caches: sentiment {sentiment:.1f}s, retrieval {retrieval:.1f}s, "
          f"retrieval / sentiment = {retrieval / sentiment:.2f}x")


if __name__ == "__main__":
    main()
