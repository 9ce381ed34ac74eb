"""Files we write: atomically (a temporary file or folder, then a rename), into a fresh report folder
that nothing is ever overwritten in."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mpsimpact.errors import UsageError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file and a rename: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; reports are meant to be shared
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def fresh_out_dir(out: str | None, default_prefix: str) -> Path:
    """The report folder: `out`, or outputs/<prefix>-<timestamp>/; refuses one that already holds
    files (nothing is overwritten)."""
    folder = Path(out) if out else Path("outputs") / f"{default_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    if folder.exists() and any(folder.iterdir()):
        raise UsageError(f"Output folder '{folder}' already exists and is not empty; pass another --out.")
    return folder


@contextlib.contextmanager
def folder_written_atomically(out: Path) -> Iterator[Path]:
    """Yields a hidden partial folder to fill; renames it to `out` only when the block completes,
    and removes it otherwise: an interrupted run leaves no complete-looking report."""
    out = Path(out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        if out.exists():
            out.rmdir()  # fresh_out_dir allowed only an empty folder
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


class ResumableFolder:
    """A report folder filled across runs (`resumable_folder`): the items finished so far, one JSON line
    each in `log`, appended and synced one by one, so that a kill loses at most the item under way."""

    def __init__(self, path: Path, log: str) -> None:
        self.path, self.log = path, path / log
        lines = self.log.read_text(encoding="utf-8").splitlines(keepends=True) if self.log.exists() else []
        self.items: list[dict[str, Any]] = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):  # a line a kill cut short is dropped
                if line.endswith("\n"):
                    self.items.append(json.loads(line))
        if len(self.items) != len(lines):
            atomic_write_text(self.log, "".join(json.dumps(item) + "\n" for item in self.items))
        self.resumed = len(self.items)

    def append(self, item: dict[str, Any]) -> None:
        with open(self.log, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(item) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.items.append(item)


@contextlib.contextmanager
def resumable_folder(out: Path, identity: dict[str, Any], log: str) -> Iterator[ResumableFolder]:
    """Yields the hidden partial folder `.<out name>.partial` next to `out`, with what an earlier run of the
    same work (the same `identity`) finished in it; renames it to `out` when the block completes.

    A run killed at any point (any signal, Ctrl-C, power) leaves the partial folder for the next run of the
    same work to pick up. The folder is claimed by a lock while one process works in it (the system
    drops it when the process ends, however it ends). An interrupted run that finished nothing leaves
    nothing behind.

    Raises:
        UsageError: another process holds the folder, or it holds work of another identity.
    """
    out = Path(out)
    partial = out.parent / f".{out.name}.partial"
    created = not partial.exists()
    partial.mkdir(parents=True, exist_ok=True)
    with open(partial / ".lock", "a") as lock:
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
            if out.exists():
                out.rmdir()  # fresh_out_dir allowed only an empty folder
            os.replace(partial, out)
        except BaseException:
            if created and (folder is None or not folder.items):
                shutil.rmtree(partial, ignore_errors=True)
            raise


def _claim_identity(partial: Path, identity: dict[str, Any]) -> None:
    """Records `identity` in a new partial folder, or checks that an existing one holds the same work."""
    path = partial / "identity.json"
    if not path.exists():
        atomic_write_text(path, json.dumps(identity, indent=2) + "\n")
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        saved = {}
    differing = sorted(key for key in identity.keys() | saved.keys() if identity.get(key) != saved.get(key))
    if differing:
        parts = ", ".join(f"{key} {saved.get(key)!r} there, {identity.get(key)!r} now" for key in differing)
        raise UsageError(f"'{partial}' holds the unfinished work of another command ({parts}); rerun that "
                         "command to finish it, or delete the folder, or pass another --out.")
