"""Bounds on what mpsimpact reads from users and from disk, written once: JSON nesting depth and no NaN
(`parse_json`), the length of one text (`MAX_TEXT_CHARS`, the same for every dataset format), and what a
path names (`path_problem`: a regular file, in size, with a name the file system takes; `read_file_bytes`
never opens anything else). A leaf: the engine reads profile files through it too."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
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


def _stat_problem(path: Path, error: OSError) -> str:
    if error.errno == errno.ENOENT and os.path.islink(path):
        return f"is a symbolic link to '{shown_path(os.readlink(path), 60)}', which does not exist"
    if error.errno == errno.ENOENT:
        return "does not exist"
    if error.errno == errno.ELOOP:
        return "is a symbolic link that loops"
    if error.errno == errno.ENOTDIR:
        return "is inside something that is not a folder"
    return f"cannot be looked at ({error.strerror})"


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
