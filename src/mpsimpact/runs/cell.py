"""The sweep's cell protocol (a bmm, runs.sweep.Cell, or an op family's test, runs.family_cells.FamilyCell)
and the one pipeline that runs any cell: observed here or in a crash-tolerant worker process, not run over the
memory budget or a Mac's largest buffer (nor where the device refuses it), predicted, judged in its row."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import torch

from mpsimpact.engine.faults import Fault
from mpsimpact.engine.mac_memory import GIB, buffer_refuses, invalid_buffer_message, is_allocation_failure
from mpsimpact.output.signals import end_with_parent
from mpsimpact.runs.device import device_memory

# A row of a cell that was not run (over the memory budget or a Mac's largest buffer, or its allocation
# refused by the device): it decides nothing and agrees with nothing.
NOT_RUN = "skipped_memory"
# Why a cell was not run, in words; its row's message says which (the messages are made here: `why_not_run`).
NOT_RUN_WHY = {"max_memory": "over --max-memory", "largest_buffer": "reaching the largest buffer",
               "refused": "allocation refused by the device"}
REFUSED = "allocation refused"  # how the message of a cell whose allocation the device refused begins
BUFFER_WORDS = "the Mac's largest buffer"  # what the message of a cell over that buffer names
CHUNK_ELEMENTS = 1 << 24  # operands are drawn this many fp32 elements at a time, then cast in place
# Rough speeds before any cell has run, per device: (multiply-adds per second, elements drawn per second).
# A sweep rescales its estimate by the cells it has finished (CellClock).
SPEEDS = {"cpu": (2e10, 2e8), "cuda": (2e13, 2e10), "mps": (3e12, 3e9)}


class SweepCell(Protocol):
    """What the sweep asks of a cell: its `name` as people say it, the fault model's verdict (`predict`), the
    cell run and judged (`run`: the observation), whether a row's observation matches what is expected
    (`judge`), the observation of a cell that comes out as the rules say (`predicted_seen`), its own fields of
    a row (`row_fields`), what makes a read-back observation impossible, its size and time, and its JSON.
    Its class's module is the worker process (`python -m`) that runs it on a real device (`worker_main`)."""

    no_values: ClassVar[dict[str, Any]]  # the fields of an observation that judged no values
    seen_fields: ClassVar[tuple[str, ...]]  # the fields of a row that say what was observed
    control: ClassVar[dict[str, Any]]  # what a control device (neither MPS nor emulated) is expected to show
    row_defaults: ClassVar[dict[str, Any]]  # fields of a row before its observation, which may replace them

    @property
    def name(self) -> str: ...
    def predict(self, index_bits: int, profile: Any = None) -> Fault: ...
    def run(self, device: str, emulated: bool, index_bits: int, profile: Any) -> dict[str, Any]: ...
    def judge(self, row: dict[str, Any]) -> bool: ...
    def predicted_seen(self, index_bits: int, profile: Any) -> dict[str, Any]: ...
    def row_fields(self, index_bits: int, emulated: bool, profile: Any) -> tuple[dict, dict]: ...
    def observation_problem(self, seen: dict[str, Any]) -> str | None: ...
    def bytes_needed(self) -> int: ...
    def largest_tensor_bytes(self) -> int: ...
    def estimated_seconds(self, device: str) -> float: ...
    def to_json(self) -> dict[str, Any]: ...


def is_measured(row: dict[str, Any]) -> bool:
    """Whether a row's cell ran (a cell over the memory budget or the largest buffer, or whose allocation the
    device refused, did not, and decides nothing)."""
    return row["observed"] != NOT_RUN


def why_not_run(row: dict[str, Any]) -> str:
    """Why a row's cell was not run, in NOT_RUN_WHY's words (read from the message `not_run` or `observe`
    made; a message of neither counts as over the budget)."""
    message = row.get("message") or ""
    if message.startswith(REFUSED):
        return NOT_RUN_WHY["refused"]
    return NOT_RUN_WHY["largest_buffer" if BUFFER_WORDS in message else "max_memory"]


def not_run_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many of `rows` were not run, by why (NOT_RUN_WHY's words, in its order; reasons no row has left
    out)."""
    said = [why_not_run(row) for row in rows if not is_measured(row)]
    return {words: said.count(words) for words in NOT_RUN_WHY.values() if words in said}


def finite_or_none(value: float) -> float | None:
    """A relative error as rows keep it: None where it is not a finite number (NaN values came back; JSON
    has no NaN, and a reader refuses one)."""
    return value if math.isfinite(value) else None


def is_error_value(value: Any) -> bool:
    """A relative error as a row may hold it: None, or a finite number >= 0 (never a bool or NaN)."""
    return value is None or (type(value) in (int, float) and math.isfinite(value) and value >= 0)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    """Standard normal draws of `shape`, made in fp32 a chunk of leading rows at a time, so that a
    half-precision tensor never has a full fp32 twin."""
    out = torch.empty(shape, dtype=dtype, device=device)
    step = max(1, CHUNK_ELEMENTS // max(out[0].numel(), 1))
    for start in range(0, shape[0], step):
        part = out[start:start + step]
        part.copy_(torch.randn(part.shape, generator=generator, device=device, dtype=torch.float32))
    return out


def cell_row(cell: SweepCell, seen: dict[str, Any], device: str, emulated: bool, index_bits: int,
             profile: Any) -> dict[str, Any]:
    """A cell's row: the cell and its own fields, where it ran, the prediction, what is expected (the
    prediction on MPS or under emulation, `cell.control` on any other device), the observation `seen`, and
    whether they agree (None for a cell not run)."""
    prediction = cell.predict(index_bits, profile).to_json()
    expected = dict(cell.control) if not emulated and device != "mps" else prediction
    head, tail = cell.row_fields(index_bits, emulated, profile)
    width = cell.to_json().get("index_bits", index_bits)  # a cell that runs at a width of its own says it
    row = {"cell": cell.to_json(), **head, "device": device, "index_bits": width, "torch": torch.__version__,
           "prediction": prediction, "expected": expected, **cell.row_defaults, **seen, **tail}
    row["agree"] = cell.judge(row) if is_measured(row) else None
    return row


def reaches_buffer(cell: SweepCell, buffer: int | None) -> bool:
    """Whether one of the cell's tensors holds `buffer` bytes or more (a Mac's largest buffer: MPS refuses
    it); never where `buffer` is None (no Mac)."""
    return buffer is not None and buffer_refuses(cell.largest_tensor_bytes(), buffer)


def not_run(cell: SweepCell, budget: int, buffer: int | None = None) -> dict[str, Any] | None:
    """The row of a cell that is not run, None if it fits: one that needs more than `budget` bytes in all, or
    one of whose tensors reaches `buffer` bytes (a Mac's largest buffer; None: no Mac)."""
    needed = cell.bytes_needed()
    if needed > budget:
        return _skipped(f"needs {needed / GIB:.3g} GiB, more than the {budget / GIB:.3g} GiB budget "
                        "(--max-memory): not run, unmeasured")
    if reaches_buffer(cell, buffer):
        largest = cell.largest_tensor_bytes()
        refused = invalid_buffer_message(largest)
        return _skipped(f"a tensor of {largest / GIB:.3g} GiB reaches {BUFFER_WORDS}, {buffer / GIB:.3g} GiB "
                        f"(MPS: '{refused}'): not run, unmeasured")
    return None


def _skipped(message: str) -> dict[str, Any]:
    return {"observed": NOT_RUN, "first_bad_batch": None, "max_rel_error": None, "message": message}


def observe(cell: SweepCell, device: str, emulated: bool, index_bits: int, profile: Any = None,
            budget: int | None = None, buffer: int | None = None) -> dict[str, Any]:
    """Runs one cell of either kind (`cell.run`) and returns what it saw; a cell over `budget` bytes (default:
    what the device offers) or one of whose tensors reaches `buffer` bytes is not run, and one whose
    allocation the device refuses (making its operands or the op's output: `is_allocation_failure`) did not
    run: both are NOT_RUN, never the op's fault."""
    skipped = not_run(cell, device_memory(device) if budget is None else budget, buffer)
    if skipped is not None:
        return skipped
    try:
        return cell.run(device, emulated, index_bits, profile)
    except RuntimeError as error:
        if not is_allocation_failure(error):
            raise
        text = str(error).strip().splitlines()
        return {"observed": NOT_RUN, **cell.no_values,
                "message": f"{REFUSED}: {text[0] if text else type(error).__name__}; not run, unmeasured"}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()  # cells differ in size: give cached blocks back
        elif device == "mps":
            torch.mps.empty_cache()


def run_cells(cells: list[SweepCell], device: str, emulated: bool, index_bits: int, in_process: bool,
              profile: Any = None, budget: int | None = None,
              buffer: int | None = None) -> Iterator[dict[str, Any]]:
    """Yields one result row per cell (of one kind), in order; real devices go through a crash-tolerant
    worker, a run of the cells within the budget at a time. `profile`: the release (a FaultProfile, or what
    the rules take: a release, a profile.json, None for the installed) whose rules predict (and, emulated,
    produce) each cell; a cell over `budget` bytes (default: what the device offers) or reaching `buffer`
    (a Mac's largest buffer; None: no Mac) is not run."""
    budget = device_memory(device) if budget is None else budget

    def make_row(cell: SweepCell, seen: dict[str, Any]) -> dict[str, Any]:
        return cell_row(cell, seen, device, emulated, index_bits, profile)

    if in_process or emulated:
        for cell in cells:
            yield make_row(cell, observe(cell, device, emulated, index_bits, profile, budget, buffer))
        return
    job, start = {"device": device, "index_bits": index_bits, "budget": budget, "buffer": buffer}, 0
    while start < len(cells):
        fitting = list(itertools.takewhile(lambda c: not_run(c, budget, buffer) is None, cells[start:]))
        yield from worker_rows(fitting, job, make_row)
        start += len(fitting)
        if start < len(cells):
            yield make_row(cells[start], not_run(cells[start], budget, buffer))
            start += 1


def predicted_rows(cells: list[SweepCell], index_bits: int, profile: Any = None) -> list[dict[str, Any]]:
    """The rows an emulated sweep of `cells` writes when every cell comes out as `profile`'s rules say,
    without running a tensor (for sizing a sweep, and for deriving profiles in tests)."""
    return [cell_row(cell, cell.predicted_seen(index_bits, profile), "cpu", True, index_bits, profile)
            for cell in cells]


def worker_rows(cells: list[SweepCell], job: dict[str, Any],
                make_row: Callable[[Any, dict[str, Any]], dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Runs cells in a subprocess (`python -m` their class's module, reading `job` and the cells' JSON on stdin and
    printing one observation per line); a cell whose process dies is recorded as a crash, with the last
    line the process printed (an abort's assertion text), and the next cells go to a new process."""
    start = 0
    while start < len(cells):
        payload = json.dumps(job | {"cells": [c.to_json() for c in cells[start:]]})
        with tempfile.TemporaryFile("w+") as errors:
            proc = subprocess.Popen([sys.executable, "-m", type(cells[0]).__module__], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=errors, text=True, env=os.environ.copy(),
                                    preexec_fn=end_with_parent)  # a SIGKILL-ed sweep leaves no cell running
            proc.stdin.write(payload)
            proc.stdin.close()
            done = 0
            for line in proc.stdout:
                yield make_row(cells[start + done], json.loads(line))
                done += 1
            code = proc.wait()
            errors.seek(0)
            said = [line.strip() for line in errors.read().splitlines() if line.strip()]
        start += done
        if code != 0 and start < len(cells):
            text = f"exit code {code}" + (f": {said[-1][:300]}" if said else "")
            crash = {"observed": "crash", "message": text, "first_bad_batch": None, "max_rel_error": None}
            yield make_row(cells[start], crash)
            start += 1


def worker_main(kind: type) -> None:
    """A worker process (see `worker_rows`): observes each cell of `kind` its job on stdin names, unemulated,
    and prints one JSON observation per line."""
    job = json.loads(sys.stdin.read())
    for spec in job["cells"]:
        seen = observe(kind(**spec), job["device"], False, job["index_bits"], budget=job.get("budget"),
                       buffer=job.get("buffer"))
        print(json.dumps(seen), flush=True)


class CellClock:
    """The time a sweep has left: each cell's estimate (its estimated_seconds, the work its size makes) plus the
    time every cell costs whatever its size (starting it, its reference, its verdict: what the first measured cell
    took beyond its own estimate), scaled by how long the finished cells took against their estimates. Before the
    first cell has run it knows only the sizes: no estimate is said then (a guess of seconds was minutes)."""

    def __init__(self, cells: list[SweepCell], device: str) -> None:
        self.estimates = [cell.estimated_seconds(device) for cell in cells]
        self.spent, self.estimated_done, self.done, self.overhead = 0.0, 0.0, 0, None

    def finished(self, seconds: float) -> None:
        if self.overhead is None and seconds > 0:  # the first measured cell: what any cell costs beyond its size
            self.overhead = max(0.0, seconds - self.estimates[self.done])
        self.spent += seconds
        self.estimated_done += self.estimates[self.done] + (self.overhead or 0.0)
        self.done += 1

    def seconds_left(self) -> float:
        scale = self.spent / self.estimated_done if self.estimated_done > 0 and self.spent > 0 else 1.0
        remaining = self.estimates[self.done:]
        return scale * (sum(remaining) + (self.overhead or 0.0) * len(remaining))
