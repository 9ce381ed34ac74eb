"""The op-level sweep: a grid of bmm cells placed around every threshold, each judged per batch
against float64 and checked against the fault model. On real devices cells run in a worker
subprocess, so an abort is recorded as a crash rather than ending the sweep."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import torch

from mpsimpact.engine.faults import SILENT_KINDS, TensorSpec, classify_bmm

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LAYOUTS = ("contiguous", "a_transposed", "b_transposed", "both_sliced")
# (M, K, N): crossing through the output, through input a, through input b / views, all three.
FAMILIES = ((256, 64, 256), (256, 256, 64), (128, 64, 512), (256, 256, 256))
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 1e-1}
SAMPLE = 24  # batches judged per cell beyond the boundaries, when not all are affordable
NO_VALUES = {"first_bad_batch": None, "max_rel_error": None}  # a cell that was not judged


@dataclasses.dataclass(frozen=True)
class Cell:
    """One bmm: shapes, layout, dtype and batch size."""

    m: int
    k: int
    n: int
    batch: int
    layout: str
    dtype: str

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
        a, b = self.specs()
        out = self.batch * self.m * self.n
        size = DTYPES[self.dtype].itemsize  # inputs are drawn in fp32, then cast
        return (a.numel + b.numel + a.per_batch + b.per_batch) * (4 + size) + out * size

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
    for m, k, n in FAMILIES:
        batches = sorted(thresholds(m, k, n, index_bits))
        for dtype in dtypes:
            if quick and dtype != "fp32" and (m, k, n) != (256, 64, 256):
                continue
            cells += [Cell(m, k, n, batch, layout, dtype) for layout in layouts for batch in batches]
    return cells


def make_operands(cell: Cell, device: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands in the cell's layout, different in every batch (identical batches hide a wrap)."""
    dtype = DTYPES[cell.dtype]
    extra = 1 if cell.layout == "both_sliced" else 0

    def rand(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

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


def observe(cell: Cell, device: str, emulated: bool, index_bits: int,
            profile: str | None = None) -> dict[str, Any]:
    """Runs one cell and classifies what came back: ok, error, abort (emulated), wrong_all, wrong_tail,
    truncated (bad values mostly zero), or wrong_other (wrong otherwise, or not emulated)."""
    from mpsimpact.runs.device import device_memory

    if cell.bytes_needed() > device_memory(device):
        return {"observed": "skipped_memory", **NO_VALUES, "message": None}
    try:
        return _observe(cell, device, emulated, index_bits, profile)
    except torch.OutOfMemoryError as error:
        return {"observed": "skipped_memory", **NO_VALUES, "message": str(error).splitlines()[0]}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()  # cells differ in size: give cached blocks back
        elif device == "mps":
            torch.mps.empty_cache()


def _observe(cell: Cell, device: str, emulated: bool, index_bits: int, profile: str | None) -> dict[str, Any]:
    from mpsimpact.modes.emulator import emulate
    from mpsimpact.errors import EmulatedMpsError, NotEmulatedError

    predicted = classify_bmm(*cell.specs(), index_bits=index_bits, profile=profile)
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
        return {"observed": kind, "message": str(error).splitlines()[0], **NO_VALUES}
    affordable = cell.batch * cell.m * cell.n <= 1 << 26
    batches = judged_batches(cell, predicted.first_bad_batch, affordable, index_bits)
    index = torch.tensor(batches)
    ref = torch.bmm(a[index].double().cpu(), b[index].double().cpu())  # (S, M, N) in float64
    err = (out[index].double().cpu() - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))
    bad = [batch for batch, e in zip(batches, err.tolist()) if not e <= TOLERANCE[cell.dtype]]
    observed = _classify_bad(bad, batches)
    if bad and _zero_share(out, bad, ref, batches) >= 0.9:
        observed = "truncated"  # the study's criterion: at least 90% of the bad elements exactly 0
    return {"observed": observed, "first_bad_batch": bad[0] if bad else None,
            "max_rel_error": float(err.max()), "judged_batches": len(batches), "message": None}


def _zero_share(out: torch.Tensor, bad: list[int], ref: torch.Tensor, judged: list[int]) -> float:
    """Of the wrong elements of the bad batches, the share that is exactly zero."""
    got, want = out[torch.tensor(bad)].double().cpu(), ref[torch.tensor([judged.index(b) for b in bad])]
    wrong = (got - want).abs() > TOLERANCE["fp32"] * want.abs().amax()
    return float((got[wrong] == 0).double().mean()) if wrong.any() else 0.0


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
        return pred["message"].split(" (")[0][:40] in (row["message"] or "")
    return True


def run_cells(cells: list[Cell], device: str, emulated: bool, index_bits: int, in_process: bool,
              profile: str | None = None) -> Iterator[dict[str, Any]]:
    """Yields one result row per cell; real devices go through a crash-tolerant worker. `profile`:
    the torch release whose rules predict (and, emulated, produce) each cell."""
    control = not emulated and device != "mps"
    if in_process or emulated:
        for cell in cells:
            seen = observe(cell, device, emulated, index_bits, profile)
            yield _row(cell, seen, device, index_bits, control, profile)
        return
    yield from _worker_rows(cells, device, index_bits, control, profile)


def _row(cell: Cell, seen: dict[str, Any], device: str, index_bits: int, control: bool,
         profile: str | None = None) -> dict[str, Any]:
    a, b = cell.specs()
    prediction = classify_bmm(a, b, index_bits=index_bits, profile=profile).to_json()
    row = {"cell": cell.to_json(), "a": a.to_json(), "b": b.to_json(), "device": device,
           "index_bits": index_bits, "torch": torch.__version__, "prediction": prediction,
           "expected": {"kind": "ok", "first_bad_batch": None} if control else prediction, **seen}
    row["agree"] = None if seen["observed"] == "skipped_memory" else agrees(row)
    return row


def _worker_rows(cells: list[Cell], device: str, index_bits: int, control: bool,
                 profile: str | None) -> Iterator[dict[str, Any]]:
    """Runs cells in a subprocess; a cell whose process dies is recorded as a crash."""
    start = 0
    while start < len(cells):
        payload = json.dumps({"cells": [c.to_json() for c in cells[start:]], "device": device,
                              "index_bits": index_bits})
        proc = subprocess.Popen([sys.executable, "-m", "mpsimpact.runs.sweep"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        proc.stdin.write(payload)
        proc.stdin.close()
        done = 0
        for line in proc.stdout:
            yield _row(cells[start + done], json.loads(line), device, index_bits, control, profile)
            done += 1
        code = proc.wait()
        start += done
        if code != 0 and start < len(cells):
            crash = {"observed": "crash", "message": f"exit code {code}", **NO_VALUES}
            yield _row(cells[start], crash, device, index_bits, control, profile)
            start += 1


def _worker_main() -> None:
    job = json.loads(sys.stdin.read())
    for spec in job["cells"]:
        print(json.dumps(observe(Cell(**spec), job["device"], False, job["index_bits"])), flush=True)


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
    _worker_main()
