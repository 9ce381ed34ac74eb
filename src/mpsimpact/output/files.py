"""State we write and how it is kept honest: files written atomically (a temporary file or folder, then a
rename), report folders checked and claimed before any work (given back on failure; see output.signals for
SIGTERM), and the cache folder. Nothing here knows about runs or models."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import functools
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mpsimpact.bounds import kind_of, kind_problem, name_problem, shown_path
from mpsimpact.errors import DiskFullError, UsageError, said

CLAIM_MARKER = ".mpsimpact-claim"  # inside a claimed --out folder while its report is being written
MIN_FREE_BYTES = 16 << 20  # refuse an --out on a disk with less free: reports hold figures and logits
_PARTIAL_FILE = re.compile(r"^\..+\.([0-9]+)\.[^.]+\.partial$")  # atomic_write_bytes' temporary files


def warn(message: str) -> None:
    """One paragraph on stderr (errors.said): for state we could not use and worked around (never for a
    failure)."""
    print(said("warning", message), file=sys.stderr, flush=True)


def is_process_alive(pid: int) -> bool:
    """Whether a process with this id runs (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def target_problem(path: str | Path) -> str | None:
    """What keeps a file from being written at `path`, as a predicate, or None: a name the system cannot take,
    or anything there but a regular file (a folder, a FIFO, a socket, a device node, a symbolic link, dangling
    or not). Opens nothing; see Note [Only regular files] in bounds."""
    problem = name_problem(path)
    if problem is not None:
        return problem
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None  # nothing there (creating it may fail, as its own error)
    except OSError as error:
        return f"cannot be looked at ({error.strerror})"
    if stat.S_ISLNK(mode):
        return f"is a symbolic link (to '{shown_path(os.readlink(path), 60)}'), not a regular file"
    return kind_problem(mode)


def refuse_target(path: str | Path, flag: str = "") -> None:
    """Raises UsageError unless a file may be written at `path` (`target_problem`): a new name or a regular
    file. `flag` names the option it came from ("--figure"), if any."""
    problem = target_problem(path)
    if problem is not None:
        named = f"{flag} '{shown_path(path)}'" if flag else f"'{shown_path(path)}'"
        raise UsageError(f"{named} {problem}; mpsimpact writes a file only where there is none or over a regular "
                         "file, so it was left as it is: move it away or write elsewhere.", option=flag or None,
                         path=str(path))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file beside it and a rename: never half-written, and never
    over anything but a regular file (`refuse_target`, checked again just before the rename). The temporary
    file carries this process's id, so `remove_dead_partials` can tell a killed writer's leftovers."""
    path = Path(path)
    refuse_target(path)
    with disk_full_said(path, len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        # The name's head only: a name near the file system's limit leaves no room for the suffixes.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.{os.getpid()}.", suffix=".partial")
        try:
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; reports are meant to be shared
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            refuse_target(path)  # something put there while we wrote stays too
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


# errno values that mean "the disk (or the quota) is full": a write fails in one line, not a traceback.
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@contextlib.contextmanager
def disk_full_said(path: Path, size: int) -> Iterator[None]:
    """Turns a full disk (ENOSPC, a quota, a file too large) while writing `path` into DiskFullError, one line
    naming the file, the bytes and the free space; the caller's cleanup (temporary files, partial folders)
    runs as for any other error."""
    try:
        yield
    except OSError as error:
        if error.errno not in _FULL:
            raise
        try:
            free = f"{shutil.disk_usage(Path(path).parent).free >> 20} MiB free"
        except OSError:
            free = "free space unknown"
        raise DiskFullError(f"No space left to write '{path}' ({size:,} bytes, {free}: {error.strerror}); free some "
                            "space or write elsewhere. Nothing was left half-written.", path=str(path)) from None


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def remove_dead_partials(folder: Path) -> int:
    """Removes the temporary files of `atomic_write_bytes` in `folder` whose writer no longer runs
    (killed with SIGKILL, or by a power cut); returns how many. A live writer's file is left alone."""
    removed = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            match = _PARTIAL_FILE.match(entry.name)
            if match and not is_process_alive(int(match[1])):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def check_out_file(path: str | Path, flag: str) -> Path:
    """A file we will write later (e.g. `--figure`), checked before any work: a name the system takes, its
    folder exists and is writable, and nothing is there but a regular file (`target_problem`). Creates
    nothing."""
    file = Path(path)
    if not str(path).strip():
        raise UsageError(f"{flag} must name a file, got ''.", option=flag)
    problem = name_problem(file)
    if problem is not None:
        raise UsageError(f"{flag} '{shown_path(file)}' {problem}; pass a shorter path.", option=flag)
    if file.is_dir() and not file.is_symlink():
        raise UsageError(f"{flag} '{file}' is a folder; pass a file name.", option=flag)
    folder = file.parent
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise UsageError(f"{flag} '{file}': '{folder}' {what}; create the folder first or pass another path.",
                         option=flag)
    refuse_target(file, flag)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} '{file}': cannot write in '{folder}' (permission denied); pass another path.",
                         option=flag)
    check_free_space(folder, MIN_FREE_BYTES, f"{flag} '{file}'", flag)
    return file


def check_writable_folder(folder: Path, flag: str, needed: int = MIN_FREE_BYTES) -> None:
    """Raises UsageError unless `folder` is a folder we can write in, or one we can create (its nearest
    existing parent is a writable folder; not a symbolic link), on a disk with `needed` bytes free. Creates
    nothing."""
    folder = Path(folder)
    refuse_folder_name(folder, flag)
    if folder.is_symlink():
        raise UsageError(f"{flag} '{folder}' is a symbolic link; pass the folder it points to, or another {flag} "
                         "(mpsimpact never writes through a link).", option=flag)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} '{folder}' is {kind_of(os.stat(folder).st_mode)}, not a folder; pass another "
                         f"{flag}.", option=flag)
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag} '{folder}': '{existing}' is {kind_of(os.stat(existing).st_mode)}, not a folder; "
                         f"pass another {flag}.", option=flag)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} '{folder}': cannot write in '{existing}' (permission denied); pass another {flag}.",
                         option=flag)
    check_free_space(existing, needed, f"{flag} '{folder}'", flag)


def is_inside(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies inside it, links resolved (either may not exist yet)."""
    return Path(path).resolve().is_relative_to(Path(folder).resolve())


def refuse_folder_name(folder: Path, flag: str) -> None:
    """Raises UsageError when `folder`, or the hidden partial folder written beside it first, has a name the
    system cannot take (too long a name or path): said before any work, not by a failed write at the end."""
    folder = Path(folder)
    problem = name_problem(folder)
    if problem is not None:
        raise UsageError(f"{flag} '{shown_path(folder)}' {problem}; pass a shorter {flag}.", option=flag)
    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    if name_problem(partial) is not None:
        raise UsageError(f"{flag} '{shown_path(folder)}': the partial folder written beside it first "
                         f"('{shown_path(partial.name, 60)}') {name_problem(partial)}; pass a shorter {flag}.",
                         option=flag)


def check_free_space(existing: Path, needed: int, what: str, flag: str) -> None:
    """Raises UsageError unless the disk of `existing` has `needed` bytes free (and MIN_FREE_BYTES)."""
    free = shutil.disk_usage(existing).free
    needed = max(needed, MIN_FREE_BYTES)
    if free < needed:
        raise UsageError(f"{what} is on a disk with {free >> 20} MiB free, and this command writes up to "
                         f"{-(-needed >> 20)} MiB there; free some space or pass another {flag}.", option=flag)


def default_out_dir(default_prefix: str) -> Path:
    """outputs/<prefix>-<timestamp>/, with -2, -3 ... when another run took that second's name."""
    base = Path("outputs") / f"{default_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder, number = base, 1
    while folder.exists():
        number += 1
        folder = base.with_name(f"{base.name}-{number}")
    return folder


def fresh_out_dir(out: str | None, default_prefix: str, needed: int = MIN_FREE_BYTES) -> Path:
    """The report folder, `out` or outputs/<prefix>-<timestamp>/, checked but not claimed (creates nothing): it
    can be created (or is an empty folder) and written, with `needed` bytes (at most what the command writes
    there) free on its disk, so a run never computes for a folder it cannot write. Commands call
    `claimed_out_dir` instead, which also claims it."""
    if out is not None and not str(out).strip():
        raise UsageError("--out must name a folder, got ''.", option="--out")
    folder = Path(out) if out else default_out_dir(default_prefix)
    if folder.name in ("", ".", "..") or ".." in folder.parts:  # 'sub/..' would create sub/ on its way
        folder = Path(os.path.normpath(folder))
    if is_inside(Path.cwd(), folder):  # the report replaces the folder whole: not the one the shell stands in
        raise UsageError(f"--out '{out}' is the current folder (or holds it), which the report cannot replace "
                         "while you are in it; pass a new folder's name, e.g. --out report.", option="--out")
    refuse_folder_name(folder, "--out")
    if folder.is_dir() and not folder.is_symlink():
        entries = os.listdir(folder)
        if CLAIM_MARKER in entries:
            _refuse_live_claim(folder, "--out")
        if any(name != CLAIM_MARKER for name in entries):
            raise UsageError(f"Output folder '{folder}' already exists and is not empty; pass another --out.",
                             option="--out")
    check_writable_folder(folder, "--out", needed)
    return folder


@dataclasses.dataclass
class _Claim:
    folder: Path
    fd: int  # the marker, flock-ed for as long as this process holds the claim
    created: bool  # this claim made the folder (so giving it back removes it again)
    made: tuple[Path, ...] = ()  # the folders above it the claim made, innermost first (removed with it)


_CLAIMS: dict[Path, _Claim] = {}
_CLAIMS_LOCK = threading.Lock()


@functools.cache
def _unclaim_at_exit() -> None:
    atexit.register(unclaim_all_out_dirs)  # once: claims a crash or sys.exit left


@contextlib.contextmanager
def _locked_folder(folder: Path) -> Iterator[None]:
    """An exclusive flock on a folder, held briefly: claimants of names in it take turns."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield  # cannot open it for a lock (exotic file systems): claims still refuse live markers
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _claim_holder(marker: Path) -> int | None:
    """The process id holding a claim marker, or None when the claim is stale (its holder died: the
    kernel released its lock) or the marker vanished."""
    try:
        fd = os.open(marker, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)
    return None


def _refuse_live_claim(folder: Path, flag: str) -> None:
    """Raises UsageError when a live writer holds the claim marker in `folder` (this process included)."""
    holder = os.getpid() if folder.absolute() in _CLAIMS else _claim_holder(folder / CLAIM_MARKER)
    if holder is not None:
        who = "another command of this process" if holder == os.getpid() else "another mpsimpact process"
        pid = f" (pid {holder})" if holder > 0 else ""
        raise UsageError(f"Output folder '{folder}' is being written by {who}{pid}; wait for it to finish or pass "
                         f"another {flag}.", option=flag)


def _make_or_adopt(folder: Path) -> bool:
    """Creates `folder`, or adopts an empty one (or one a dead claim left); True when the claim owns
    the folder (it removes it again when given back)."""
    try:
        os.mkdir(folder)
        return True
    except FileExistsError:
        pass
    if not folder.is_dir():
        raise UsageError(f"--out '{folder}' is a file, not a folder; pass another --out.", option="--out")
    entries = set(os.listdir(folder))
    stale = CLAIM_MARKER in entries
    if stale:
        _refuse_live_claim(folder, "--out")
        (folder / CLAIM_MARKER).unlink(missing_ok=True)  # left by a killed process
    if entries - {CLAIM_MARKER}:
        raise UsageError(f"Output folder '{folder}' already exists and is not empty; pass another --out.",
                         option="--out")
    return stale


def remove_dead_partial_folders(folder: Path) -> None:
    """`.NAME.partial-PID/` folders next to `folder` whose writer no longer runs."""
    for partial in folder.parent.glob(f".{folder.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isascii() and pid.isdigit() and int(pid) != os.getpid() and not is_process_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def claim_out_dir(out: str | None, default_prefix: str, needed: int = MIN_FREE_BYTES) -> Path:
    """Checks and claims the report folder before any work: `out` (or outputs/<prefix>-<timestamp>/) is
    created, or adopted when empty, with a marker this process holds a lock on, so a second writer is
    refused at once (the lock dies with the process: a killed writer's claim is taken over). Stale
    partial folders of killed writers next to it are removed. `folder_written_atomically` fills it;
    `unclaim_out_dir` (or the end of the process) gives it back unfilled.

    Raises:
        UsageError: not creatable, not writable, not empty, claimed by a live process, or a full disk.
    """
    folder = fresh_out_dir(out, default_prefix, needed)  # refuses a folder this process claimed, too
    key = folder.absolute()
    with _CLAIMS_LOCK:
        made = tuple(p for p in (folder.parent, *folder.parent.parents) if not os.path.lexists(p))
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--out '{folder}' cannot be created ({error.strerror}); pass another --out.") from None
        with _locked_folder(folder.parent):
            created = _make_or_adopt(folder)
            try:
                fd = os.open(folder / CLAIM_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(fd, f"{os.getpid()}\n".encode())
            except OSError as error:
                if created:
                    shutil.rmtree(folder, ignore_errors=True)
                _remove_empty(made)
                raise UsageError(f"--out '{folder}' cannot be written ({error.strerror}); "
                                 "pass another --out.") from None
            remove_dead_partial_folders(folder)
        _CLAIMS[key] = _Claim(folder, fd, created, made)
    _unclaim_at_exit()
    return folder


def unclaim_out_dir(folder: Path) -> None:
    """Gives back a claim `folder_written_atomically` did not fill: the marker goes, and the folder too
    when the claim created it and it is still empty. Does nothing for a filled or unclaimed folder."""
    with _CLAIMS_LOCK:
        claim = _CLAIMS.pop(Path(folder).absolute(), None)
    if claim is None:
        return
    with _locked_folder(claim.folder.parent):
        (claim.folder / CLAIM_MARKER).unlink(missing_ok=True)
        if claim.created:
            with contextlib.suppress(OSError):
                claim.folder.rmdir()
                _remove_empty(claim.made)
    os.close(claim.fd)


def _remove_empty(folders: tuple[Path, ...]) -> None:
    """Removes `folders` (innermost first) while each is empty: the folders a claim made above --out."""
    with contextlib.suppress(OSError):
        for folder in folders:
            folder.rmdir()


def unclaim_all_out_dirs() -> None:
    """Gives back every claim this process still holds (at exit, and on SIGTERM/SIGHUP)."""
    for folder in [claim.folder for claim in list(_CLAIMS.values())]:
        unclaim_out_dir(folder)


@contextlib.contextmanager
def claimed_out_dir(out: str | None, default_prefix: str, *, default: bool = True,
                    needed: int = MIN_FREE_BYTES) -> Iterator[Path | None]:
    """`claim_out_dir` for the length of a command: the claim is given back if the block ends without
    filling the folder (an error, Ctrl-C, SIGTERM). With `default=False` and no `out`, yields None
    (the command writes no folder). `needed`: the bytes the command writes there, at most."""
    if out is None and not default:
        yield None
        return
    folder = claim_out_dir(out, default_prefix, needed)
    try:
        yield folder
    finally:
        unclaim_out_dir(folder)


@contextlib.contextmanager
def folder_written_atomically(out: Path) -> Iterator[Path]:
    """Yields a hidden partial folder to fill; renames it to `out` only when the block completes,
    and removes it otherwise: an interrupted run leaves no complete-looking report. A folder this
    process claimed (`claim_out_dir`) is filled and its claim ends; an unclaimed `out` must be absent
    or empty."""
    out = Path(out)
    key = out.absolute()
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    if out.parent.is_dir():
        remove_dead_partial_folders(out)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        with _locked_folder(out.parent):
            if key in _CLAIMS:
                (out / CLAIM_MARKER).unlink(missing_ok=True)
            if out.is_dir() and os.listdir(out):
                raise UsageError(f"Output folder '{out}' was written by another process while this one ran; "
                                 "pass another --out.", option="--out")
            os.replace(partial, out)  # onto an empty folder too: the claimed one
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    with _CLAIMS_LOCK:
        claim = _CLAIMS.pop(key, None)
    if claim is not None:
        os.close(claim.fd)
