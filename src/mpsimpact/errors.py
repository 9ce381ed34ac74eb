"""Every exception mpsimpact raises: one base class, with fields that reports can serialize."""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
import unicodedata
from typing import Any


def said(prefix: str, message: str) -> str:
    """`prefix: message` as one paragraph for stderr (see `paragraph`), control characters written as their
    escapes (a newline in a scenario's name, a tab in a path: as repr writes them)."""
    flat = "".join(repr(c)[1:-1] if unicodedata.category(c) == "Cc" else c for c in message)
    return paragraph(f"{prefix}: {flat}", indent=len(prefix) + 2)


def paragraph(text: str, indent: int = 0) -> str:
    """`text` wrapped (`wrapped`) at the terminal's width (COLUMNS, else the width of a terminal on stderr), the
    lines after the first indented by `indent`. In a log (no terminal, no COLUMNS) the text is one line: a log
    has no width, and a line greps."""
    width = _stderr_width()
    return text if width is None else wrapped(text, max(width, 40), indent)


def wrapped(text: str, width: int, indent: int = 0) -> str:
    """`text` (one line) wrapped between words at `width`, the lines after the first indented by `indent` (and
    then its first word kept with the next: "error:" never alone on its line). A word longer than the width (a
    path) stays whole, and so does a backquoted command; joining the lines with single spaces gives the text
    back. A number stays with its unit (`kept_together`). The console's wrapping too (output.console)."""
    whole = _BACKQUOTED.sub(lambda m: m.group().replace(" ", KEEP), text)  # a command to type is one word
    whole = kept_together(whole)
    whole = whole.replace(" ", KEEP, 1) if indent else whole
    return textwrap.fill(whole, width=width, subsequent_indent=" " * indent, break_long_words=False,
                         break_on_hyphens=False).replace(KEEP, " ")


def kept_together(text: str) -> str:
    """`text` with the spaces inside a number and its unit ("16 GB", "9 min 32 s", "6.44 billion elements",
    "signal 11") made unbreakable (`KEEP`): no wrap puts a number on one line and its unit on the next."""
    return _WITH_UNIT.sub(lambda m: m.group().replace(" ", KEEP), text)


def unbroken_words(text: str) -> list[str]:
    """The words of `text` that a wrap keeps whole: split at spaces, a number with its unit one word."""
    return [word.replace(KEEP, " ") for word in kept_together(text).split()]


_BACKQUOTED = re.compile(r"`[^`\n]*`")
KEEP = "\0"  # a space that must not break while wrapping (not whitespace to textwrap; no path holds it)
# A number and its unit: sizes, times and bits ("8.0 GiB", "396 s", "9 min 32 s"), "6.44 billion elements", and a
# signal's number ("SIGSEGV (signal 11)").
_NUMBER, _UNIT = r"\d[\d,]*(?:\.\d+)?", r"(?:[KMGT]i?B|bytes?|bits?|ms|s|min|h)\b(?!\.\w)"
_WITH_UNIT = re.compile(rf"\bsignal \d+|(?<![\w.]){_NUMBER}(?: (?:billion|million|thousand) \w+|"
                        rf" {_UNIT}(?: {_NUMBER} {_UNIT})*)")


def _stderr_width() -> int | None:
    columns = os.environ.get("COLUMNS", "")
    if columns.isascii() and columns.isdigit():  # a bad value is refused by the CLI (variables.console_width)
        return int(columns)
    return shutil.get_terminal_size().columns if sys.stderr is not None and sys.stderr.isatty() else None


class MpsImpactError(Exception):
    """Base of mpsimpact's errors; the CLI prints these as one paragraph (`said`) and exits non-zero."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def to_json(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "message": self.message, **_jsonable(self.fields)}


class UsageError(MpsImpactError):
    """Bad user input: a flag value, a scenario name, a missing file."""


class EnvironmentVariableError(UsageError, ValueError):
    """An environment variable mpsimpact reads holds a value it cannot use: one line naming the variable, its
    value (cut past 80 characters), what is wrong and what is accepted. A ValueError too, as a bad value is."""

    def __init__(self, variable: str, value: str, problem: str, accepted: str, unset: bool = True) -> None:
        shown = value if len(value) <= 80 else f"{value[:60]}… ({len(value):,} characters)"
        super().__init__(f"{variable}={shown!r} {problem}; {accepted}{', or unset it' if unset else ''}.",
                         variable=variable, value=value[:200])


class DeviceError(MpsImpactError):
    """A requested device is missing or cannot hold the run."""


class MemoryPreflightError(DeviceError):
    """A run would not fit in the memory the device offers; raised before allocating."""


class DiskFullError(MpsImpactError):
    """A file could not be written for want of space (ENOSPC, a quota); nothing was left half-written."""


class ModelLoadError(MpsImpactError):
    """A model, tokenizer or dataset could not be loaded (offline, missing, malformed)."""


class PlanMismatchError(MpsImpactError):
    """A replayed fault plan does not match the calls of the run it is applied to."""


class EmulatedMpsError(MpsImpactError, RuntimeError):
    """The error MPS itself raises (or aborts with) for this call, produced by the emulator.

    Subclasses RuntimeError, like the real one.
    """


class OverlayError(MpsImpactError):
    """An overlay environment (`mpsimpact matrix`) could not be built, found in the cache, or probed;
    the matrix shows its `message` as the row's reason."""


class NotEmulatedError(MpsImpactError, RuntimeError):
    """MPS returns wrong values for this call, but nobody characterised them, so the emulator will not
    invent them (fused SDPA on 2.5.1 .. 2.12.1, 2.4.1's fp32 outputs, cat on 2.13.0)."""


class OversizedOpError(MpsImpactError, RuntimeError):
    """The guard stopped an op that would fault on MPS. Subclasses RuntimeError too."""


def _jsonable(fields: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in fields.items():
        if hasattr(value, "to_json"):
            value = value.to_json()
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out
