"""transformers' own model tests (the ModelTesterMixin suites) through mpsimpact's pytest plugin (issues 46 and 50):
each suite run plain and under each guard mode, every test's outcome compared with the plain run's, and the wall
and CPU time of `--mps-guard raise` against plain's run of the same round (median of --rounds).

Run: python benchmarks/transformers_suites.py --tests /path/to/transformers/tests [--suites bert,llama]
     [--modes plain,raise,chunk,strict-raise,strict-chunk] [--rounds 3] [--threads 1] [--index-bits 12]
Each run is `python -m pytest tests/models/<suite>/test_modeling_<suite>.py` in a subprocess (the tree's own
pyproject as its configuration, HF_HUB_OFFLINE=1: the Hub's tests skip), with the plugin's options for the mode:
raise and chunk are `--mps-guard MODE --mps-profile RELEASE`, strict-raise and strict-chunk add `--mps-strict`. The
plugin judges CPU tensors where there is no Apple GPU, so every call of every test is judged. Prints each run's
counts (pytest's summary line, subtests included), every test whose outcome differs from plain (exit code 1 if
any), and the ratios of the --timed modes (default raise; emulate is `--mps-emulate --mps-profile RELEASE`).
Targets: no outcome changes under the guard modes; raise at most 1.10x plain's wall time; emulate at most 1.2x
plain's CPU time (at MPS's width, where the suites cross no limit, the emulator changes no outcome either).

The tree. transformers' wheel has no tests, its sdist only the shared ones; the model files come from the
repository. For transformers X.Y.Z:
    pip download transformers==X.Y.Z --no-binary :all: --no-deps; tar xzf transformers-X.Y.Z.tar.gz
    cd transformers-X.Y.Z   # tests/test_modeling_common.py, test_configuration_common.py, test_pipeline_mixin.py
    mv src/transformers ../sdist-src-transformers  # the sdist's own copy: the installed package stands there
    ln -s "$(python -c 'import transformers, os; print(os.path.dirname(transformers.__file__))')" src/transformers
then from the repository at tag vX.Y.Z: tests/__init__.py (empty), tests/causal_lm_tester.py,
tests/generation/test_utils.py, tests/exporters/test_export.py, tests/utils/test_configuration_utils.py,
tests/utils/tiny_model_summary.json and tests/models/{bert,llama,...}/ (each with an empty __init__.py).
Install `parameterized`. Where the tag's files are not at hand, a nearby commit's with the smallest edits does;
GenerationTesterMixin and ExportTesterMixin may be empty classes (this script is about ModelTesterMixin; every
export test is @slow anyway) and tiny_model_summary.json `{}` (the pipeline tests then skip, as they do offline).
benchmarks/README.md says which files the recorded run used.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

MODES = {  # name -> the plugin's options (with --mps-profile RELEASE added to each but plain)
    "plain": [],
    "raise": ["--mps-guard", "raise"],
    "chunk": ["--mps-guard", "chunk"],
    "strict-raise": ["--mps-guard", "raise", "--mps-strict"],
    "strict-chunk": ["--mps-guard", "chunk", "--mps-strict"],
    "emulate": ["--mps-emulate"],
}
COUNTED = ("passed", "failed", "errors", "skipped")


def pytest_argv(tests: Path, suite: str, mode: str, args: argparse.Namespace, junit: Path) -> list[str]:
    """The command line of one run: the suite's file, quiet, a JUnit XML of every test's outcome."""
    argv = [sys.executable, "-m", "pytest", str(tests / "models" / suite / f"test_modeling_{suite}.py"), "-q",
            "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning", f"--junitxml={junit}"]
    if mode != "plain":
        if not any(ep.value.startswith("mpsimpact") for ep in metadata.entry_points(group="pytest11")):
            argv += ["-p", "mpsimpact.pytest_plugin"]  # importable but not installed: load the plugin by name
        argv += [*MODES[mode], "--mps-profile", args.profile]
        if args.index_bits:
            argv += ["--mps-index-bits", str(args.index_bits)]
    return argv


def run_once(argv: list[str], root: Path, threads: int) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, pytest's last summary line)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True,
                          env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                            "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in done.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    if done.returncode not in (0, 1) or not lines:
        sys.exit(f"pytest exited {done.returncode} without a summary: {' '.join(argv)}\n{done.stdout[-3000:]}"
                 f"{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), lines[-1].strip("= ")


def outcomes(junit: Path) -> dict[str, str]:
    """{test id: passed | failed | error | skipped} from a JUnit XML."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(kinds[0], kinds[0]) \
            if kinds else "passed"
    return found


def counts(summary: str) -> dict[str, int]:
    """passed/failed/errors/skipped (tests and subtests together) from pytest's summary line."""
    found = {word: 0 for word in COUNTED}
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary.split(" in ")[0]):
        found["errors" if word.startswith("error") else word] += int(number)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", type=Path, required=True, help="transformers' tests folder, assembled as above.")
    parser.add_argument("--suites", default="bert,llama", help="Model folders under tests/models, comma-separated.")
    parser.add_argument("--modes", default="plain,raise,chunk,strict-raise", help=f"Of {', '.join(MODES)}.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of plain and the timed modes, interleaved.")
    parser.add_argument("--timed", default="raise", help="The modes timed against plain in every round, "
                        "comma-separated (e.g. raise,emulate).")
    parser.add_argument("--profile", default="2.14.0", help="The release whose faults the guard judges.")
    parser.add_argument("--index-bits", type=int, default=None, help="The plugin's --mps-index-bits (default: "
                        "MPS's width): at 12 the suites' calls cross the scaled limits, so chunk splits them.")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads in each run (OMP_NUM_THREADS): "
                        "with one, CPU time counts the work, not threads spinning for a core on a shared machine.")
    parser.add_argument("--out", type=Path, default=Path("transformers-suites"), help="Where the JUnit XMLs go.")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "plain" not in modes:
        sys.exit(f"--modes takes plain and any of {', '.join(MODES)}; got {args.modes!r}.")
    tests = args.tests.resolve()
    args.out = args.out.resolve()  # the suites run in the tree's folder: the XMLs' path must not depend on it
    args.out.mkdir(parents=True, exist_ok=True)
    # Round 0 runs every mode once (outcomes); later rounds only plain and the timed modes (times), in reverse
    # order every other round, so none always runs first.
    timed = [m for m in ("plain", *args.timed.split(",")) if m in modes]
    schedule = [(r, suite, mode) for r in range(args.rounds) for suite in args.suites.split(",")
                for mode in (modes if r == 0 else timed if r % 2 == 0 else timed[::-1])]
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    summaries: dict[tuple[str, str], str] = {}
    for round_, suite, mode in schedule:
        junit = args.out / f"{suite}-{mode}-{round_}.xml"
        seconds, cpu_seconds, summary = run_once(pytest_argv(tests, suite, mode, args, junit), tests.parent,
                                              args.threads)
        wall.setdefault((suite, mode), []).append(seconds)
        cpu.setdefault((suite, mode), []).append(cpu_seconds)
        summaries.setdefault((suite, mode), summary)
        print(f"round {round_} {suite} {mode}: {seconds:.1f} s wall, {cpu_seconds:.1f} s CPU: {summary}", flush=True)
    report(args, modes, wall, cpu, summaries)


def report(args: argparse.Namespace, modes: list[str], wall: dict, cpu: dict, summaries: dict) -> None:
    import torch
    import transformers

    print(f"\ntorch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} cores; "
          f"{args.threads} torch thread(s); rules of {args.profile} at {args.index_bits or 32} bits; times: medians of "
          f"{args.rounds} rounds, each running plain and {args.timed} back to back")
    differing = 0
    for suite in args.suites.split(","):
        plain = outcomes(args.out / f"{suite}-plain-0.xml")
        for mode in modes:
            got = outcomes(args.out / f"{suite}-{mode}-0.xml")
            changed = sorted(t for t in plain.keys() | got.keys() if plain.get(t) != got.get(t))
            differing += len(changed)
            c = counts(summaries[(suite, mode)])
            print(f"{suite:8s} {mode:13s} " + ", ".join(f"{c[k]} {k}" for k in COUNTED)
                  + f"; {len(got)} tests, {len(changed)} outcome(s) differ from plain" + times(wall, cpu, suite, mode))
            for test in changed:
                print(f"    {test}: plain {plain.get(test)}, {mode} {got.get(test)}")
    sys.exit(1 if differing else 0)


def times(wall: dict, cpu: dict, suite: str, mode: str) -> str:
    """'; wall 81.2 s, 1.031x (0.89x .. 1.13x), CPU ...' for a mode timed in every round: its median, and the
    median and range of its ratios to plain's run of the same round (the two ran back to back, so a load that
    drifts over the rounds cancels)."""
    if len(wall[(suite, mode)]) < 2:
        return ""
    if mode == "plain":
        return f"; wall {statistics.median(wall[(suite, mode)]):.1f} s, CPU {statistics.median(cpu[(suite, mode)]):.1f} s"
    words = []
    for name, seconds in (("wall", wall), ("CPU", cpu)):
        ratios = [own / plain for own, plain in zip(seconds[(suite, mode)], seconds[(suite, "plain")], strict=True)]
        words.append(f"{name} {statistics.median(seconds[(suite, mode)]):.1f} s, {statistics.median(ratios):.3f}x "
                     f"({min(ratios):.2f}x .. {max(ratios):.2f}x)")
    return "; " + ", ".join(words)


if __name__ == "__main__":
    main()
