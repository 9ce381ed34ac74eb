"""Command options: each config field declares its check once, and every command's config is validated
the same way, before anything is loaded. Options several commands share are defined here once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mpsimpact.engine.faults import INDEX_BITS_RANGE, MPS_INDEX_BITS
from mpsimpact.errors import UsageError

# A sample is corrupted above this relative error against the reference (the study's criterion).
CORRUPTION_THRESHOLD = 1e-3
DEVICES = ("auto", "mps", "cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class Check:
    """How one option's value is checked: a numeric range, or a set of choices (for each element
    of a tuple value, too). None values are left alone (an option not given)."""

    flag: str
    low: float | None = None
    high: float | None = None
    inclusive: bool = True
    choices: tuple[str, ...] | None = None
    hint: str = ""
    parse: Callable[[Any], Any] | None = None  # raises ValueError on a bad value

    def __call__(self, value: Any) -> None:
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
        if not self._in_range(value):
            raise UsageError(f"{self.flag} must be {self._expected()}{self.hint}, got {value}.",
                             option=self.flag)

    def _in_range(self, value: float) -> bool:
        if self.inclusive:
            return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        return (self.low is None or value > self.low) and (self.high is None or value < self.high)

    def _expected(self) -> str:
        if self.high is None:
            return f"{'>=' if self.inclusive else '>'} {self.low:g}"
        return f"in {self.low:g}..{self.high:g}" if self.inclusive else f"in ({self.low:g}, {self.high:g})"


def option(default: Any, check: Check) -> Any:
    """A config dataclass field whose value `validate` checks with `check`."""
    return dataclasses.field(default=default, metadata={"check": check})


def validate(config: Any) -> None:
    """Checks every field of a config dataclass that declares a `Check`; raises UsageError (one line,
    naming the flag, the value and what is expected) on the first bad value."""
    for field in dataclasses.fields(config):
        check = field.metadata.get("check")
        if check is not None:
            check(getattr(config, field.name))


class Validated:
    """A command's config dataclass: `validate()` runs every field's `Check`."""

    def validate(self) -> None:
        """Raises UsageError on any bad value, before anything is loaded."""
        validate(self)


BATCH_SIZE = Check("--batch-size", low=1)
MAX_LENGTH = Check("--max-length", low=1)
INDEX_BITS = Check("--index-bits", *INDEX_BITS_RANGE, hint=f" ({MPS_INDEX_BITS} is MPS)")
DEVICE = Check("--device", choices=DEVICES)


def _parse_profile(value: str) -> None:
    from mpsimpact.engine.profile_file import ProfileFileError
    from mpsimpact.engine.release import resolve_profile

    try:
        resolve_profile(value)
    except ProfileFileError as error:  # its message names the file and the field: no release hint
        raise UsageError(error.message, option="--torch-profile", path=error.path,
                         field=error.field) from None


TORCH_PROFILE = Check(
    "--torch-profile", parse=_parse_profile,
    hint="; give a release such as 2.12.1 (measured: 2.4.1 .. 2.14.0; others are judged conservatively), "
         "'conservative', or a profile.json written by `mpsimpact sweep`",
)
