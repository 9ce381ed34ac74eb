"""Files we write: atomically (a temporary file or folder, then a rename), into a fresh report folder
that nothing is ever overwritten in."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

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
