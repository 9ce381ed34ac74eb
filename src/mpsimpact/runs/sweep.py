"""The op-level sweep: a grid of bmm cells placed around every threshold, each judged per batch
against float64 and checked against the fault model. On real devices cells run in a worker
subprocess, so an abort is recorded as a crash rather than ending the sweep."""

from __future__ import annotations

import contextlib
import dataclasses
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

from mpsimpact.config import SWEEP_LAYOUTS
from mpsimpact.output.signals import end_with_parent
from mpsimpact.engine.faults import SILENT_KINDS, Fault, TensorSpec, classify_bmm

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = SWEEP_LAYOUTS  # config.SWEEP_DTYPES names DTYPES' keys
# (M, K, N): crossing through the output, through input a, through input b / views, all three.
SHAPE_FAMILIES = ((256, 64, 256), (256, 256, 64), (128, 64, 512), (256, 256, 256))
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 1e-1}
SAMPLE = 24  # batches judged per cell beyond the boundaries, when not all are affordable
CHUNK_ELEMENTS = 1 << 24  # operands are drawn this many fp32 elements at a time, then cast in place
# A row of a cell that was not run (over the memory budget): it decides nothing and agrees with nothing.
NOT_RUN = "skipped_memory"
NO_VALUES = {"first_bad_batch": None, "max_rel_error": None}  # a cell that was not judged
# Rough speeds before any cell has run, per device: (multiply-adds per second, elements drawn per second).
# A sweep rescales its estimate by the cells it has finished (CellClock).
SPEEDS = {"cpu": (2e10, 2e8), "cuda": (2e13, 2e10), "mps": (3e12, 3e9)}


class SweepCell(Protocol):
    """What the sweep asks of a cell, a bmm (`Cell`) or an op family's test (family_cells.FamilyCell), so that
    the one pipeline below (observe, run_cells, predicted_rows, worker processes) runs either: the fault
    model's verdict (`predict`), the cell run and judged (`look`: the observation), the observation of a cell
    that comes out as the rules say (`predicted_seen`), its row (the cell, prediction, expectation, the
    observation, agreement), its size and time, and its JSON (the row's "cell")."""

    no_values: ClassVar[dict[str, Any]]  # the fields of an observation that judged no values
    worker: ClassVar[str]  # the module whose worker process (`python -m`) runs such cells

    def predict(self, index_bits: int, profile: Any = None) -> Fault: ...
    def look(self, device: str, emulated: bool, index_bits: int, profile: Any) -> dict[str, Any]: ...
    def predicted_seen(self, index_bits: int, profile: Any) -> dict[str, Any]: ...
    def row(self, seen: dict[str, Any], device: str, emulated: bool, index_bits: int, profile: Any) -> dict: ...
    def bytes_needed(self) -> int: ...
    def estimated_seconds(self, device: str) -> float: ...
    def to_json(self) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class Cell:
    """One bmm: shapes, layout, dtype and batch size (a SweepCell)."""

    m: int
    k: int
    n: int
    batch: int
    layout: str
    dtype: str
    no_values: ClassVar[dict[str, Any]] = NO_VALUES
    worker: ClassVar[str] = "mpsimpact.runs.sweep"

    def predict(self, index_bits: int, profile: Any = None) -> Fault:
        return classify_bmm(*self.specs(), index_bits=index_bits, profile=profile)

    def look(self, device: str, emulated: bool, index_bits: int, profile: Any) -> dict[str, Any]:
        return _observe(self, device, emulated, index_bits, profile)

    def predicted_seen(self, index_bits: int, profile: Any) -> dict[str, Any]:
        fault = self.predict(index_bits, profile)
        return {"observed": fault.kind, "first_bad_batch": fault.first_bad_batch, "message": fault.message or None,
                "max_rel_error": None}

    def row(self, seen: dict[str, Any], device: str, emulated: bool, index_bits: int, profile: Any) -> dict[str, Any]:
        a, b = self.specs()
        prediction = classify_bmm(a, b, index_bits=index_bits, profile=profile).to_json()
        control = not emulated and device != "mps"
        expected = {"kind": "ok", "first_bad_batch": None} if control else prediction
        row = {"cell": self.to_json(), "a": a.to_json(), "b": b.to_json(), "device": device,
               "index_bits": index_bits, "torch": torch.__version__, "prediction": prediction, "expected": expected,
               **seen}
        row["agree"] = agrees(row) if is_measured(row) else None
        return row

    def specs(self) -> tuple[TensorSpec, TensorSpec]:
        """The operand specs this cell builds (see `make_operands`)."""
        a, b = (self.batch, self.m, self.k), (self.batch, self.k, self.n)
        dt = str(DTYPES[self.dtype]).removeprefix("torch.")
        sa, sb = TensorSpec.contiguous(a, dt), TensorSpec.contiguous(b, dt)
        if self.layout == "contiguous":
            return sa, sb
        if self.layout == "a_transposed":
            return TensorSpec.contiguous((self.batch, self.k, self.m), dt).transpose(), sb
        if self.layout == "b_transposed":
            return sa, TensorSpec.contiguous((self.batch, self.n, self.k), dt).transpose()
        return (dataclasses.replace(sa, storage_offset=self.m * self.k),
                dataclasses.replace(sb, storage_offset=self.k * self.n))

    def bytes_needed(self) -> int:
        """Bytes the cell holds at once: both operands' storage (a sliced one has a batch more), the
        output, and one chunk of fp32 draws (see `make_operands`)."""
        a, b = self.specs()
        size = DTYPES[self.dtype].itemsize
        draws = min(CHUNK_ELEMENTS, max(a.extent, b.extent))
        return (a.extent + b.extent + self.batch * self.m * self.n) * size + draws * 4

    def estimated_seconds(self, device: str) -> float:
        """A rough time before anything ran: drawing the operands and the product (SPEEDS)."""
        a, b = self.specs()
        products, draws = SPEEDS.get(device, SPEEDS["cpu"])
        return (self.batch * self.m * self.k * self.n) / products + (a.extent + b.extent) / draws

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def thresholds(m: int, k: int, n: int, index_bits: int) -> set[int]:
    """Batch sizes N-1, N, N+1 around every whole threshold of this family, and a second wrap."""
    limit, view = 1 << index_bits, 1 << (index_bits - 1)
    sizes = set()
    for per in (m * k, k * n, m * n):
        for bound in (view, limit, 2 * limit):
            if bound % per == 0:
                edge = bound // per
                sizes.update({edge - 1, edge, edge + 1})
    return {s for s in sizes if s >= 1}


def grid(index_bits: int, dtypes: tuple[str, ...], layouts: tuple[str, ...], quick: bool) -> list[Cell]:
    """Every cell of the sweep; `quick` keeps fp32 for all families and the other dtypes for one."""
    cells = []
    for m, k, n in SHAPE_FAMILIES:
        batches = sorted(thresholds(m, k, n, index_bits))
        for dtype in dtypes:
            if quick and dtype != "fp32" and (m, k, n) != (256, 64, 256):
                continue
            cells += [Cell(m, k, n, batch, layout, dtype) for layout in layouts for batch in batches]
    return cells


def is_measured(row: dict[str, Any]) -> bool:
    """Whether a row's cell ran (a cell over the memory budget did not, and decides nothing)."""
    return row["observed"] != NOT_RUN


def make_operands(cell: Cell, device: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands in the cell's layout, different in every batch (identical batches hide a wrap)."""
    extra = 1 if cell.layout == "both_sliced" else 0

    def rand(*shape):
        return random_tensor(shape, DTYPES[cell.dtype], device, generator)

    if cell.layout == "a_transposed":
        return rand(cell.batch, cell.k, cell.m).transpose(1, 2), rand(cell.batch, cell.k, cell.n)
    if cell.layout == "b_transposed":
        return rand(cell.batch, cell.m, cell.k), rand(cell.batch, cell.n, cell.k).transpose(1, 2)
    return rand(cell.batch + extra, cell.m, cell.k)[extra:], rand(cell.batch + extra, cell.k, cell.n)[extra:]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    """Standard normal draws of `shape`, made in fp32 a chunk of leading rows at a time, so that a
    half-precision tensor never has a full fp32 twin."""
    out = torch.empty(shape, dtype=dtype, device=device)
    step = max(1, CHUNK_ELEMENTS // max(out[0].numel(), 1))
    for start in range(0, shape[0], step):
        part = out[start:start + step]
        part.copy_(torch.randn(part.shape, generator=generator, device=device, dtype=torch.float32))
    return out


def judged_batches(cell: Cell, predicted_first: int | None, affordable: bool, index_bits: int) -> list[int]:
    """All batches, or the first/last, both sides of each boundary, and a seeded sample."""
    if affordable:
        return list(range(cell.batch))
    picks = {0, 1, cell.batch - 1, cell.batch - 2}
    for edge in (predicted_first, *thresholds(cell.m, cell.k, cell.n, index_bits)):
        if edge is not None:
            picks.update(range(max(0, edge - 2), min(cell.batch, edge + 3)))
    rng = torch.Generator().manual_seed(cell.batch)
    picks.update(torch.randint(0, cell.batch, (SAMPLE,), generator=rng).tolist())
    return sorted(p for p in picks if 0 <= p < cell.batch)


def not_run(cell: Any, budget: int) -> dict[str, Any] | None:
    """The row of a cell over the memory budget (bytes), which is not run; None if it fits."""
    needed = cell.bytes_needed()
    if needed <= budget:
        return None
    message = (f"needs {needed / 2**30:.3g} GiB, more than the {budget / 2**30:.3g} GiB budget "
               "(--max-memory): not run, unmeasured")
    return {"observed": NOT_RUN, "first_bad_batch": None, "max_rel_error": None, "message": message}


def observe(cell: SweepCell, device: str, emulated: bool, index_bits: int, profile: Any = None,
            budget: int | None = None) -> dict[str, Any]:
    """Runs one cell of either kind (`cell.look`) and returns what it saw: for a bmm ok, error, abort (emulated),
    wrong_all, wrong_tail, truncated (bad values mostly zero) or wrong_other (wrong otherwise, or not emulated);
    a cell over `budget` bytes (default: what the device offers), or out of memory, is not run."""
    from mpsimpact.runs.device import device_memory

    skipped = not_run(cell, device_memory(device) if budget is None else budget)
    if skipped is not None:
        return skipped
    try:
        return cell.look(device, emulated, index_bits, profile)
    except torch.OutOfMemoryError as error:
        return {"observed": NOT_RUN, **cell.no_values,
                "message": f"out of memory: {str(error).splitlines()[0]}; not run, unmeasured"}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()  # cells differ in size: give cached blocks back
        elif device == "mps":
            torch.mps.empty_cache()


def _observe(cell: Cell, device: str, emulated: bool, index_bits: int, profile: str | None) -> dict[str, Any]:
    from mpsimpact.modes.emulator import emulate
    from mpsimpact.errors import EmulatedMpsError, NotEmulatedError

    predicted = cell.predict(index_bits, profile)
    a, b = make_operands(cell, device, torch.Generator(device=device).manual_seed(0))
    try:
        with emulate(index_bits=index_bits, profile=profile) if emulated else contextlib.nullcontext():
            out = torch.bmm(a, b)
        if device == "mps":
            torch.mps.synchronize()
    except torch.OutOfMemoryError:
        raise
    except NotEmulatedError as error:
        return {"observed": "wrong_other", "message": error.message, **NO_VALUES, "emulated_values": False}
    except RuntimeError as error:
        kind = error.fields["fault"].kind if isinstance(error, EmulatedMpsError) else "error"
        return {"observed": kind, "message": str(error).splitlines()[0], "first_bad_batch": None, "max_rel_error": None}
    batches = judged_batches(cell, predicted.first_bad_batch, cell.batch * cell.m * cell.n <= 1 << 26, index_bits)
    index = torch.tensor(batches, device=out.device)
    # To the CPU before float64: MPS has no float64.
    ref = torch.bmm(a[index].cpu().double(), b[index].cpu().double())  # (S, M, N) in float64
    got = out[index].cpu().double()
    gap = (got - ref).abs_()
    scale = ref.abs().amax(dim=(1, 2))
    err = gap.amax(dim=(1, 2)) / scale
    wrong_rows = [row for row, e in enumerate(err.tolist()) if not e <= TOLERANCE[cell.dtype]]
    bad = [batches[row] for row in wrong_rows]
    observed = _classify_bad(bad, batches)
    if bad and _zero_share(got, gap, scale, wrong_rows) >= 0.9:
        observed = "truncated"  # the study's criterion: at least 90% of the bad elements exactly 0
    return {"observed": observed, "first_bad_batch": bad[0] if bad else None,
            "max_rel_error": finite_or_none(float(err.max())), "judged_batches": len(batches), "message": None}


def finite_or_none(value: float) -> float | None:
    """A relative error as rows keep it: None where it is not a finite number (NaN values came back; JSON
    has no NaN, and a reader refuses one)."""
    return value if math.isfinite(value) else None


def is_error_value(value: Any) -> bool:
    """A relative error as a row may hold it: None, or a finite number >= 0 (never a bool or NaN)."""
    return value is None or (type(value) in (int, float) and math.isfinite(value) and value >= 0)


def _zero_share(got: torch.Tensor, gap: torch.Tensor, scale: torch.Tensor, rows: list[int]) -> float:
    """Of the wrong elements of the bad batches (`rows` of the judged ones: `got`, |got - reference| as
    `gap`, max |reference| per batch as `scale`), the share that is exactly zero."""
    if len(rows) < len(got):  # else every judged batch is bad: the tensors as they are, no copies
        index = torch.tensor(rows)
        got, gap, scale = got[index], gap[index], scale[index]
    wrong = gap > TOLERANCE["fp32"] * float(scale.amax())
    count = int(wrong.sum())  # counts, not got[wrong]: a boolean gather copies most of the batch
    return int((got == 0).logical_and_(wrong).sum()) / count if count else 0.0


def _classify_bad(bad: list[int], judged: list[int]) -> str:
    if not bad:
        return "ok"
    if len(bad) == len(judged):
        return "wrong_all"
    if bad == [b for b in judged if b >= bad[0]]:
        return "wrong_tail"
    return "wrong_other"


def agrees(row: dict[str, Any]) -> bool:
    """Whether an observed cell matches what is expected of it: the fault model's prediction on
    MPS or under emulation; "ok" on any other device (the control)."""
    pred, seen = row["expected"], row["observed"]
    if pred["kind"] == "abort" and seen == "crash":
        return True  # a real abort ends the worker process
    if pred["kind"] == "wrong_other" and row.get("device") == "mps":
        return seen in SILENT_KINDS  # pattern not characterised
    if seen != pred["kind"]:
        return False
    if seen == "wrong_tail":
        return row["first_bad_batch"] == pred["first_bad_batch"]
    if seen == "error":
        return pred["message"].split(" (")[0][:40] in (row.get("message") or "")
    return True


def run_cells(cells: list[SweepCell], device: str, emulated: bool, index_bits: int, in_process: bool,
              profile: str | None = None, budget: int | None = None) -> Iterator[dict[str, Any]]:
    """Yields one result row per cell (of one kind), in order; real devices go through a crash-tolerant
    worker. `profile`: the profile (a FaultProfile.ref) whose rules predict (and, emulated, produce) each cell;
    `budget`: the bytes a cell may hold (default: what the device offers); a cell over it is not run."""
    from mpsimpact.runs.device import device_memory

    budget = device_memory(device) if budget is None else budget

    def make_row(cell: SweepCell, seen: dict[str, Any]) -> dict[str, Any]:
        return cell.row(seen, device, emulated, index_bits, profile)

    if in_process or emulated:
        for cell in cells:
            yield make_row(cell, observe(cell, device, emulated, index_bits, profile, budget))
        return
    job = {"device": device, "index_bits": index_bits, "budget": budget}
    yield from rows_within_budget(cells, budget, lambda fitting: worker_rows(fitting, job, make_row), make_row)


def rows_within_budget(cells: list[Any], budget: int, run_fitting: Callable[[list[Any]], Iterator[dict[str, Any]]],
                       make_row: Callable[[Any, dict[str, Any]], dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rows of `cells` in order: a cell over the budget is answered here (`not_run`), each run of the cells
    between by `run_fitting` (a worker process)."""
    start = 0
    while start < len(cells):
        fitting = list(itertools.takewhile(lambda c: not_run(c, budget) is None, cells[start:]))
        yield from run_fitting(fitting)
        start += len(fitting)
        if start < len(cells):
            yield make_row(cells[start], not_run(cells[start], budget))
            start += 1


def predicted_rows(cells: list[SweepCell], index_bits: int, profile: Any = None) -> list[dict[str, Any]]:
    """The rows an emulated sweep of `cells` writes when every cell comes out as `profile`'s rules say,
    without running a tensor (for sizing a sweep, and for deriving profiles in tests)."""
    return [cell.row(cell.predicted_seen(index_bits, profile), "cpu", True, index_bits, profile) for cell in cells]


def worker_rows(cells: list[SweepCell], job: dict[str, Any],
                make_row: Callable[[Any, dict[str, Any]], dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Runs cells in a subprocess (`python -m` their kind's `worker`, reading `job` and the cells' JSON on stdin and
    printing one observation per line); a cell whose process dies is recorded as a crash, with the last
    line the process printed (an abort's assertion text), and the next cells go to a new process."""
    start = 0
    while start < len(cells):
        payload = json.dumps(job | {"cells": [c.to_json() for c in cells[start:]]})
        with tempfile.TemporaryFile("w+") as errors:
            proc = subprocess.Popen([sys.executable, "-m", type(cells[0]).worker], stdin=subprocess.PIPE,
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
        seen = observe(kind(**spec), job["device"], False, job["index_bits"], budget=job.get("budget"))
        print(json.dumps(seen), flush=True)


class CellClock:
    """The time a sweep has left: each cell's estimate (Cell.estimated_seconds), scaled by how long the
    finished cells took against their own estimates."""

    def __init__(self, cells: list[Cell], device: str) -> None:
        self.estimates = [cell.estimated_seconds(device) for cell in cells]
        self.spent, self.estimated_done, self.done = 0.0, 0.0, 0

    @property
    def total_estimate(self) -> float:
        return sum(self.estimates)

    def finished(self, seconds: float) -> None:
        self.spent += seconds
        self.estimated_done += self.estimates[self.done]
        self.done += 1

    def seconds_left(self) -> float:
        scale = self.spent / self.estimated_done if self.estimated_done > 0 and self.spent > 0 else 1.0
        return scale * sum(self.estimates[self.done:])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Agree/disagree counts by observed class and by layout."""
    table: dict[str, dict[str, list[int]]] = {"by_class": {}, "by_layout": {}}
    for row in rows:
        for key, value in (("by_class", row["observed"]), ("by_layout", row["cell"]["layout"])):
            counts = table[key].setdefault(value, [0, 0, 0])
            counts[0 if row["agree"] else 1 if row["agree"] is False else 2] += 1
    disagree = sum(1 for r in rows if r["agree"] is False)
    return {"cells": len(rows), "disagree": disagree, **table, "columns": ["agree", "disagree", "skipped"]}


if __name__ == "__main__":
    worker_main(Cell)
