"""Progress of the long steps of a command, on stderr: a rich bar on a terminal, else one line when a step
starts, at each quarter and at its end (a log: CI, nohup, a pipe); both say the time left, estimated from the
pace so far."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

Advance = Callable[[int], None]  # called with how many units of the step were just done
Steps = Callable[[str, int], Advance]  # (description, total units) -> that step's Advance


@contextlib.contextmanager
def progress_steps(console: Any = None) -> Iterator[Steps]:
    """Yields `make(description, total)`, which starts a step and returns its `advance(n)`. On a terminal a
    bar with the time elapsed and left; elsewhere log lines (`log_steps`)."""
    from mpsimpact.output.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.progress import TimeRemainingColumn

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield log_steps(console.print)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        def make(description: str, total: int) -> Advance:
            task = progress.add_task(description, total=total)
            return lambda n: progress.advance(task, n)

        yield make


def log_steps(say: Callable[..., Any], clock: Callable[[], float] = time.perf_counter) -> Steps:
    """Steps for a log: `say` gets a line when a step starts, at each quarter ("12/48 (3 s, about 9 s left)")
    and at its end; the time left is the pace so far times what remains (an estimate, said as one)."""
    def make(description: str, total: int) -> Advance:
        done, marks, start = [0], {max(1, total * q // 4) for q in (1, 2, 3, 4)}, clock()
        say(f"{description}: started ({total:,} step{'s' if total != 1 else ''})")

        def advance(n: int) -> None:
            before, done[0] = done[0], done[0] + n
            if any(before < mark <= done[0] for mark in marks):
                elapsed, left = clock() - start, total - done[0]
                pace = f", about {elapsed / max(done[0], 1) * left:.0f} s left" if left > 0 else ""
                say(f"{description}: {done[0]:,}/{total:,} ({elapsed:.0f} s{pace})")

        return advance

    return make
