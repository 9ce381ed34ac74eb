"""Bounds on what mpsimpact reads from users and from disk, written once: JSON nesting depth and no NaN
(`parse_json`), the length of one text (`MAX_TEXT_CHARS`, the same for every dataset format), what a
path names (`path_problem`: a regular file, in size, with a name the file system takes; `read_file_bytes`
never opens anything else), and the one rule for a number, a size or a release a person types
(`read_whole`, `read_decimal`, `read_size`, `read_release`: Note [Numbers typed by a user]). A leaf: the
engine reads profile files and releases through it too."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import stat
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64  # what we read is 2 to 6 levels deep; Python's own reader dies near 1000
MAX_TEXT_CHARS = 100_000  # one text of a dataset, in characters (a model reads at most a few thousand tokens)
MAX_CONFIG_BYTES = 8 << 20  # a model's config.json (a few kB; a long id2label table makes some a few hundred kB)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a JSON string, escapes and all
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str, stop_above: int = MAX_JSON_DEPTH) -> int:
    """How deeply JSON `text` nests lists and objects (brackets inside strings do not count); counting
    stops at the first level past `stop_above`, so a hostile file costs no more than a fair one."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if bracket.group() in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > stop_above:
                break
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(text: str | bytes, *, allow_nan: bool = False) -> Any:
    """`json.loads` with bounds: at most MAX_JSON_DEPTH levels of lists and objects, and no NaN or Infinity
    unless `allow_nan` (a run's per-text errors are infinite where a device returned NaN; whoever reads
    such a file checks the numbers it uses).

    Raises:
        ValueError: one line saying what is off (a json.JSONDecodeError for malformed JSON).
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep (lists or objects)")
    try:
        return json.loads(text, parse_constant=None if allow_nan else _no_constant)
    except RecursionError:  # unreachable below the depth bound; kept so that no input can end in a traceback
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep (lists or objects)") from None


def text_problem(text: str) -> str | None:
    """What makes `text` unusable as a model's input, in words that follow "the text is", or None: longer
    than MAX_TEXT_CHARS, or holding a lone surrogate (not Unicode text: tokenizers fail on it)."""
    if len(text) > MAX_TEXT_CHARS:
        return f"{len(text):,} characters long, more than the {MAX_TEXT_CHARS:,} a text may have"
    return unicode_problem(text)


def unicode_problem(text: str) -> str | None:
    """"not valid Unicode (a lone surrogate \\ud800 at character 3)" where `text` holds one; None otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        return f"not valid Unicode (a lone surrogate \\u{code:04x} at character {error.start + 1})"
    return None


# Note [Only regular files]
# Opening a FIFO for reading blocks until a writer comes (forever, for a user who typed its name), a device
# node reads without end, and renaming a file over a device node, a socket or a link replaces it. So every
# path mpsimpact reads or writes is looked at first with os.stat / os.lstat, which never open it: reading
# needs a regular file (a link to one is followed) no bigger than the reader's bound, and a write lands beside
# the target and is renamed only over a regular file or nothing (output.files.atomic_write_bytes).

NAME_MAX = 255  # bytes of one name where the file system does not say (Linux, macOS)
PATH_MAX = 4096  # bytes of a whole path where the system does not say (Linux's; macOS allows 1024)
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class FileProblemError(ValueError):
    """A path that cannot be read or written as a file; its text is a predicate ("is a FIFO (named pipe), not
    a regular file", "does not exist"), which callers put after the path's name in their own sentence."""


def shown_path(path: str | os.PathLike[str], room: int = 120) -> str:
    """`path` for a message, its middle cut out past `room` characters (a 5,000-character path in a line)."""
    text = str(path)
    return text if len(text) <= room else f"{text[:room // 2]}…{text[-room // 2:]} ({len(text):,} characters)"


def _system_limit(path: Path, name: str, fallback: int) -> int:
    folder = next((p for p in (path.parent, *path.parent.parents) if os.path.isdir(p)), Path("."))
    try:
        found = os.pathconf(folder, name)
    except (OSError, ValueError):
        return fallback
    return found if found and found > 0 else fallback


def name_problem(path: str | os.PathLike[str]) -> str | None:
    """What makes `path` a name this system cannot take, as a predicate, or None: a path longer than PATH_MAX
    bytes, one of its names longer than NAME_MAX (the file system's own figures where it states them), a NUL."""
    try:
        text = os.fsencode(path)
    except UnicodeEncodeError as error:
        return f"holds a character this system's file names cannot encode ({error.reason})"
    if b"\0" in text:
        return "holds a NUL character, which no file name may hold"
    path = Path(os.fsdecode(text)).absolute()
    longest = _system_limit(path, "PC_PATH_MAX", PATH_MAX)
    if len(text) >= longest:
        return f"is {len(text):,} bytes long, more than the {longest - 1:,} a path may have on this system"
    part = max(path.parts, key=lambda name: len(os.fsencode(name)))
    size = len(os.fsencode(part))
    if size > NAME_MAX and size > (most := _system_limit(path, "PC_NAME_MAX", NAME_MAX)):
        return (f"has a name of {size:,} bytes ('{shown_path(part, 40)}'), more than the {most:,} a name may "
                "have on this file system")
    return None


def kind_of(mode: int) -> str:
    """What a stat mode names, in words: "a file" (regular), "a folder", "a FIFO (named pipe)", ..."""
    if stat.S_ISREG(mode):
        return "a file"
    return next((words for test, words in _KINDS if test(mode)), "a special file")


def kind_problem(mode: int) -> str | None:
    """What a stat mode is, as a predicate, when it is not a regular file ("is a FIFO (named pipe), not a
    regular file"); None for a regular file."""
    return None if stat.S_ISREG(mode) else f"is {kind_of(mode)}, not a regular file"


def path_problem(path: str | os.PathLike[str], limit: int | None = None, what: str = "this file") -> str | None:
    """What keeps `path` from being read as a file, as a predicate, or None: a name the system cannot take
    (`name_problem`), nothing there, a dangling or looping link, anything but a regular file (a link to one is
    followed), or more than `limit` bytes. Opens nothing (see Note [Only regular files])."""
    if (problem := name_problem(path)) is not None:
        return problem
    try:
        found = os.stat(path)
    except OSError as error:
        return _stat_problem(Path(path), error)
    problem = kind_problem(found.st_mode)
    if problem is None and limit is not None and found.st_size > limit:
        problem = f"is {found.st_size:,} bytes, more than the {limit:,} {what} may have"
    return problem


_STAT_PROBLEMS = {errno.ENOENT: "does not exist", errno.ELOOP: "is a symbolic link that loops",
                  errno.ENOTDIR: "is inside something that is not a folder"}


def _stat_problem(path: Path, error: OSError) -> str:
    if error.errno == errno.ENOENT and os.path.islink(path):
        return f"is a symbolic link to '{shown_path(os.readlink(path), 60)}', which does not exist"
    return _STAT_PROBLEMS.get(error.errno, f"cannot be looked at ({error.strerror})")


def read_file_bytes(path: str | os.PathLike[str], limit: int, what: str = "this file") -> bytes:
    """The bytes of the regular file `path` (a link to one is followed), at most `limit` of them.

    Raises:
        FileProblemError: `path_problem`'s predicate, or "cannot be read (...)"; nothing else was opened.
    """
    if (problem := path_problem(path, limit, what)) is not None:
        raise FileProblemError(problem)
    try:  # non-blocking: a FIFO swapped in after the look above still cannot hold us
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise FileProblemError(f"cannot be read ({error.strerror})") from None
    with os.fdopen(fd, "rb") as file:
        if (problem := kind_problem(os.fstat(fd).st_mode)) is not None:
            raise FileProblemError(problem)
        try:
            data = file.read(limit + 1)
        except OSError as error:
            raise FileProblemError(f"cannot be read ({error.strerror})") from None
    if len(data) > limit:
        raise FileProblemError(f"is more than the {limit:,} bytes {what} may have")
    return data


# Note [Numbers typed by a user]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every number, size and release a person types (an option's value, an environment variable) is read by one
# rule, wherever it is read: the digits 0-9 and nothing that merely looks like them (Python's int() and re's
# \d also take "١٦" and "１６", which no shell script, no other tool and no reader of a report takes for 16),
# nothing around it (" 16"), no underscores ("1_6"), no sign but a leading minus (which the range after it
# refuses in words), and in a whole number no point, exponent or base ("16.0", "1e3", "0x10"). A decimal may
# have a point and an exponent ("0.5", "1e-4"); a size is such a number without exponent, then its unit after
# at most one space ("16GB", "1.5 g"); a release is PEP 440's form as torch and transformers spell theirs
# ("2.12", "2.12.1", "2.15.0rc1", "2.14.0.post1", "2.15.0.dev20261101", "2.13.0+cpu"), its pre-release,
# post-release and development parts kept (`Release`), so whoever judges it names them and never takes a
# pre-release for the release it precedes.

DIGITS = "the digits 0-9"
_WHOLE = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?) ?([A-Za-z]*)")
_RELEASE = re.compile(r"([0-9]+)\.([0-9]+)(?:\.([0-9]+))?((?:a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?"
                      r"(\+[A-Za-z0-9]+(?:\.[A-Za-z0-9]+)*)?")
MAX_DIGITS = 4000  # past every bound; int() itself stops at 4,300 digits


def read_whole(text: str) -> int:
    """A whole number typed by a person (Note [Numbers typed by a user]); one of more than MAX_DIGITS digits
    counts as 10**MAX_DIGITS (past every bound: whoever says so shows the text, not this value).

    Raises:
        ValueError: "is not a whole number written with the digits 0-9".
    """
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        raise ValueError(f"is not a whole number written with {DIGITS}")
    digits = text.lstrip("-").lstrip("0")
    number = 10**MAX_DIGITS if len(digits) > MAX_DIGITS else int(digits or "0")
    return -number if text.startswith("-") else number


def read_decimal(text: str) -> float:
    """A number typed by a person: digits 0-9 with an optional point and exponent ("0.5", "1e-4"); 1e400 is
    infinite (the range that follows refuses it in words).

    Raises:
        ValueError: "is not a number written with the digits 0-9 (such as 0.5 or 1e-4)".
    """
    if not isinstance(text, str) or not _DECIMAL.fullmatch(text):
        raise ValueError(f"is not a number written with {DIGITS} (such as 0.5 or 1e-4)")
    return float(text)


def exact_decimal(number: str) -> Fraction:
    """Digits with an optional point ("1.5", "0.0000001", 400 nines), exactly: no float to overflow or round
    it. More than 20 whole digits count as 10**20 (past every size), sparing int() its 4,300-digit limit."""
    whole = number.partition(".")[0].lstrip("0")
    return Fraction(10**20) if len(whole) > 20 else Fraction(Decimal(number))


def read_size(text: str, units: dict[str, int], default: str) -> Fraction:
    """A size typed by a person: a number (digits 0-9, an optional point), then one of `units` (case aside,
    keys upper-case; `default` where none is written) after at most one space, as an exact count of the
    smallest unit: read_size("1.5 GiB", {"GIB": 1024, "MIB": 1}, "GIB") == 1536.

    Raises:
        ValueError: not a number followed by one of `units` (the message names them).
    """
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = (match[2].upper() or default) if match else None
    if match is None or unit not in units:
        named = ", ".join(name.replace("IB", "iB") for name in units)  # GIB is written GiB
        raise ValueError(f"is not a size: a number written with {DIGITS}, then a unit ({named})")
    return exact_decimal(match[1]) * units[unit]


@dataclasses.dataclass(frozen=True)
class Release:
    """A release in PEP 440's form (Note [Numbers typed by a user]): its numbers (a missing patch is 0) and
    its parts that make it another release than those numbers' final one ("rc1", ".post1", ".dev2026") or a
    build of it ("+cpu"). `str()` is its name: the numbers and every part but the build."""

    number: tuple[int, int, int]
    pre: str = ""  # "a0", "b2", "rc1": before the final release
    post: str = ""  # ".post1": the final release, repackaged
    dev: str = ""  # ".dev20261101": a development build, before whatever it precedes
    local: str = ""  # "+cpu", "+cu121": a build of this release

    @property
    def is_final(self) -> bool:
        """Whether it is the final release of its numbers (or a repackaging or build of it)."""
        return not (self.pre or self.dev)

    def __str__(self) -> str:
        return ".".join(map(str, self.number)) + self.pre + self.post + self.dev


def read_release(text: str) -> Release:
    """A release typed by a person (or a package's own version), whole (Note [Numbers typed by a user]).

    Raises:
        ValueError: "is not a release (expected e.g. 2.12.1)".
    """
    match = _RELEASE.fullmatch(text) if isinstance(text, str) else None
    if match is None or any(len(part or "") > 12 for part in match.groups()[:3]):  # no release has such numbers
        raise ValueError("is not a release (expected e.g. 2.12.1)")
    major, minor, patch, pre, post, dev, local = match.groups()
    return Release((int(major), int(minor), int(patch or 0)), pre or "", post or "", dev or "", local or "")


def json_value_problem(value: Any, where: str, infinity: bool = False) -> tuple[str, str] | None:
    """The first thing in parsed JSON `value` that JSON itself does not allow, as (where it is, what it is), or
    None: a lone surrogate in a string or a key (not Unicode text), NaN, and unless `infinity`, an infinite
    number (Infinity, or 1e400, which no float holds); `where` names `value` ("text_config", "a[2].b")."""
    if isinstance(value, str):
        problem = None if value.isascii() else unicode_problem(value)
        return None if problem is None else (where, f"holds text that is {problem}")
    if isinstance(value, float):
        if math.isfinite(value) or (infinity and not math.isnan(value)):
            return None
        what = "NaN" if math.isnan(value) else f"{json.dumps(value)} (or a number past a float's range, as 1e400)"
        return where, f"is {what}, which JSON does not allow"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        shown = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate, as its escape
        inside = f"{where}.{shown}" if isinstance(value, dict) else f"{where}[{key}]"
        found = json_value_problem(key, inside) if isinstance(key, str) else None
        found = found or json_value_problem(item, inside, infinity)
        if found is not None:
            return found
    return None
