"""The environment variables mpsimpact reads, each parsed and checked where it is read: a bad value is one
line naming the variable, its value and what is accepted (EnvironmentVariableError, exit 2 from the CLI).
The cache's own (MPSIMPACT_CACHE, XDG_CACHE_HOME) live with the cache, in engine.release."""

from __future__ import annotations

import os
from pathlib import Path

from mpsimpact.bounds import name_problem, read_size, read_whole
from mpsimpact.errors import EnvironmentVariableError

ATTENTION_BUDGET = "MPSIMPACT_ATTENTION_BUDGET"  # bytes of one attention piece: Note [Attention memory budget]
GUARD = "MPSIMPACT_GUARD"  # install_thread_guard()'s mode when none is given
EMBEDDED_MODEL = "MPSIMPACT_EMBEDDED_MODEL"  # a local all-MiniLM-L6-v2 folder in place of the package's
OFFLINE = ("UV_OFFLINE", "PIP_NO_INDEX")  # package-index switches: the package index is off limits (matrix)
# torch's own: MPS's high watermark, a share of the working set past which its allocator stops a process with
# "MPS backend out of memory" (0: no limit); read for a Mac a command judges (engine.mac_memory).
HIGH_WATERMARK_RATIO = "PYTORCH_MPS_HIGH_WATERMARK_RATIO"
DEFAULT_WATERMARK_RATIO, MAX_WATERMARK_RATIO = 1.7, 2.0  # torch's default on unified memory (engine.mac_memory's
# WATERMARK_RATIO, which the engine cannot import from here), and its upper bound
COLUMNS = "COLUMNS"  # the console's width: rich lays out every line (--help too) by it, and errors.paragraph wraps

GUARD_MODES = ("raise", "warn", "chunk")  # the guard's modes (modes.guard); MPSIMPACT_GUARD may also say off
# Bytes (1 PiB): more than any machine's memory; bounds every size given in bytes (this budget, sweep's --max-memory).
MAX_BYTES = 1 << 50
COLUMNS_RANGE = (20, 10_000)  # narrower, a table's words have no room; no terminal is wider
# A size in bytes: a number (Note [Numbers typed by a user]), then B, K, M or G (KiB, MiB, GiB), KB or KiB, ...
BYTE_UNITS = {"B": 1} | {f"{prefix}{tail}": 1 << shift for prefix, shift in (("K", 10), ("M", 20), ("G", 30))
                         for tail in ("", "B", "IB")}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _value(name: str) -> str | None:
    """The variable's value, None where it is unset or blank (both mean: not given)."""
    value = os.environ.get(name)
    return value if value is not None and value.strip() else None


def attention_budget() -> int | None:
    """MPSIMPACT_ATTENTION_BUDGET in bytes (suffixes K, M, G for KiB, MiB, GiB), or None where unset.

    Raises:
        EnvironmentVariableError: not a byte count, not a whole number of bytes (1.5), or outside 1 .. MAX_BYTES (nan,
        inf, -1, 1e400 among them).
    """
    value = _value(ATTENTION_BUDGET)
    if value is None:
        return None
    accepted = (f"give a whole number of bytes from 1 to 2**{MAX_BYTES.bit_length() - 1}, or a number with K, M "
                "or G (KiB, MiB, GiB) that comes to whole bytes, e.g. 268435456, 256M or 1.5K")
    try:
        number = read_size(value, BYTE_UNITS, "B")
    except ValueError:
        raise EnvironmentVariableError(ATTENTION_BUDGET, value, "is not a byte count", accepted) from None
    if not 1 <= number <= MAX_BYTES:
        raise EnvironmentVariableError(ATTENTION_BUDGET, value, "is out of range", accepted)
    if number.denominator != 1:
        raise EnvironmentVariableError(ATTENTION_BUDGET, value, f"is {float(number):g} bytes, not a whole number",
                                       accepted)
    return int(number)


def console_width() -> int | None:
    """COLUMNS, the console's width in characters, or None where unset or blank (the terminal's width then).

    Raises:
        EnvironmentVariableError: not a whole number in COLUMNS_RANGE (0 left rich no room, "²" or 5,000 digits
        failed int()).
    """
    value = _value(COLUMNS)
    if value is None:
        return None
    low, high = COLUMNS_RANGE
    accepted = f"give a whole number of columns from {low} to {high:,}, e.g. 80"
    try:
        columns = read_whole(value)
    except ValueError:
        raise EnvironmentVariableError(COLUMNS, value, "is not a whole number of columns", accepted) from None
    if not low <= columns <= high:
        raise EnvironmentVariableError(COLUMNS, value, "is out of range", accepted)
    return columns


def guard_mode() -> str | None:
    """MPSIMPACT_GUARD: one of GUARD_MODES or off, or None where unset.

    Raises:
        EnvironmentVariableError: any other value.
    """
    value = _value(GUARD)
    if value is None:
        return None
    modes = (*GUARD_MODES, "off")
    if value.strip() not in modes:
        raise EnvironmentVariableError(GUARD, value, "is not a guard mode", f"give one of {', '.join(modes)}")
    return value.strip()


def high_watermark_ratio() -> float:
    """PYTORCH_MPS_HIGH_WATERMARK_RATIO as torch's MPS allocator reads it: a number from 0 (no limit) to 2, its
    default 1.7 where unset (on unified memory).

    Raises:
        EnvironmentVariableError: not a number, or outside what torch accepts (it refuses the process then).
    """
    value = _value(HIGH_WATERMARK_RATIO)
    if value is None:
        return DEFAULT_WATERMARK_RATIO
    accepted = f"give a number from 0 (no limit) to {MAX_WATERMARK_RATIO:g}, as torch accepts, e.g. 1.7"
    try:
        ratio = float(value)
    except ValueError:
        raise EnvironmentVariableError(HIGH_WATERMARK_RATIO, value, "is not a number", accepted) from None
    if not 0 <= ratio <= MAX_WATERMARK_RATIO:  # nan fails both
        raise EnvironmentVariableError(HIGH_WATERMARK_RATIO, value, "is out of range", accepted)
    return ratio


def embedded_model_folder() -> Path | None:
    """MPSIMPACT_EMBEDDED_MODEL as a path, or None where unset. Only its name is checked here; what the folder
    holds is checked by models.classifier before anything reads it.

    Raises:
        EnvironmentVariableError: a name this system cannot take.
    """
    value = _value(EMBEDDED_MODEL)
    if value is None:
        return None
    problem = name_problem(value)
    if problem is not None:
        raise EnvironmentVariableError(EMBEDDED_MODEL, value, problem, "point it at a model folder")
    return Path(value).expanduser()


def is_offline() -> bool:
    """Whether UV_OFFLINE or PIP_NO_INDEX says the package index is off limits.

    Raises:
        EnvironmentVariableError: a value that is neither true (1, true, yes, on) nor false (0, false, no, off).
    """
    said = False
    for name in OFFLINE:
        value = os.environ.get(name, "").strip().lower()
        if value not in _TRUE + _FALSE:
            raise EnvironmentVariableError(name, os.environ[name], "is neither true nor false",
                                           f"give one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE[1:])} (off)")
        said = said or value in _TRUE
    return said


def check_variables() -> None:
    """Checks every variable this module reads (cheaply: no folder is opened), so that a command refuses a bad
    one before any work. Raises EnvironmentVariableError on the first bad one."""
    attention_budget()
    console_width()
    guard_mode()
    high_watermark_ratio()
    embedded_model_folder()
    is_offline()
