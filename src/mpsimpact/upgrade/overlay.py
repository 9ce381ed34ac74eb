"""Overlay environments: one folder per transformers release holding that release and the packages it
needs in versions other than the running interpreter's (torch always comes from the running
interpreter). Built with uv, cached under the mpsimpact cache folder, reused offline; a probe runs
in each with the overlay first on PYTHONPATH."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mpsimpact.bounds import parse_json, read_file_bytes
from mpsimpact.errors import OverlayError, UsageError
from mpsimpact.engine.release import cache_root
from mpsimpact.output.files import remove_dead_partial_folders, warn
from mpsimpact.output.signals import end_with_parent

MARKER = ".mpsimpact-overlay.json"  # written last: a folder without it is an interrupted build
MAX_MARKER_BYTES = 1 << 20
EXCLUDED = frozenset({"torch"})  # must come from the running interpreter, never from an overlay
INSTALL_TIMEOUT_S = 900
PROBE_TIMEOUT_S = 600
# How long a build waits for another process building or probing the same environment (it holds the
# environment's lock file): two installs and a probe.
LOCK_TIMEOUT_S = 2 * INSTALL_TIMEOUT_S + PROBE_TIMEOUT_S

Builder = Callable[[str, Path], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Overlay:
    """A complete overlay folder for one transformers release."""

    version: str
    path: Path
    cached: bool  # found complete in the cache (not built by this call)
    build_s: float  # seconds this call spent finding or building it
    marker: dict[str, Any]


def normalize(name: str) -> str:
    """A distribution name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_distributions() -> dict[str, str]:
    """{normalized name: version} of every distribution the running interpreter sees."""
    import importlib.metadata

    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    return found


def last_line(text: str) -> str:
    """The last non-empty line of a tool's output: where pip and uv put the reason."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def tool_error(text: str) -> str:
    """uv's or pip's failure in one line: its "error:" line, then the last line (the innermost cause)."""
    last = re.sub(r"^(cause|error|ERROR):\s*", "", last_line(text))
    error = next((line.strip()[6:].strip() for line in text.splitlines() if line.strip().startswith("error:")), "")
    return f"{error}: {last}" if error and error != last else last


def uv_executable() -> str:
    """The uv binary: the `uv` package's, else one on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if found is None:
        raise OverlayError("uv is needed to build transformers environments and is not installed; "
                           "run: pip install uv")
    return found


def _run(command: list[str], timeout: float) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False,
                              env=os.environ | {"NO_COLOR": "1"}, preexec_fn=end_with_parent)
    except subprocess.TimeoutExpired:
        what = " ".join([Path(command[0]).name, *command[1:3]])
        raise OverlayError(f"{what} took longer than {timeout:.0f} s") from None
    if done.returncode != 0:
        raise OverlayError(tool_error(done.stderr or done.stdout))
    return done.stdout


class UvBuilder:
    """Builds an overlay with uv: resolves `transformers==V` preferring the running interpreter's
    versions, then installs (without dependencies) only the pins that differ from them, never torch."""

    def __init__(self, python: str = sys.executable, timeout: float = INSTALL_TIMEOUT_S) -> None:
        self.python, self.timeout = python, timeout

    def __call__(self, version: str, target: Path) -> dict[str, Any]:
        installed = installed_distributions()
        if installed.get("transformers") == version:  # the running interpreter's own: nothing differs
            return {"installed": [], "reused": {"transformers": version}, "excluded": []}
        pins = self.resolve(version, installed)
        differ = [(n, v) for n, v in pins if n not in EXCLUDED and installed.get(n) != v]
        if differ:
            _run([uv_executable(), "pip", "install", "--target", str(target), "--no-deps", "--python", self.python,
                  *[f"{n}=={v}" for n, v in differ]], self.timeout)
        return {
            "installed": [f"{n}=={v}" for n, v in differ],
            "reused": {n: v for n, v in pins if n not in EXCLUDED and installed.get(n) == v},
            "excluded": [f"{n}=={v}" for n, v in pins if n in EXCLUDED],
        }

    def resolve(self, version: str, installed: dict[str, str]) -> list[tuple[str, str]]:
        """(name, version) of transformers==V and everything it needs, as uv resolves them for this
        interpreter; an existing output file is uv's preference list, so it keeps installed versions."""
        with tempfile.TemporaryDirectory(prefix="mpsimpact-resolve-") as work:
            wanted, pinned = Path(work, "requirements.in"), Path(work, "requirements.txt")
            wanted.write_text(f"transformers=={version}\n")
            pinned.write_text("".join(f"{n}=={v}\n" for n, v in sorted(installed.items()) if n not in EXCLUDED))
            _run([uv_executable(), "pip", "compile", str(wanted), "-o", str(pinned), "--python", self.python,
                  "--no-header", "--no-annotate", "--quiet"], self.timeout)
            lines = pinned.read_text().splitlines()
        pins = []
        for line in lines:
            match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line.strip())
            if match:
                pins.append((normalize(match[1]), match[2]))
        return pins


def python_tag() -> str:
    return f"py{sys.version_info.major}.{sys.version_info.minor}"


def stale_reason(marker: dict[str, Any], installed: dict[str, str]) -> str | None:
    """Why a built overlay no longer fits the running interpreter (a package it relies on changed)."""
    if marker.get("python") != python_tag():
        return f"built for {marker.get('python')}, running {python_tag()}"
    for name, version in marker.get("reused", {}).items():
        if installed.get(name) != version:
            return f"{name} {version} is now {installed.get(name, 'missing')} in the running environment"
    return None


class OverlayCache:
    """The overlay folders under <cache>/envs, one per transformers release and Python version. Each has
    a lock file next to it (`.NAME.lock`): shared while the overlay is used, exclusive while it is built,
    so a build never replaces an environment under a process probing it."""

    def __init__(self, root: Path | None = None, builder: Builder | None = None, *,
                 lock_timeout: float = LOCK_TIMEOUT_S) -> None:
        self.root = Path(root) if root is not None else cache_root() / "envs"
        self.builder = builder or UvBuilder()
        self.lock_timeout = lock_timeout

    def path_for(self, version: str) -> Path:
        return self.root / f"transformers-{version}-{python_tag()}"

    def lock_path(self, version: str) -> Path:
        return self.root / f".{self.path_for(version).name}.lock"

    def check_root(self) -> None:
        """Raises UsageError when the cache's environment folder is a file (nothing can be kept there)."""
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"The environment cache '{self.root}' is a file, not a folder; remove it, or set "
                             "MPSIMPACT_CACHE to another folder.")

    def read_marker(self, version: str) -> dict[str, Any] | None:
        """The marker of a complete overlay, or None (absent, interrupted, unreadable or damaged)."""
        try:
            # never a FIFO opened: Note [Only regular files]; a marker is a few kB
            marker = parse_json(read_file_bytes(self.path_for(version) / MARKER, MAX_MARKER_BYTES, "a marker"))
        except ValueError:  # FileProblemError among them
            return None
        fields_ok = isinstance(marker, dict) and isinstance(marker.get("reused", {}), dict) and isinstance(
            marker.get("installed", []), list) and marker.get("transformers", version) == version
        return marker if fields_ok else None

    def ensure(self, version: str, *, offline: bool = False) -> Overlay:
        """The overlay of `version`: from the cache when complete and fresh, else built (not offline).
        Not held against a rebuild afterwards: `using` holds it.

        Raises:
            OverlayError: offline and not cached (or stale), the build failed (uv's last line), or another
                process held the environment's lock past `lock_timeout`.
        """
        with self.using(version, offline=offline) as overlay:
            return overlay

    @contextlib.contextmanager
    def using(self, version: str, *, offline: bool = False) -> Iterator[Overlay]:
        """`ensure`, with the overlay held (a shared lock) until the block ends: other processes may use
        it too, none may rebuild it."""
        started = time.perf_counter()
        if self.root.exists() and not self.root.is_dir():
            raise OverlayError(f"transformers {version}: the environment cache {self.root} is a file, not a folder",
                               version=version, stage="missing" if offline else "build")
        with self._locked(version, fcntl.LOCK_SH, offline) as lock:
            marker = self.read_marker(version)
            stale = stale_reason(marker, installed_distributions()) if marker is not None else None
            cached = marker is not None and stale is None
            if not cached and offline:
                why = f"stale ({stale})" if stale else "not in the cache"
                raise OverlayError(f"transformers {version}: {why} at {self.path_for(version)}; run once with the "
                                   "package index reachable (without --offline)", version=version, stage="missing")
            if not cached:
                self._relock(lock, version, fcntl.LOCK_EX)
                marker = self.read_marker(version)  # another process may have built it while we waited
                cached = marker is not None and stale_reason(marker, installed_distributions()) is None
                if not cached:
                    marker = self._build(version)
                self._relock(lock, version, fcntl.LOCK_SH)
            yield Overlay(version, self.path_for(version), cached, round(time.perf_counter() - started, 2), marker)

    @contextlib.contextmanager
    def _locked(self, version: str, how: int, offline: bool) -> Iterator[int | None]:
        """The environment's lock file, locked `how`; None (no lock) offline in a cache we cannot write."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path(version), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            if offline:
                yield None  # reading a read-only cache: nobody can build in it either
                return
            raise OverlayError(f"transformers {version}: the environment cache {self.root} cannot be written "
                               f"({error.strerror or error})", version=version, stage="build") from None
        try:
            self._relock(fd, version, how)
            yield fd
        finally:
            os.close(fd)

    def _relock(self, fd: int | None, version: str, how: int) -> None:
        """Takes (or converts to) `how` on the lock, waiting up to `lock_timeout` with one line saying so."""
        if fd is None:
            return
        if how == fcntl.LOCK_EX:
            fcntl.flock(fd, fcntl.LOCK_UN)  # an upgrade is never atomic: say so, so two upgraders cannot deadlock
        deadline = None
        while True:
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if deadline is None:  # the first try: one line saying whom it waits for
                    what = "building or using" if how == fcntl.LOCK_EX else "building"
                    warn(f"transformers {version}: waiting for another mpsimpact process {what} "
                         f"{self.path_for(version)} (up to {self.lock_timeout:.0f} s).")
                    deadline = time.monotonic() + self.lock_timeout
                elif time.monotonic() > deadline:
                    raise OverlayError(f"transformers {version}: another mpsimpact process held "
                                       f"{self.lock_path(version)} for more than {self.lock_timeout:.0f} s; "
                                       "try again when it has finished",
                                       version=version, stage="locked") from None
            time.sleep(min(0.2, max(self.lock_timeout, 0.01)))

    def _build(self, version: str) -> dict[str, Any]:
        """Builds into a hidden partial folder, writes the marker last, then renames it into place (under
        the exclusive lock)."""
        final = self.path_for(version)
        remove_dead_partial_folders(final)
        partial = final.parent / f".{final.name}.partial-{os.getpid()}"
        started = time.perf_counter()
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            details = self.builder(version, partial)
            if any((partial / name).exists() for name in EXCLUDED):
                raise OverlayError(f"transformers {version}: the overlay would install torch, which must come from the "
                                   "running interpreter")
            marker = {"transformers": version, "python": python_tag(), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      "build_s": round(time.perf_counter() - started, 2), **details}
            (partial / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)  # an older, stale or markerless folder
            elif final.exists() or final.is_symlink():
                final.unlink()  # a file (or link) in the folder's place
            os.replace(partial, final)
        except BaseException as error:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(error, OSError):
                raise OverlayError(f"transformers {version}: the environment could not be written at {final} "
                                   f"({error.strerror or error})", version=version, stage="build") from None
            raise
        return marker


def probe_environment(overlay: Path, job: dict[str, Any], timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Runs `python -m mpsimpact.upgrade.probe` with `overlay` first on PYTHONPATH; its JSON result.

    Raises:
        OverlayError: the probe crashed, timed out or reported an error (its first line).
    """
    package_parent = Path(__file__).resolve().parents[2]  # the running mpsimpact's: src/ or site-packages
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(overlay), str(package_parent)]), "PYTHONNOUSERSITE": "1",
                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        # -P: the working folder is not put on sys.path, so nothing there shadows the overlay.
        done = subprocess.run([sys.executable, "-P", "-m", "mpsimpact.upgrade.probe"], input=json.dumps(job),
                              capture_output=True, text=True, timeout=timeout, check=False, env=env,
                              preexec_fn=end_with_parent)
    except subprocess.TimeoutExpired:
        raise OverlayError(f"the probe took longer than {timeout:.0f} s", stage="probe") from None
    try:
        result = json.loads(last_line(done.stdout))
    except ValueError:
        message = f"the probe exited with code {done.returncode}: {last_line(done.stderr)}"
        raise OverlayError(message, stage="probe") from None
    if "error" in result:
        raise OverlayError(result["error"], stage="probe")
    return result
