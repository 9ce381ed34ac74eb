"""Command options: each config field declares its check once, and every command's config is validated
the same way, before anything is loaded. Options several commands share are defined here once."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

from mpsimpact.bounds import DIGITS, read_decimal, read_release, read_size, read_whole
from mpsimpact.engine.faults import INDEX_BITS_RANGE, MPS_INDEX_BITS
from mpsimpact.errors import UsageError
from mpsimpact.variables import MAX_BYTES

# A sample is corrupted above this relative error against the reference (the study's criterion).
CORRUPTION_THRESHOLD = 1e-3
GRADIENT_THRESHOLD = CORRUPTION_THRESHOLD  # a gradient tensor is wrong above it, as a text is
DEVICES = ("auto", "mps", "cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class Check:
    """How one option's value is checked: a numeric range, or a set of choices (for each element
    of a tuple value, too). None values are left alone (an option not given). A number typed on the command
    line is read by `read` (`number`: int or float; Note [Numbers typed by a user] in bounds)."""

    flag: str
    low: float | None = None
    high: float | None = None
    inclusive: bool = True
    choices: tuple[str, ...] | None = None
    hint: str = ""
    parse: Callable[[Any], Any] | None = None  # raises ValueError on a bad value
    ceiling: float | None = None  # past any real value (INT_MAX texts): said only to a value above it
    number: type | None = None  # int or float: how `read` reads the option's text

    def read(self, text: str) -> Any:
        """The value of the option's text as typed: a number read by the one rule (bounds.read_whole,
        read_decimal), checked; any other option's text as it is.

        Raises:
            UsageError: one line naming the flag, the text and what is expected.
        """
        if self.number is None or not isinstance(text, str):
            return text
        try:
            value = read_whole(text) if self.number is int else read_decimal(text)
        except ValueError:
            what = "a whole number" if self.number is int else "a number"
            example = "" if self.number is int else " (such as 0.5 or 1e-4)"
            raise UsageError(f"{self.flag} must be {what} {self._expected()}{self.hint}, written with {DIGITS}"
                             f"{example}, got {_shown(text)!r}.", option=self.flag) from None
        self(value, shown=text)
        return value

    def __call__(self, value: Any, shown: str | None = None) -> None:
        if value is None:
            return
        if self.parse is not None:
            try:
                self.parse(value)
            except ValueError as error:
                raise UsageError(f"{self.flag}: {error}{self.hint}.", option=self.flag) from None
            return
        if self.choices is not None:
            for item in value if isinstance(value, tuple) else (value,):
                if item not in self.choices:
                    raise UsageError(f"{self.flag} must be one of {', '.join(self.choices)}; got '{item}'.",
                                     option=self.flag)
            return
        shown = _shown(value if shown is None else shown)
        if not self._in_range(value):
            finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
            raise UsageError(f"{self.flag} must be {finite}{self._expected()}{self.hint}, got {shown}.",
                             option=self.flag)
        if self.ceiling is not None and value > self.ceiling:
            raise UsageError(f"{self.flag} must be <= {_number(self.ceiling)}{self.hint}, got {shown}.",
                             option=self.flag)

    def _in_range(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False  # nan compares false, inf passes an open bound: neither is a setting
        if self.inclusive:
            return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        return (self.low is None or value > self.low) and (self.high is None or value < self.high)

    def _expected(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is None and self.high is None:
            return ""
        if self.high is None:
            return f"{'>=' if self.inclusive else '>'} {low}"
        return f"in {low}..{high}" if self.inclusive else f"in ({low}, {high})"


def _number(value: float | None) -> str:
    """A bound as the messages write it: 32, 0.001, 2,147,483,647 (not 2.14748e+09)."""
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return f"{value:g}" if value is not None else ""


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}…{text[-8:]} ({len(text):,} characters)"


def option(default: Any, check: Check) -> Any:
    """A config dataclass field whose value `validate` checks with `check`."""
    return dataclasses.field(default=default, metadata={"check": check})


class Validated:
    """A command's config dataclass: `validate()` runs every field's `Check`."""

    def validate(self) -> None:
        """Raises UsageError (one line, naming the flag, the value and what is expected) on the first bad value,
        before anything is loaded."""
        for field in dataclasses.fields(self):
            check = field.metadata.get("check")
            if check is not None:
                check(getattr(self, field.name))


class TakesMemory(Validated):
    """A command's config with --memory: its `memory` field is the text given ("16GB", "auto"), as its reports
    show it; the Mac that text names is read once, into `mac`, and every room takes that value."""

    @functools.cached_property
    def mac(self) -> Any:
        """The Mac --memory names (an engine.mac_memory.MacMemory; None: no --memory), read once per config:
        a size where the config is validated, auto (this Mac's own, measured on it) where first asked for."""
        from mpsimpact.engine.mac_memory import resolve_mac
        from mpsimpact.engine.release import cache_root
        from mpsimpact.variables import high_watermark_ratio

        mac = resolve_mac(self.memory, cache_root())  # with the high watermark this process would have
        return None if mac is None else dataclasses.replace(mac, watermark_ratio=high_watermark_ratio())

    def validate(self) -> None:
        """Raises UsageError on any bad value, before anything is loaded: each field's Check, then --memory."""
        from mpsimpact.engine.mac_memory import is_auto

        super().validate()
        if self.memory is not None and not is_auto(self.memory):
            _ = self.mac  # read here, once: a size that is no Mac's is refused before any work


# Counts (texts, tokens) stop at INT_MAX: past it no run, trace or disk could hold one text's activations, and the
# numbers stay within what torch's shapes and int64 products take. A seed is what torch.manual_seed takes.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**64 - 1
MAX_STEPS = 1000  # optimiser steps on one oversized batch (the demo takes 1; each is a full pass)
SEED = Check("--seed", low=0, ceiling=MAX_SEED, hint=" (what torch.manual_seed takes)", number=int)


def count(flag: str) -> Check:
    """A count of texts or tokens typed as an option: a whole number from 1 to MAX_COUNT."""
    return Check(flag, low=1, ceiling=MAX_COUNT, number=int)


BATCH_SIZE = count("--batch-size")
MAX_LENGTH = count("--max-length")
INDEX_BITS = Check("--index-bits", *INDEX_BITS_RANGE, hint=f" ({MPS_INDEX_BITS} is MPS)", number=int)
DEVICE = Check("--device", choices=DEVICES)


def _parse_profile(value: str) -> None:
    from mpsimpact.engine.release import CONSERVATIVE, is_profile_path, parse_release

    if value != CONSERVATIVE and not is_profile_path(value):
        parse_release(value)  # its form alone: a profile file is read where the command judges the release


TORCH_PROFILE = Check(
    "--torch-profile", parse=_parse_profile,
    hint="; give a release such as 2.12.1 (measured: 2.4.1 .. 2.14.0; others are judged conservatively), "
         "'conservative', or a profile.json written by `mpsimpact sweep`",
)


# Each command's config: what it was asked, embedded in its reports. They live here, with no torch
# import, so that `mpsimpact COMMAND --help` shows their defaults in a fraction of a second.
GUARDS = ("off", "raise", "chunk")
# `run --attention`: transformers' names (blocked_attention.NAME is "blocked_eager"); both: eager and sdpa.
RUN_ATTENTIONS = ("eager", "sdpa", "both", "blocked_eager")
# The sizes `run --quick` sets when they are not given (RunConfig.quick_sizes), and may choose for the model: the
# batch up to QUICK_BATCH_FACTOR times the one it set (prediction.demo_size.quick_geometry).
QUICK_SIZES = ("batch_size", "max_length", "index_bits")
QUICK_BATCH_FACTOR = 2
# Half precision: a text is corrupted above this relative difference from the same-dtype,
# small-batch reference (see docs and benchmarks/README.md for the measured margins).
HALF_THRESHOLD = 2e-2


@dataclasses.dataclass(frozen=True)
class RunConfig(TakesMemory):
    """Everything `mpsimpact run` was asked; embedded in every report."""

    scenario: str = "sentiment"
    batch_size: int | None = option(None, BATCH_SIZE)
    steps: int = option(1, Check("--steps", low=1, ceiling=MAX_STEPS, number=int))
    lr: float = option(1e-4, Check("--lr", low=0, inclusive=False, number=float))
    max_length: int | None = option(None, MAX_LENGTH)
    device: str = option("auto", DEVICE)
    emulate: bool | None = None
    guard: str = option("all", Check("--guard", choices=(*GUARDS, "all")))
    out: str | None = None
    seed: int = option(0, SEED)
    expect: str | None = option(None, Check("--expect", choices=("clean", "corrupted")))
    model: str | None = None
    dataset: str | None = None
    threshold: float = option(CORRUPTION_THRESHOLD, Check("--threshold", 0, 1, inclusive=False, number=float))
    reference_device: str = option("cpu", Check("--reference-device", choices=("cpu", "device")))
    run_length: int | None = option(None, count("--run-length"))
    index_bits: int = option(MPS_INDEX_BITS, INDEX_BITS)
    torch_profile: str | None = option(None, TORCH_PROFILE)
    attention: str = option("eager", Check("--attention", choices=RUN_ATTENTIONS))
    dtype: str = option("float32", Check("--dtype", choices=("float32", "float16", "bfloat16")))
    memory: str | None = None  # a Mac to emulate ("16GB"): its largest buffer stops calls too (`mac`)
    # --quick: the sizes it set because they were not given (QUICK_SIZES); where they show no silent effect for
    # the model, the run chooses them (runs.runner.quick_config) and says so
    quick_sizes: tuple[str, ...] = option((), Check("--quick", choices=QUICK_SIZES))

    def validate(self) -> None:
        """Raises UsageError on any bad value, before anything is loaded: each field, --run-length against
        --max-length, and --expect, which judges the guard-off condition, against --guard."""
        super().validate()
        check_run_length(self.run_length, self.max_length)
        if self.expect is not None and "off" not in self.guards:
            raise UsageError(f"--expect judges the guard-off condition, which --guard {self.guard} does not run; "
                             "give --guard off or all, or drop --expect.", option="--expect")

    def plan_command(self, *options: str) -> str:
        """The `mpsimpact plan` command for this run's scenario and model, with `options` ("--memory", "auto"):
        a command the run recommends plans the model it ran."""
        import shlex

        model = ("--model", self.model) if self.model else ()
        return shlex.join(("mpsimpact", "plan", self.scenario, *model, *options))

    @property
    def corruption_threshold(self) -> float:
        """fp32: --threshold against the CPU fp32 reference. Half precision: against a same-dtype
        reference, at least HALF_THRESHOLD (kernel-order rounding of clean texts stays below it)."""
        return self.threshold if self.dtype == "float32" else max(self.threshold, HALF_THRESHOLD)

    @property
    def guards(self) -> tuple[str, ...]:
        return GUARDS if self.guard == "all" else (self.guard,)

    @property
    def attentions(self) -> tuple[str, ...]:
        return ("eager", "sdpa") if self.attention == "both" else (self.attention,)

    def written_bytes(self) -> int:
        """At most what the report folder will hold, checked against the free space before any work: pages
        and figures (REPORT_BYTES), and per text and condition a samples.jsonl line and its logits (about
        0.5 KiB measured; TEXT_BYTES). A batch size left to the scenario counts as the largest default; one
        --quick may choose, as the largest it may choose."""
        conditions = len(self.guards) * len(self.attentions)
        batch = (self.batch_size or DEFAULT_BATCH_CEILING) * (QUICK_BATCH_FACTOR if "batch_size" in self.quick_sizes
                                                              else 1)
        return REPORT_BYTES + batch * conditions * TEXT_BYTES


def check_run_length(run_length: int | None, max_length: int | None) -> None:
    """Raises UsageError when --run-length passes the length asked (--max-length, or the scenario's default):
    the device passes would run longer texts than the plan they are checked against; nothing is clamped."""
    if run_length is not None and max_length is not None and run_length > max_length:
        raise UsageError(f"--run-length {run_length:,} is more than the length asked ({max_length:,}, "
                         f"--max-length or the scenario's); give at most {max_length:,}: the device passes run at "
                         "--run-length, the plan at --max-length.", option="--run-length")


# What a run's report folder holds at most (RunConfig.written_bytes): 0.16 MB for 16 texts, measured.
REPORT_BYTES, TEXT_BYTES, DEFAULT_BATCH_CEILING = 4 << 20, 1 << 10, 4096


@dataclasses.dataclass(frozen=True)
class PlanConfig(TakesMemory):
    """What `mpsimpact plan` was asked; embedded in its JSON."""

    scenario: str
    batch_size: int | None = option(None, BATCH_SIZE)
    max_length: int | None = option(None, MAX_LENGTH)
    model: str | None = None
    backward: bool = False
    index_bits: int = option(MPS_INDEX_BITS, INDEX_BITS)
    sweep: bool = False
    figure: str | None = None
    torch_profile: str | None = option(None, TORCH_PROFILE)
    versions: bool = False
    out: str | None = None
    memory: str | None = None  # "32GB" (a Mac's unified memory) or "auto": the demo that fits (`mac`)


# `check --task`: the keys of prediction.meta_model.TASKS (the transformers auto class of each).
CHECK_TASKS = ("base", "sequence-classification", "token-classification", "causal-lm", "seq2seq")
# The attention implementations the version table and the matrix compare, the one a condition without the
# field ran, and `check --attention` ("default": what transformers picks).
ATTENTIONS = ("eager", "sdpa")
DEFAULT_ATTENTION = "eager"
CHECK_ATTENTIONS = (*ATTENTIONS, "default")
WORKLOADS = ("inference", "training")  # what check traces and the version table shows (a call's phase: forward, backward)
NEWER = "unmeasured newer"  # the releases after the newest measured one, as tables name them
EMBEDDED_MODEL = "embedded:all-MiniLM-L6-v2"  # the embedded default model, as reports name it
# Searched up to here when the config states no position limit (relative positions, e.g. T5).
LENGTH_CEILING = 1 << 20
BATCH_CEILING = 1 << 24  # the largest safe batch is searched up to here, or up to the batch asked if larger


def batch_ceiling(batch: int) -> int:
    """Where the largest-safe-batch search of `plan` and `check` stops: BATCH_CEILING, or the batch asked when
    that is larger. An answer at the ceiling is a lower bound, and the reports say "at least"."""
    return max(BATCH_CEILING, batch)


@dataclasses.dataclass(frozen=True)
class CheckConfig(TakesMemory):
    """What `mpsimpact check` was asked; embedded in its JSON."""

    model: str
    batch_size: int = option(1, BATCH_SIZE)
    seq_len: int | None = option(None, count("--seq-len"))
    target_len: int | None = option(None, count("--target-len"))
    task: str = option("auto", Check("--task", choices=("auto", *CHECK_TASKS)))
    attention: str = option("default", Check("--attention", choices=CHECK_ATTENTIONS))
    workload: str = option("inference", Check("--workload", choices=WORKLOADS))
    torch_profile: str | None = option(None, TORCH_PROFILE)
    index_bits: int = option(MPS_INDEX_BITS, INDEX_BITS)
    cache: bool = True  # use_cache=True, as model(ids) and generate() run; False: as scoring and training
    out: str | None = None
    memory: str | None = None  # a Mac ("16GB", auto): its largest buffer decides too (`mac`)


# `matrix --transformers`: the releases probed when none is given.
DEFAULT_TRANSFORMERS = ("4.44.2", "4.57.6", "5.24.0")


def _parse_releases(releases: tuple[str, ...]) -> None:
    if not releases:
        raise ValueError("no release given")
    for release in releases:
        try:
            read_release(release)  # the rule every release a person types is read by
        except ValueError:
            raise ValueError(f"'{release}' is not a release") from None
    repeated = sorted({r for r in releases if releases.count(r) > 1})
    if repeated:
        raise ValueError(f"{', '.join(repeated)} given twice")


@dataclasses.dataclass(frozen=True)
class MatrixConfig(Validated):
    """What `mpsimpact matrix` was asked; embedded in matrix.json."""

    scenario: str
    transformers: tuple[str, ...] = option(DEFAULT_TRANSFORMERS, Check(
        "--transformers", parse=_parse_releases,
        hint="; give a comma-separated list of transformers releases such as 4.44.2,4.57.6,5.24.0"))
    model: str | None = None
    batch_size: int | None = option(None, BATCH_SIZE)
    max_length: int | None = option(None, MAX_LENGTH)
    out: str | None = None
    offline: bool = False
    torch_profile: str | None = option(None, TORCH_PROFILE)


@dataclasses.dataclass(frozen=True)
class TrainHeadConfig(Validated):
    """What `mpsimpact train-head` was asked: a folder to write the head to (a new one by default), or
    `install`: replace the installed package's head, which only an explicit --install does."""

    out: str | None = None
    limit: int | None = option(None, count("--limit"))
    install: bool = False

    def validate(self) -> None:
        super().validate()
        if self.install and self.out is not None:
            raise UsageError("--install replaces the installed head in place; it takes no --out. Pass one of "
                             "them.", option="--install")


# `sweep --dtypes` and `--layouts`: the keys of runs.sweep.DTYPES and its LAYOUTS.
SWEEP_DTYPES = ("fp32", "fp16", "bf16")
SWEEP_LAYOUTS = ("contiguous", "a_transposed", "b_transposed", "both_sliced")
GIB = 1 << 30  # bytes; every GiB figure the commands print or check


MEMORY_UNITS = {unit: GIB for unit in ("G", "GB", "GIB")} | {unit: 1 << 20 for unit in ("M", "MB", "MIB")}


def memory_bytes(text: str) -> int:
    """Bytes of a --max-memory size: "20" and "20GiB" (or GB, G) are GiB, "512MiB" (or MB, M) MiB (bounds.read_size:
    digits 0-9, a point allowed); read exactly (no float to overflow), rounded down to whole bytes, from 1 byte to
    MAX_BYTES (1 PiB)."""
    try:
        size = read_size(text, MEMORY_UNITS, "GIB")
    except ValueError as error:
        raise ValueError(f"'{_shown(text)}' {error}") from None
    if size <= 0:
        raise ValueError(f"'{_shown(text)}' is not a size above 0")
    if size < 1:
        raise ValueError(f"'{_shown(text)}' is {float(size):.2g} bytes, less than one byte")
    if size > MAX_BYTES:
        raise ValueError(f"'{_shown(text)}' is more than {MAX_BYTES // GIB:,} GiB (1 PiB), more than any machine has")
    return int(size)


@dataclasses.dataclass(frozen=True)
class SweepConfig(TakesMemory):
    """What `mpsimpact sweep` was asked; embedded in summary.json."""

    device: str = option("auto", DEVICE)
    emulate: bool | None = None
    index_bits: int = option(MPS_INDEX_BITS, INDEX_BITS)
    quick: bool = True
    dtypes: tuple[str, ...] = option(SWEEP_DTYPES, Check("--dtypes", choices=SWEEP_DTYPES))
    layouts: tuple[str, ...] = option(SWEEP_LAYOUTS, Check("--layouts", choices=SWEEP_LAYOUTS))
    out: str | None = None
    expect_fixed: bool = False
    in_process: bool = False
    torch_profile: str | None = option(None, TORCH_PROFILE)
    max_memory: str | None = option(None, Check("--max-memory", parse=memory_bytes,
                                                hint="; give a size such as 20 (GiB), 20GiB or 512MiB"))
    memory: str | None = None  # a Mac ("16GB", auto): no cell reaches its largest buffer (`mac`)
