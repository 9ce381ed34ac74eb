"""What `sweep` concludes, as typed values: `SweepSummary` (summary.json) and `SweepRow` (a line of sweep.jsonl),
written by the sweep and read back by compare through the same classes (output.record.Record), which check each
field's type and that the files agree (every cell of the config's grid once, counted as the summary counts it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mpsimpact.engine.faults import INDEX_BITS_RANGE
from mpsimpact.output.record import ABSENT, Record, shown
from mpsimpact.runs.kind import SCHEMA_VERSION

_record = dataclasses.dataclass(frozen=True, eq=False)
CELL_KEYS = ("m", "k", "n", "batch", "layout", "dtype")


@_record
class SweepCell(Record):
    m: int
    k: int
    n: int
    batch: int
    layout: str
    dtype: str

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(self[k] for k in CELL_KEYS)

    def problem(self) -> str | None:
        if min(self.m, self.k, self.n, self.batch) < 1:
            return f"its sizes are {self.m}, {self.k}, {self.n} and batch {self.batch}, not whole numbers >= 1"
        return None


@_record
class SweepRow(Record):
    """One measured bmm cell (runs.sweep): its shapes, the prediction, what was observed, and whether they agree."""

    cell: SweepCell
    observed: str
    agree: bool | None
    device: str | None = ABSENT
    index_bits: int | None = ABSENT
    torch: str | None = ABSENT
    first_bad_batch: int | None = ABSENT
    max_rel_error: float | None = dataclasses.field(default=ABSENT, metadata={"finite": False})

    def problem(self) -> str | None:
        first = self.get("first_bad_batch")
        if first is not None and not 0 <= first < self.cell.batch:
            return f"first_bad_batch is {shown(first)}, not a batch of its cell (0..{self.cell.batch - 1})"
        return None


@_record
class SweepConfigBlock(Record):
    device: str | None = ABSENT
    quick: bool | None = ABSENT
    dtypes: list[str] = ABSENT
    layouts: list[str] = ABSENT
    index_bits: int = ABSENT


@_record
class ProfileRef(Record):
    release: str | None = ABSENT


@_record
class SweepSummary(Record):
    """A sweep folder's summary.json: the cells, their agreement by observed class and by layout, the config, the
    release it was predicted by, and the op families' cells."""

    cells: int
    by_class: dict[str, tuple[int, int, int]]
    schema_version: int = ABSENT
    disagree: int = ABSENT
    by_layout: dict[str, tuple[int, int, int]] = ABSENT
    mode: str | None = ABSENT
    profile: ProfileRef = ABSENT
    config: SweepConfigBlock = ABSENT
    columns: list[str] = ABSENT
    not_ok: int = ABSENT
    not_run: int = ABSENT
    not_run_why: dict[str, Any] = ABSENT
    max_memory_bytes: int = ABSENT
    families: dict[str, Any] = ABSENT
    derived_profile: dict[str, Any] | None = ABSENT
    largest_buffer: dict[str, Any] | None = ABSENT
    resumed_cells: int = ABSENT
    wall_s: float = ABSENT

    def problem(self) -> str | None:
        if self.schema_version is not ABSENT and not 1 <= self.schema_version <= SCHEMA_VERSION:
            return f"schema_version is {self.schema_version}, not one of 1..{SCHEMA_VERSION}"
        if self.cells < 1:
            return f"cells is {self.cells}, not a whole number >= 1"
        for name, table in (("by_class", self.by_class), ("by_layout", self.by_layout or {})):
            if any(n < 0 for counts in table.values() for n in counts):
                return f"{name} holds a count below 0"
            if sum(map(sum, table.values())) != self.cells:
                return f"{name} counts {sum(map(sum, table.values()))} cells, not its {self.cells}"
        bits = self.config.get("index_bits") if self.config else None
        low, high = INDEX_BITS_RANGE
        if bits is not None and not low <= bits <= high:
            return f"config.index_bits is {bits}, not one of {low}..{high}"
        return None

    def rows_problem(self, rows: list[SweepRow]) -> str | None:
        """What makes sweep.jsonl disagree with this summary, in words, or None: every cell of the grid its config
        makes once, of one device, torch and index width (the summary's), counted by class and verdict as here."""
        from mpsimpact.runs.sweep import summarize

        if len(rows) != self.cells:
            return f"it holds {len(rows)} cells, summary.json counts {self.cells}"
        cells = set()
        for number, row in enumerate(rows, 1):
            if row.cell.key in cells:
                return f"line {number} repeats the cell of an earlier line"
            cells.add(row.cell.key)
        bits = self.config.get("index_bits") if self.config else None
        for field, values in (("device", {r.get("device") for r in rows}), ("torch", {r.get("torch") for r in rows}),
                              ("index bits", {r.get("index_bits") for r in rows} | ({bits} if bits else set()))):
            if len(values - {None}) > 1:
                return (f"its rows (and summary.json) name {len(values - {None})} {field} values: "
                        f"{', '.join(sorted(map(str, values - {None})))}")
        counted = summarize([row.to_json() for row in rows])
        written = self.to_json()
        if any(counted[key] != written.get(key, counted[key]) for key in ("by_class", "by_layout", "disagree")):
            return "its cells' classes and verdicts are not the ones summary.json counts"
        expected = self.grid()
        if expected is not None and cells != expected:
            return (f"its cells are not the grid summary.json's config makes ({len(cells - expected)} cells not in "
                    f"it, {len(expected - cells)} missing)")
        return None

    def grid(self) -> set[tuple] | None:
        """The cells the config makes (runs.sweep.grid), or None where the config does not say."""
        from mpsimpact.runs.sweep import DTYPES, LAYOUTS, grid

        config = self.config or {}
        bits, dtypes, layouts, quick = (config.get(k) for k in ("index_bits", "dtypes", "layouts", "quick"))
        if bits is None or quick is None or dtypes is None or layouts is None or not (
                set(dtypes) <= set(DTYPES) and set(layouts) <= set(LAYOUTS)):
            return None
        return {(c.m, c.k, c.n, c.batch, c.layout, c.dtype) for c in grid(bits, tuple(dtypes), tuple(layouts), quick)}
