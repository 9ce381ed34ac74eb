"""Signals that end us, handled like Ctrl-C: SIGTERM and SIGHUP become an exception in the main thread, so
every `finally` and `except BaseException` cleanup runs (partial folders, claims, temporary cache files,
child processes), then the process exits 128 + the signal's number."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import signal
import sys
import threading
from collections.abc import Iterator

from mpsimpact.output.files import unclaim_all_out_dirs


class TerminatedBySignal(BaseException):
    """SIGTERM or SIGHUP, raised where the program was (like KeyboardInterrupt for SIGINT), so every
    `finally` and `except BaseException` cleanup runs; `exit_cleanly_on_signals` turns it into exit
    128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")


@contextlib.contextmanager
def exit_cleanly_on_signals(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Handles SIGTERM and SIGHUP (kill, CI timeouts, schedulers, a closed terminal) like Ctrl-C: the
    signal raises `TerminatedBySignal` in the main thread, partial folders, claims and temporary cache
    files are removed on the way out, a child process run with `subprocess.run` is killed by it, and
    the block exits with SystemExit(128 + signal) (143 for SIGTERM, 129 for SIGHUP) after one line on
    stderr. Signals that come while cleaning up are ignored. Outside the main thread it does nothing
    (Python delivers signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        if received:
            return  # already on the way out: let the cleanup finish
        received.append(signum)
        raise TerminatedBySignal(signum)

    previous = {number: signal.signal(number, on_signal) for number in signals}
    try:
        yield
    except TerminatedBySignal as stop:
        unclaim_all_out_dirs()
        print(f"stopped by {stop.name}; partial output removed.", file=sys.stderr, flush=True)
        raise SystemExit(128 + stop.signum) from None
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent() -> None:
    """For `preexec_fn`: the child gets SIGKILL when the process that started it dies, even by SIGKILL
    (which no handler sees), so a killed command leaves no probe or sweep cell running. Linux only (prctl);
    elsewhere a no-op: there the child ends when it next writes to, or reads from, its closed pipe."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
