"""The guard's face: `guard()` (a block), `install_thread_guard()` (the rest of a thread's work) and their
deprecated names. What a guard does is GuardMode's (modes/guard_mode.py): it stops (raise), flags (warn)
or safely splits (chunk) every call that would fault on MPS under a torch release's profile."""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

from mpsimpact.modes.base import push_active, remove_active
from mpsimpact.modes.entrypoint import push_handler, remove_handler
from mpsimpact.errors import UsageError
from mpsimpact.engine.faults import MPS_INDEX_BITS, Profile
from mpsimpact.variables import guard_mode
from mpsimpact.modes.guard_mode import GuardMode

# Guards installed by install_thread_guard: each thread's own list (innermost last), and which threads
# hold one, so a call from another thread can say where its guard is.
_INSTALLED = threading.local()
_HOLDERS: dict[int, tuple[str, int]] = {}  # thread id -> (thread name, installed guards)
_HOLDERS_LOCK = threading.Lock()


def guard(mode: str = "raise", *, index_bits: int = MPS_INDEX_BITS, devices: tuple[str, ...] | None = None,
          profile: Profile = None, strict: bool = False) -> GuardContext:
    """Guards every bmm/mm/SDPA/cat call that would fault on MPS (with `strict`, every op), on this thread
    (threads started inside the block are not guarded: see `install_thread_guard`).

    Args:
        mode: "raise" (stop before the op runs with `OversizedOpError`), "warn" (warn once per op
            site, then run it) or "chunk" (split it into safe pieces; the result is correct).
        index_bits: index width of the rules (under `emulate()` the emulator's decisions are used).
        devices: device types to guard; None means MPS tensors, and any tensor under `emulate()`.
        profile: the torch release whose faults to guard against ("2.12.1"); None: the installed one.
        strict: look at every aten op through the dispatch mode (slower), also covering calls that
            do not pass through Python entry points (TorchScript, names bound before the guard), and
            every op family past the per-dimension limit (elementwise, softmax, reductions, copies,
            lookups, creation: Note [Op families past INT_MAX]); the fast path leaves those to it.

    Returns:
        A context manager (also a decorator) whose `with` yields the active `GuardMode`; `stopped` and
        `chunked` list the calls it acted on.
    """
    return GuardContext(mode, {"index_bits": index_bits, "devices": devices, "profile": profile, "strict": strict})


class GuardContext(contextlib.ContextDecorator):
    """What `guard()` returns: entering it makes the `GuardMode` (then, so that it sees an emulator entered
    since) and activates it on this thread, leaving takes it away (a class, not a generator: a guard entered
    around each small batch pays for the entering too). Used as a decorator, each call gets its own."""

    def __init__(self, mode: str, options: dict) -> None:
        self._mode, self._options = mode, options
        self.mode: GuardMode | None = None

    def _recreate_cm(self) -> GuardContext:
        return GuardContext(self._mode, self._options)

    def __enter__(self) -> GuardMode:
        mode = self.mode = GuardMode(self._mode, **self._options)
        push_active("guard", mode)
        try:
            push_handler(mode)
            try:
                mode.begin()
            except BaseException:
                remove_handler(mode)
                raise
        except BaseException:
            remove_active("guard", mode)
            raise
        return mode

    def __exit__(self, *exc: Any) -> None:
        mode = self.mode
        try:
            mode.end(*exc)
        finally:
            try:
                remove_handler(mode)
            finally:
                remove_active("guard", mode)


def install_thread_guard(mode: str | None = None, **options: Any) -> GuardMode | None:
    """Installs a guard for the rest of this thread's work, until `uninstall_thread_guard()` on this
    thread. Other threads, also ones started later from this one, are not guarded: each thread that
    runs a model installs its own (or enters `guard()`).

    Why per thread: torch keeps dispatch modes per thread (a strict guard, or one under `emulate()`,
    cannot follow a thread it was not entered on), and the emulator is per thread, so a process-wide
    guard would hold on some threads and not others, and meet other threads' emulators in an order
    nobody chose.

    Args:
        mode: raise, warn, chunk or off; default the environment variable MPSIMPACT_GUARD (unset: raise).
        **options: as `guard()` (index_bits, devices, profile, strict).

    Returns:
        The installed mode, or None for "off".
    """
    mode = mode or guard_mode() or "raise"
    if mode == "off":
        return None
    mode_obj = GuardMode(mode, **options)
    mode_obj.begin()
    push_active("guard", mode_obj)
    push_handler(mode_obj)
    _thread_guards().append(mode_obj)
    _count_holder(+1)
    return mode_obj


def uninstall_thread_guard() -> None:
    """Removes the guard `install_thread_guard()` installed last on this thread; does nothing if this
    thread has none and no other thread does.

    Raises:
        UsageError: this thread has none, but another thread has one (only that thread can remove it).
    """
    guards = _thread_guards()
    if not guards:
        alive = {thread.ident for thread in threading.enumerate()}
        with _HOLDERS_LOCK:
            others = sorted(name for ident, (name, count) in _HOLDERS.items() if count and ident in alive)
        if others:
            raise UsageError(
                f"uninstall_thread_guard() removes the guard installed on the calling thread; this thread has none, "
                f"the guard is on thread {others[0]!r}. Call uninstall_thread_guard() on that thread.")
        return
    mode_obj = guards.pop()
    _count_holder(-1)
    remove_handler(mode_obj)
    remove_active("guard", mode_obj)
    mode_obj.end(None, None, None)


def install_guard(mode: str | None = None, **options: Any) -> GuardMode | None:
    """Deprecated name of `install_thread_guard` (the guard was never process-wide)."""
    warnings.warn("mpsimpact.install_guard() guards only the calling thread; it is now called "
                  "install_thread_guard().", DeprecationWarning, stacklevel=2)
    return install_thread_guard(mode, **options)


def uninstall_guard() -> None:
    """Deprecated name of `uninstall_thread_guard`."""
    warnings.warn("mpsimpact.uninstall_guard() is now called uninstall_thread_guard().", DeprecationWarning,
                  stacklevel=2)
    uninstall_thread_guard()


def _thread_guards() -> list[GuardMode]:
    return _INSTALLED.__dict__.setdefault("guards", [])


def _count_holder(change: int) -> None:
    thread = threading.current_thread()
    with _HOLDERS_LOCK:
        count = _HOLDERS.get(thread.ident, (thread.name, 0))[1] + change
        if count:
            _HOLDERS[thread.ident] = (thread.name, count)
        else:
            _HOLDERS.pop(thread.ident, None)
