"""Rows of an unfinished sweep, read back before it resumes: each row's observation checked against its cell and
its row made again from them, so that a damaged row or another sweep's is dropped (its cell run again), and `agree`
is always judged now, never read back."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from mpsimpact.runs.cell import SweepCell, cell_row


def reread_problem(row: dict[str, Any], cell: SweepCell, device: str, emulated: bool, index_bits: int,
                   profile: Any) -> str | None:
    """Why a row read back from an unfinished sweep cannot be kept, or None: its observation holds a list or
    an object, or is impossible (`cell.observation_problem`), or the row this sweep makes of its cell and
    observation differs from it (another sweep's device, torch, width or prediction; a changed verdict:
    `agree` is judged again, never read)."""
    seen = {key: row[key] for key in cell.seen_fields if key in row}
    problem = _type_problem(seen) or cell.observation_problem(seen)
    if problem is None:  # the fields where the row differs from the one made now (JSON-normalised: tuples as lists)
        made = json.loads(json.dumps(cell_row(cell, seen, device, emulated, index_bits, profile)))
        differ = sorted(key for key in row.keys() | made.keys() if row.get(key, ...) != made.get(key, ...))
        problem = f"its {', '.join(differ)} differ from what this sweep makes of its cell" if differ else None
    return problem


def _type_problem(seen: dict[str, Any]) -> str | None:
    """An observation field that is not one JSON value (a list, an object: damage), in words, or None; the
    cell's own checks (`observation_problem`) compare and hash the fields, which a list or an object breaks."""
    for key, value in seen.items():
        if isinstance(value, (list, dict)):
            return f"its {key} is {'a list' if isinstance(value, list) else 'an object'}, not one value"
    return None


def cell_key(cell: Any) -> tuple | None:
    """A row's cell as a key: the bmm cell's fields, or a family cell's test; None for anything else."""
    if not isinstance(cell, dict):
        return None
    names = ("test",) if "test" in cell else ("m", "k", "n", "batch", "layout", "dtype")
    values = tuple(cell.get(name) for name in names)
    return values if all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in values) else None


def reread_rows(items: list[Any], cells: list[Any], problem_of: Callable[[dict[str, Any], Any], str | None]
                ) -> tuple[list[dict[str, Any]], list[str]]:
    """(the rows of `items` kept, in order; a line per row dropped): a row is kept when its cell is one of
    `cells` (the same fields, of the same types), `problem_of(row, cell)` finds nothing, and no other row
    holds the same cell (two rows of one cell are both dropped: which one is right cannot be told)."""
    by_key = {cell_key(cell.to_json()): cell for cell in cells}
    judged: list[tuple[int, dict[str, Any] | None, str | None]] = []
    for number, row in enumerate(items, 1):
        cell = by_key.get(cell_key(row.get("cell"))) if isinstance(row, dict) else None
        if cell is None or row["cell"] != cell.to_json() or json.dumps(row["cell"]) != json.dumps(cell.to_json()):
            judged.append((number, None, "its cell is not one of this sweep's"))
            continue
        judged.append((number, row, problem_of(row, cell)))
    seen = Counter(cell_key(row["cell"]) for _, row, problem in judged if row is not None and problem is None)
    kept, dropped = [], []
    for number, row, problem in judged:
        if problem is None and seen[cell_key(row["cell"])] > 1:
            problem = "another row holds the same cell"
        if problem is None:
            kept.append(row)
        else:
            dropped.append(f"line {number}: {problem}")
    return kept, dropped


def resumed_rows(logs: tuple[Any, Any], grids: tuple[list[Any], list[Any]], device: str, emulated: bool,
                 index_bits: int, profile: Any) -> list[dict[str, Any]]:
    """The rows an unfinished sweep's two logs (ResumableFolder: sweep.jsonl, families.jsonl) hold that this
    sweep keeps; the others are dropped from the logs (their cells run again), said in one warning line."""
    from mpsimpact.output.files import warn

    kept, said = [], []
    for log, cells in zip(logs, grids):
        rows, dropped = reread_rows(log.items, cells,
                                    lambda row, cell: reread_problem(row, cell, device, emulated, index_bits, profile))
        if dropped:
            log.keep(rows)
        dropped = [*getattr(log, "damaged", ()), *dropped]  # lines the log itself could not read come first
        if dropped:
            said.append(f"{len(dropped)} of {log.log.name} ({dropped[0]}{'; ...' if len(dropped) > 1 else ''})")
        kept += rows
    if said:
        warn(f"rows of the unfinished sweep in '{logs[0].path}' that are damaged or not this sweep's are dropped "
             f"and their cells run again: {'; '.join(said)}.")
    return kept
