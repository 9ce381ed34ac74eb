"""The median of each ratio of guard_latency.py's runs, per code, from a log of runs headed `== CODE, round N`
(benchmarks/gpu/issue61.sh writes one): raise, strict and the two floors over off, and off itself.

Run: python benchmarks/gpu/latency_medians.py guard_latency.txt
"""

from __future__ import annotations

import collections
import re
import statistics
import sys

# "guard raise 3.10 ms (1.061x)", "strict (dispatch on every op) 6.60 ms (2.229x)", ... in one result line.
COLUMNS = {"raise": r"guard raise [\d.]+ ms \(([\d.]+)x\)", "strict": r"strict \(dispatch on every op\) [\d.]+ ms "
           r"\(([\d.]+)x\)", "floor": r"only runs each op [\d.]+ ms \(([\d.]+)x\)",
           "bare floor": r"without Dynamo's wrapper [\d.]+ ms \(([\d.]+)x\)", "off ms": r": off ([\d.]+) ms"}


def medians(lines: list[str]) -> dict[str, dict[str, tuple[float, list[float]]]]:
    """code -> column -> (median, every run's value), in the order the runs came."""
    runs: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    code = None
    for line in lines:
        head = re.match(r"== (\w+), round \d+", line)
        if head:
            code = head.group(1)
            continue
        if code is None or " x " not in line or ": off " not in line:
            continue
        for column, pattern in COLUMNS.items():
            found = re.search(pattern, line)
            if found:
                runs[code][column].append(float(found.group(1)))
    return {code: {column: (statistics.median(values), values) for column, values in columns.items()}
            for code, columns in runs.items()}


def main() -> None:
    with open(sys.argv[1]) as log:
        found = medians(log.read().splitlines())
    for code, columns in found.items():
        print(f"{code}: " + "; ".join(f"{column} {median:.3f} ({', '.join(f'{v:.3f}' for v in values)})"
                                      for column, (median, values) in columns.items()))


if __name__ == "__main__":
    main()
