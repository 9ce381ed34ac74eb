"""What the plugin saw at one call site (`Sighting`) and the words it says about it: what was done there, the
summary's lines, a failed test's own section. Every line a person reads is wrapped as the CLI wraps
(errors.wrapped): at COLUMNS, else at a terminal's width, and in a log one line per site."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from mpsimpact.errors import wrapped
from mpsimpact.output.record import Record

# What was done at a site, in the summary's words (each names who did it). The emulator's words by its outcome
# (modes.emulator: RETURNED, INFERRED, RAISED, ABORTED, REFUSED).
EMULATED = {
    "returned": "emulated: MPS's wrong values returned",
    "inferred": "emulated: a layout nobody measured, computed as its contiguous copy is inferred to read",
    "raised": "emulated: MPS's error raised",
    "aborted": "emulated: MPS aborts the process (raised here instead)",
    "refused": "emulated: refused, values not characterised (judged conservatively)",
}
STOPPED = "guard raise: stopped before it ran, the test fails"
SPLIT = "guard chunk: split into safe pieces, correct"
WARNED = "guard warn: only warned"
WARNED_PLAIN = "guard warn: only warned; ran unchanged here (not emulated)"
GUESSED = " (nobody measured this release: judged conservatively)"


@dataclasses.dataclass(frozen=True, eq=False)
class Sighting(Record):
    """One call site that would fault on MPS: where (the user's line), the call, the fault (kind, rule, release,
    first wrong batch of the call's rows), the tests or fixtures that reached it, what was done there, and the
    same in the caller's samples (rows_per_sample: Note [A call's samples] in modes/entrypoint.py) with the
    guard's words on it (`said`: what MPS would do, why, and what to do). As --mps-json and an xdist worker's
    report hold it (written and read by this class)."""

    site: str
    call: str
    kind: str
    rule: str
    release: str
    first_bad_batch: int | None
    tests: list[str]
    actions: list[str]
    rows_per_sample: int
    index_bits: int
    said: str
    first_bad_sample: int | None  # the first wrong sample of the caller's first dimension (None: no wrong tail)

    @property
    def key(self) -> tuple[Any, ...]:
        return self.site, self.call, self.kind, self.rule, self.release, self.first_bad_batch

    def merge(self, other: Sighting) -> None:
        self.tests.extend([t for t in other.tests if t not in self.tests])
        self.actions.extend([a for a in other.actions if a not in self.actions])

    def problem(self) -> str | None:
        if self.rows_per_sample < 1 or not 4 <= self.index_bits <= 32:
            return f"rows_per_sample {self.rows_per_sample} or index_bits {self.index_bits} is out of range"
        counted = None if self.first_bad_batch is None else self.first_bad_batch // self.rows_per_sample
        if self.first_bad_sample != counted:  # as MacRun.note counts it: the batch's rows in samples
            return (f"first_bad_sample is {self.first_bad_sample}, not first_bad_batch // rows_per_sample = "
                    f"{self.first_bad_batch} // {self.rows_per_sample}")
        return None

    def line(self) -> str:
        """The summary's line for this site (one line; the terminal wraps it with `wrapped_lines`)."""
        tests = ", ".join(self.tests[:3]) + (f" and {len(self.tests) - 3} more" if len(self.tests) > 3 else "")
        return f"{self.site}: {self.call}: {self.outcome()}; {'; '.join(self.actions)}; reached by {tests}."

    def outcome(self) -> str:
        """What MPS would do, in the caller's units: "wrong from sample 10 on MPS 2.14.0 (rule input-wrap)"."""
        if self.kind != "wrong_tail" or self.first_bad_batch is None:
            what = {"wrong_all": "wrong in every batch", "error": "an error", "abort": "a process abort",
                    "truncated": "truncated (mostly zeros)", "wrong_other": "wrong (pattern not characterised)",
                    }.get(self.kind, self.kind.replace("_", " "))
        elif self.rows_per_sample > 1:
            what = (f"wrong from sample {self.first_bad_sample} of the first dimension (row "
                    f"{self.first_bad_batch}, {self.rows_per_sample} rows a sample)")
        else:
            what = f"wrong from batch {self.first_bad_batch}"
        return f"{what} on MPS {self.release} (rule {self.rule})"

    def section(self) -> str:
        """The paragraph a failed test's report gains for this site."""
        width = f" at a {self.index_bits}-bit index: every limit divided by 2^{32 - self.index_bits}" \
            if self.index_bits != 32 else ""
        return f"{self.site}: {'; '.join(self.actions)} (torch {self.release}'s MPS rules{width}). {self.said}"


def columns(isatty: bool, fallback: int) -> int | None:
    """The width the plugin wraps at, as the CLI's (errors.paragraph): COLUMNS where set, else the terminal's
    (`fallback`) where pytest writes to one; None in a log (one line a site)."""
    value = os.environ.get("COLUMNS", "")
    if value.isascii() and value.isdigit() and len(value) < 7:
        return max(int(value), 40)
    return fallback if isatty else None


def wrapped_lines(text: str, width: int | None, indent: int = 4) -> list[str]:
    """`text` as the lines a reader sees: wrapped between words at `width` (a path stays whole), the lines after
    the first indented; one line where there is no width."""
    return [text] if width is None else wrapped(text, width, indent).split("\n")


def short_path(filename: str) -> str:
    """A frame's file as a reader finds it: relative to the current folder where it lies under it, else to the
    import path entry that holds it (`transformers/models/bert/modeling_bert.py`), else whole."""
    try:
        here = os.path.relpath(filename)
    except ValueError:  # another drive
        return filename
    if not here.startswith(os.pardir):
        return here
    roots = [os.path.join(os.path.realpath(p), "") for p in sys.path if p and os.path.isdir(p)]
    path = os.path.realpath(filename)
    holding = max((root for root in roots if path.startswith(root)), key=len, default=None)
    return path[len(holding):] if holding else filename


@dataclasses.dataclass(frozen=True, eq=False)
class SightingsFile(Record):
    """--mps-json: the release judged, the options, and every call site that would fault."""

    release: dict[str, Any]
    settings: dict[str, Any]
    calls: list[Sighting]
