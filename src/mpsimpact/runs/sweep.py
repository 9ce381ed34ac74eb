"""The sweep's bmm cells: a grid placed around every threshold, each judged per batch against float64 and
checked against the fault model (a runs.cell.SweepCell; its worker process is this module)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ClassVar

import torch

from mpsimpact.config import SWEEP_LAYOUTS
from mpsimpact.engine.faults import SILENT_KINDS, STOP_KINDS, Fault, TensorSpec, classify_bmm
from mpsimpact.engine.call import CallRecord
from mpsimpact.engine.mac_memory import call_bytes
from mpsimpact.output.page import cell_name
from mpsimpact.runs.cell import (
    CHUNK_ELEMENTS, NOT_RUN, SPEEDS, finite_or_none, is_allocation_failure, is_error_value, random_tensor,
    worker_main,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = SWEEP_LAYOUTS  # config.SWEEP_DTYPES names DTYPES' keys
# (M, K, N): crossing through the output, through input a, through input b / views, all three.
SHAPE_FAMILIES = ((256, 64, 256), (256, 256, 64), (128, 64, 512), (256, 256, 256))
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 1e-1}
SAMPLE = 24  # batches judged per cell beyond the boundaries, when not all are affordable
NO_VALUES = {"first_bad_batch": None, "max_rel_error": None}  # a cell that was not judged
# What a bmm cell can be observed as, and the fields of a row that say what was observed (the rest of a row,
# `agree` included, is made from its cell: see runs.row_check).
OBSERVED = frozenset({"ok", "crash", NOT_RUN}) | SILENT_KINDS | STOP_KINDS
SEEN_FIELDS = ("observed", "first_bad_batch", "max_rel_error", "message", "judged_batches", "emulated_values")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One bmm: shapes, layout, dtype and batch size (a runs.cell.SweepCell)."""

    m: int
    k: int
    n: int
    batch: int
    layout: str
    dtype: str
    no_values: ClassVar[dict[str, Any]] = NO_VALUES
    seen_fields: ClassVar[tuple[str, ...]] = SEEN_FIELDS
    control: ClassVar[dict[str, Any]] = {"kind": "ok", "first_bad_batch": None}
    row_defaults: ClassVar[dict[str, Any]] = {}

    @property
    def name(self) -> str:
        """'256x64x256 batch 17 contiguous fp32': the cell as people say it."""
        return cell_name(self.to_json())

    def predict(self, index_bits: int, profile: Any = None) -> Fault:
        return classify_bmm(*self.specs(), index_bits=index_bits, profile=profile)

    def run(self, device: str, emulated: bool, index_bits: int, profile: Any) -> dict[str, Any]:
        """Runs the bmm and judges it (see runs.cell.observe): ok, error, abort (emulated), wrong_all,
        wrong_tail, truncated (bad values mostly zero) or wrong_other (wrong otherwise, or not emulated). An
        allocation the device refuses (operands or output) is raised for `observe`, never an "error"."""
        from mpsimpact.modes.emulator import emulate
        from mpsimpact.errors import EmulatedMpsError, NotEmulatedError

        predicted = self.predict(index_bits, profile)
        a, b = make_operands(self, device, torch.Generator(device=device).manual_seed(0))
        try:
            with emulate(index_bits=index_bits, profile=profile) if emulated else contextlib.nullcontext():
                out = torch.bmm(a, b)
            if device == "mps":
                torch.mps.synchronize()
        except NotEmulatedError as error:
            return {"observed": "wrong_other", "message": error.message, **NO_VALUES, "emulated_values": False}
        except RuntimeError as error:
            if is_allocation_failure(error):
                raise  # the output did not fit: not the op's fault (runs.cell.observe says not run)
            kind = error.fields["fault"].kind if isinstance(error, EmulatedMpsError) else "error"
            return {"observed": kind, "message": str(error).splitlines()[0], **NO_VALUES}
        batches = judged_batches(self, predicted.first_bad_batch, self.batch * self.m * self.n <= 1 << 26, index_bits)
        index = torch.tensor(batches, device=out.device)
        # To the CPU before float64: MPS has no float64.
        ref = torch.bmm(a[index].cpu().double(), b[index].cpu().double())  # (S, M, N) in float64
        got = out[index].cpu().double()
        gap = (got - ref).abs_()
        scale = ref.abs().amax(dim=(1, 2))
        err = gap.amax(dim=(1, 2)) / scale
        wrong_rows = [row for row, e in enumerate(err.tolist()) if not e <= TOLERANCE[self.dtype]]
        bad = [batches[row] for row in wrong_rows]
        observed = _classify_bad(bad, batches)
        if bad and _zero_share(got, gap, scale, wrong_rows) >= 0.9:
            observed = "truncated"  # the study's criterion: at least 90% of the bad elements exactly 0
        return {"observed": observed, "first_bad_batch": bad[0] if bad else None,
                "max_rel_error": finite_or_none(float(err.max())), "judged_batches": len(batches), "message": None}

    @staticmethod
    def judge(row: dict[str, Any]) -> bool:
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

    def predicted_seen(self, index_bits: int, profile: Any) -> dict[str, Any]:
        fault = self.predict(index_bits, profile)
        return {"observed": fault.kind, "first_bad_batch": fault.first_bad_batch, "message": fault.message or None,
                "max_rel_error": None}

    def row_fields(self, index_bits: int, emulated: bool, profile: Any) -> tuple[dict, dict]:
        """(the operands' specs, nothing after the observation)."""
        a, b = self.specs()
        return {"a": a.to_json(), "b": b.to_json()}, {}

    def observation_problem(self, seen: dict[str, Any]) -> str | None:
        """What makes a read-back observation of this cell impossible, in words, or None: a class no cell has, a
        value of the wrong type or out of range (NaN), or fields that contradict each other (an "ok" with a first
        bad batch or an error above the tolerance; a wrong class with neither)."""
        observed, first, rel = seen.get("observed"), seen.get("first_bad_batch"), seen.get("max_rel_error")
        if observed not in OBSERVED:
            return f"observed {str(observed)[:30]!r} is not an outcome of a bmm cell"
        if first is not None and not (type(first) is int and 0 <= first < self.batch):
            return f"first_bad_batch {str(first)[:30]} is not a batch of this cell (0..{self.batch - 1})"
        if not is_error_value(rel):
            return f"max_rel_error {str(rel)[:30]} is not a finite number >= 0"
        if not isinstance(seen.get("message"), (str, type(None))):
            return "its message is not text"
        judged = seen.get("judged_batches")
        if judged is not None and not (type(judged) is int and 0 < judged <= self.batch):
            return f"judged_batches {str(judged)[:30]} is not a count of this cell's batches"
        tolerance, stopped = TOLERANCE[self.dtype], observed in STOP_KINDS | {"crash", NOT_RUN}
        if observed == "ok" and (first is not None or (rel is not None and rel > tolerance)):
            found = f"a first bad batch {first}" if first is not None else f"an error {rel}"
            return f"it says ok, with {found} (the tolerance is {tolerance})"
        if stopped and (first is not None or rel is not None or not seen.get("message")):
            return f"it says {observed}, but holds values judged, or no message"
        if observed == "wrong_tail" and not first:
            return "it says wrong_tail, without a first bad batch after batch 0"
        if observed == "wrong_all" and first not in (None, 0):
            return f"it says wrong_all, with a first bad batch {first}"
        if observed in SILENT_KINDS and rel is not None and rel <= tolerance:
            return f"it says {observed}, with an error {rel} within the tolerance {tolerance}"
        return None

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

    def largest_tensor_bytes(self) -> int:
        """Bytes of the largest tensor the cell allocates on the device: an operand's storage (a sliced one
        has a batch more) or the output (what a Mac's largest buffer must hold; see `make_operands`)."""
        a, b = self.specs()
        return call_bytes(CallRecord(0, "bmm", a, b, Fault()))

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
