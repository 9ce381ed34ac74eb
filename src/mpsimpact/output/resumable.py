"""A report folder filled across runs (`mpsimpact sweep`): a hidden partial folder next to `--out`, locked
while one process works in it, holding the work's identity and a log of finished items, renamed into place
when the work is done. Nothing in it is read or written through a symbolic link."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mpsimpact.bounds import parse_json
from mpsimpact.errors import UsageError
from mpsimpact.output.files import atomic_write_text, disk_full_said, warn


def read_no_link(path: Path) -> bytes | None:
    """The bytes of the regular file `path`, opened without following a symbolic link (O_NOFOLLOW); None
    when it is absent.

    Raises:
        IsADirectoryError or OSError(ELOOP): `path` is a folder, a link or anything but a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a regular file", str(path))
        return fh.read()


def _remove_link(path: Path, what: str) -> None:
    """A symbolic link where mpsimpact keeps its own state is removed (the link, never what it points to),
    with one warning line; anything else but a file there is refused."""
    if not path.is_symlink():
        raise UsageError(f"'{path}' is not a file; mpsimpact keeps {what} there: move it away, or pass another "
                         "--out.")
    warn(f"'{path}' is a symbolic link (to '{os.readlink(path)}'); mpsimpact does not follow links in its "
         f"unfinished folders: the link is removed, and {what} starts afresh.")
    path.unlink()


class ResumableFolder:
    """A report folder filled across runs (`resumable_folder`): the items finished so far, one JSON line
    each in `log`, appended and synced one by one, so that a kill loses at most the item under way. The log
    is read and appended without following symbolic links: a link in its place is removed, never written
    through. Readers check each item themselves (`keep`)."""

    def __init__(self, path: Path, log: str) -> None:
        self.path, self.log = path, path / log
        try:
            data = read_no_link(self.log)
        except OSError:
            _remove_link(self.log, f"the log of finished items ({log})")
            data = None
        lines = (data or b"").decode("utf-8", "replace").splitlines(keepends=True)  # a garbled line: dropped below
        self.items: list[Any] = []
        self.damaged: list[str] = []  # a line per line dropped here, for the reader's one warning line
        for number, line in enumerate(lines, 1):
            try:
                if not line.endswith("\n"):
                    raise ValueError("cut short: a kill or a full disk stopped its write")
                self.items.append(parse_json(line))
            except ValueError as error:  # dropped: its item is done again
                self.damaged.append(f"line {number}: {str(error).splitlines()[0][:100]}")
        if self.damaged:
            self.keep(self.items)
        self.resumed = len(self.items)

    def keep(self, items: list[Any]) -> None:
        """Rewrites the log with `items` only (those a reader checked and kept), atomically."""
        self.items = list(items)
        atomic_write_text(self.log, "".join(json.dumps(item) + "\n" for item in self.items))

    def append(self, item: dict[str, Any]) -> None:
        """Appends one item's line, synced; a write that fails part-way (a full disk, a signal) is cut back to
        where the line began, so the log never ends in half a line."""
        line = (json.dumps(item) + "\n").encode("utf-8")
        with disk_full_said(self.log, len(line)):
            # O_NONBLOCK: a FIFO put in the log's place fails at once (ENXIO) instead of waiting for a reader
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise UsageError(f"'{self.log}' is not a regular file; mpsimpact keeps the log of finished "
                                     "items there: move it away, or pass another --out.")
                _append_whole(fd, line)
            finally:
                os.close(fd)
        self.items.append(item)


def _append_whole(fd: int, line: bytes) -> None:
    """Writes `line` at the end of the open file `fd` (O_APPEND) and syncs it, or leaves the file as it was: a
    write stopped part-way (ENOSPC, a quota, Ctrl-C) is cut back to the file's length before it."""
    start = os.fstat(fd).st_size
    try:
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise


def _open_lock(partial: Path) -> int:
    """The partial folder's lock file, opened without following a link (a link there is removed)."""
    path = partial / ".lock"
    if path.is_symlink():
        _remove_link(path, "its lock")
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        raise UsageError(f"Cannot open the lock '{path}' ({error.strerror}); move it away, or pass another "
                         "--out.") from None


@contextlib.contextmanager
def resumable_folder(out: Path, identity: dict[str, Any], log: str) -> Iterator[ResumableFolder]:
    """Yields the hidden partial folder `.<out name>.partial` next to `out`, with what an earlier run of the
    same work (the same `identity`) finished in it; renames it to `out` when the block completes.

    A run killed at any point (any signal, Ctrl-C, power) leaves the partial folder for the next run of the
    same work to pick up. The folder is claimed by a lock while one process works in it (the system
    drops it when the process ends, however it ends). An interrupted run that finished nothing leaves
    nothing behind. Nothing in it is read or written through a symbolic link: a link in the place of the
    folder or of a file in it is removed (the link only), with one warning line.

    Raises:
        UsageError: another process holds the folder, or it holds work of another identity.
    """
    out = Path(out)
    partial = out.parent / f".{out.name}.partial"
    if partial.is_symlink():
        _remove_link(partial, "the unfinished work of this command")
    if partial.exists() and not partial.is_dir():  # a file, a FIFO: someone else's; left as it is
        raise UsageError(f"'{partial}' is not a folder, so not one this command made; it keeps its unfinished "
                         "work there: move it away, or pass another --out.")
    created = not partial.exists()
    partial.mkdir(parents=True, exist_ok=True)
    fd = _open_lock(partial)
    with os.fdopen(fd, "r+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"Another mpsimpact process is writing '{partial}'; wait for it to end, or pass "
                             "another --out.") from None
        folder = None
        try:
            _claim_identity(partial, identity)
            folder = ResumableFolder(partial, log)
            yield folder
            for name in (".lock", "identity.json"):
                (partial / name).unlink()
            if out.is_dir() and not out.is_symlink():
                out.rmdir()  # fresh_out_dir allowed only an empty folder
            os.replace(partial, out)
        except BaseException:
            if created and (folder is None or not folder.items):
                shutil.rmtree(partial, ignore_errors=True)
            raise


def _claim_identity(partial: Path, identity: dict[str, Any]) -> None:
    """Records `identity` in a new partial folder, or checks that an existing one holds the same work."""
    path = partial / "identity.json"
    if not path.exists() and not path.is_symlink():
        atomic_write_text(path, json.dumps(identity, indent=2) + "\n")
        return
    try:
        saved = parse_json(read_no_link(path) or b"")
    except (OSError, ValueError):  # a link, a folder, garbled: not this command's
        saved = {}
    saved = saved if isinstance(saved, dict) else {}
    differing = sorted(key for key in identity.keys() | saved.keys() if identity.get(key) != saved.get(key))
    if differing:
        parts = ", ".join(f"{key} {_value(saved, key)} there, {_value(identity, key)} now" for key in differing)
        raise UsageError(f"'{partial}' holds the unfinished work of another command ({parts}); rerun that "
                         "command to finish it, or delete the folder, or pass another --out.")


def _value(fields: dict, key: str) -> str:
    """A field's value as a sentence says it: its repr, or "not recorded" where the file has no such field."""
    return "not recorded" if fields.get(key) is None else repr(fields[key])
