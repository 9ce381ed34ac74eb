"""A run or sweep folder read back from disk for comparisons: report.json (and each condition's
exact corrupted positions, from the files its kind names), or summary.json and sweep.jsonl. Every
malformed input is a UsageError."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mpsimpact.bounds import FileProblemError, name_problem, parse_json, path_problem, read_file_bytes
from mpsimpact.bounds import shown_path
from mpsimpact.config import DEFAULT_ATTENTION
from mpsimpact.engine.faults import INDEX_BITS_RANGE, MPS_INDEX_BITS
from mpsimpact.engine.release import FaultProfile
from mpsimpact.errors import UsageError
from mpsimpact.runs.kind import SCHEMA_VERSION, RunKind, condition_key
from mpsimpact.runs.kinds import kind_of

# What must match for two runs to be comparable: (name on a slide, path in report.json).
RUN_GEOMETRY = (
    ("batch size", ("geometry", "batch_size")), ("max length", ("geometry", "max_length")),
    ("run length", ("geometry", "run_length")), ("index bits", ("geometry", "index_bits")),
    ("model", ("model",)), ("data source", ("data_source",)), ("scenario", ("config", "scenario")),
    ("kind", ("kind",)))
# What may differ between the two sides: (name, path in report.json).
RUN_ENVIRONMENT = (
    ("torch", ("environment", "torch")), ("transformers", ("environment", "transformers")),
    ("mpsimpact", ("environment", "mpsimpact")), ("device", ("geometry", "device")),
    ("mode", ("geometry", "mode")), ("installed torch's rules", ("environment", "fault_profile")),
    ("rules used", ("geometry", "profile")), ("--torch-profile", ("config", "torch_profile")),
    ("machine", ("environment", "machine")))
WHAT_TO_PASS = "pass a folder written by `mpsimpact run` or `mpsimpact sweep`"
MAX_FILE_BYTES = 1 << 30  # one file of a folder: samples.jsonl of 65,536 texts x 3 conditions is about 100 MB


NULL = type(None)
JSON_WORDS = {str: "text", int: "a whole number", float: "a number", bool: "true or false", list: "a list",
              dict: "an object", NULL: "null"}
# The fields compare reads of each file, by their path in it ("*": every item of a list), and the JSON types each
# may have where it is present (a report from before a field lacks it): checked once, as the file is read
# (`_check_fields`), so that a field of the wrong type is said in one line and never reaches the comparison.
# The checks that need more than a type (counts within the batch, classes adding up) follow it.
COUNTS = ("batch_size", "max_length", "run_length", "index_bits")  # of a run's geometry; the rest is text
RUN_FIELDS = (
    ("kind", str), ("config", dict), ("environment", dict), ("config.threshold", int, float),
    ("geometry.emulated", bool, NULL), ("columns", list), ("columns.*", list), ("columns.*.*", str),
    *((".".join(path), int, NULL) if path[-1] in COUNTS else (".".join(path), str, NULL)
      for _, path in RUN_GEOMETRY + RUN_ENVIRONMENT if path != ("kind",)),
    *((f"conditions.*.{name}", str, NULL) for name in ("attention", "message")),
    ("conditions.*.altered_calls", list), ("conditions.*.altered_calls.*", dict),
    ("conditions.*.altered_calls.*.fault", dict), ("conditions.*.altered_calls.*.fault.kind", str),
)
SUMMARY_FIELDS = (
    ("mode", str, NULL), ("config", dict), ("config.device", str, NULL), ("config.quick", bool, NULL),
    ("config.dtypes", list), ("config.dtypes.*", str), ("config.layouts", list), ("config.layouts.*", str),
    ("profile", dict), ("profile.release", str, NULL),
)
SWEEP_ROW_FIELDS = (("device", str, NULL), ("torch", str, NULL), ("index_bits", int, NULL))


def _get(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path`, or None where any key is absent."""
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _read_json(path: Path, allow_nan: bool = False) -> Any:
    """Parsed JSON (bounded: bounds.parse_json; NaN refused unless `allow_nan`), or a UsageError naming the
    file."""
    try:
        return parse_json(_read_text(path), allow_nan=allow_nan)
    except ValueError as error:
        raise UsageError(f"Cannot read '{path}': {error}; {WHAT_TO_PASS}.") from None


def _said(value: Any) -> str:
    """A value as a one-line message shows it: its JSON, cut at 40 characters; a list or an object by its type
    (what is wrong with it; its items may be long, or none)."""
    return JSON_WORDS[type(value)] if isinstance(value, (list, dict)) else json.dumps(value)[:40]


def _check_fields(path: Path, data: dict[str, Any], fields: tuple, where: str = "") -> None:
    """Refuses, in one line naming the file and the field, the first of `fields` (RUN_FIELDS, SUMMARY_FIELDS,
    ...) present in `data` with a value of another JSON type; `where` leads the field's name ("line 3: ")."""
    for name, *types in fields:
        for field, value in _values(data, name.split(".")):
            if type(value) not in types:  # said by type: a value of the wrong type may be long, or empty
                wanted = [JSON_WORDS[kind] for kind in types if not (kind is int and float in types)]
                raise _damaged(path, f"{where}{field} is {JSON_WORDS[type(value)]}, not {' or '.join(wanted)}")


def _values(data: Any, keys: list[str], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of each value at the path `keys` ("*": every item of a list); a path through
    something absent, or not an object or list (refused by its own entry), yields nothing."""
    if not keys:
        yield prefix.removesuffix("."), data
    elif keys[0] == "*" and isinstance(data, list):
        for index, item in enumerate(data):
            yield from _values(item, keys[1:], f"{prefix}{index}.")
    elif isinstance(data, dict) and keys[0] in data:
        yield from _values(data[keys[0]], keys[1:], f"{prefix}{keys[0]}.")


def _read_text(path: Path) -> str:
    """A folder's file as UTF-8 text: a regular file of at most MAX_FILE_BYTES (Note [Only regular files])."""
    try:
        return read_file_bytes(path, MAX_FILE_BYTES, "a report's file").decode("utf-8")
    except FileProblemError as error:
        raise UsageError(f"'{shown_path(path)}' {error}; {WHAT_TO_PASS}.") from None
    except UnicodeDecodeError as error:
        raise UsageError(f"Cannot read '{path}': {error}; {WHAT_TO_PASS}.") from None


def _read_jsonl(path: Path, allow_nan: bool = False) -> list[dict[str, Any]]:
    """One parsed object per non-empty line (bounded as `_read_json`), or a UsageError naming the file and
    line."""
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        try:
            if line.strip():
                rows.append(parse_json(line, allow_nan=allow_nan))
        except ValueError as error:
            raise UsageError(f"Cannot read '{path}' line {number}: {error}.") from None
    return rows


def _damaged(path: Path, problem: str) -> UsageError:
    """The one line for a folder whose files do not hold together."""
    return UsageError(f"'{path}' is damaged or mixes two results: {problem}; rerun the command that wrote it.")


def _is_count(value: Any, below: int | None = None) -> bool:
    """A whole number >= 0 (not a bool), below `below` when given."""
    return type(value) is int and value >= 0 and (below is None or value < below)


def _check_schema(path: Path, data: dict[str, Any], default: int | None) -> int:
    """The folder's schema version; refuses one newer than this mpsimpact reads."""
    version = data.get("schema_version", default)
    if not isinstance(version, int):
        raise UsageError(f"'{path}' is not an mpsimpact report (no schema_version); {WHAT_TO_PASS}.")
    if version > SCHEMA_VERSION:
        raise UsageError(f"'{path}' has schema_version {version}, newer than this mpsimpact reads "
                         f"({SCHEMA_VERSION}); upgrade mpsimpact to compare it.")
    return version


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """A folder written by `mpsimpact run`: report.json and, when present, each condition's exact
    corrupted positions (from the files its kind names: RunKind.corrupted_positions)."""

    path: Path
    report: dict[str, Any]
    corrupted: dict[str, frozenset[int]]  # by runs.kind.condition_key
    kind = "run"

    @property
    def schema_version(self) -> int:
        return self.report["schema_version"]

    @property
    def mode(self) -> str:
        return str(_get(self.report, ("geometry", "mode")) or "-")

    @property
    def emulated(self) -> bool:
        return bool(_get(self.report, ("geometry", "emulated")))

    def environment(self) -> dict[str, Any]:
        return {name: _get(self.report, path) for name, path in RUN_ENVIRONMENT}

    def geometry(self) -> dict[str, Any]:
        geometry = {name: _get(self.report, path) for name, path in RUN_GEOMETRY}
        return geometry | {"kind": kind_of(self.report).name}

    def conditions(self) -> dict[str, dict[str, Any]]:
        """Each condition by its runs.kind.condition_key."""
        return {condition_key(c.get("attention"), c["guard"]): c for c in self.report["conditions"]}


def load_run(path: Path) -> RunFolder:
    """Reads a run folder; see RunFolder."""
    report = _read_json(path / "report.json", allow_nan=True)  # a NaN device output makes an error infinite
    if not _is_run_report(report):
        raise UsageError(f"'{path / 'report.json'}' is not an mpsimpact run report (no conditions or "
                         f"geometry); {WHAT_TO_PASS}.")
    _check_schema(path / "report.json", report, None)
    _check_fields(path / "report.json", report, RUN_FIELDS)
    _check_run_report(path / "report.json", report)
    where, corrupted = kind_of(report).corrupted_positions(report, FolderFiles(path))
    if where is not None:
        _check_corrupted_sets(path / where, report, corrupted)
    return RunFolder(path, report, corrupted)


@dataclasses.dataclass(frozen=True)
class FolderFiles:
    """A run folder's files as its kind reads them back (RunKind.corrupted_positions): within bounds, and
    each problem one line naming the file."""

    path: Path

    def has(self, name: str) -> bool:
        return os.path.lexists(self.path / name)  # a FIFO or a dangling link there is refused, not skipped

    def rows(self, name: str) -> list[Any]:
        return _read_jsonl(self.path / name, allow_nan=True)

    def damaged(self, name: str, problem: str) -> UsageError:
        return _damaged(self.path / name, problem)

    def arrays(self, name: str) -> dict[str, Any]:
        """The arrays of an .npz file, by name."""
        import numpy as np

        path = self.path / name
        problem = path_problem(path, MAX_FILE_BYTES, "a report's file")
        if problem is not None:
            raise UsageError(f"'{shown_path(path)}' {problem}; {WHAT_TO_PASS}.")
        try:
            with np.load(path, allow_pickle=False) as data:
                return {key: data[key] for key in data.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:  # truncated, garbled
            raise UsageError(f"Cannot read '{path}' ({type(error).__name__}: {error}); it is damaged or truncated: "
                             "rerun `mpsimpact run` for this folder.") from None


def _check_run_report(path: Path, report: dict[str, Any]) -> None:
    """The numbers compare reads are there and sane: a batch size, and per condition a guard, a status, and
    counts, first index and fractions in range (finite); each condition once."""
    batch = _get(report, ("geometry", "batch_size"))
    if not _is_count(batch) or not batch:
        raise _damaged(path, f"geometry.batch_size is {_said(batch)}, not a whole number >= 1")
    if any(len(pair) != 2 for pair in report.get("columns", [])):
        raise _damaged(path, "columns holds something other than [key, title] pairs")
    seen, kind = set(), kind_of(report)
    for number, condition in enumerate(report["conditions"], 1):
        if not isinstance(condition.get("guard"), str) or not isinstance(condition.get("status"), str):
            raise _damaged(path, f"condition {number} has no guard or status")
        key = condition_key(condition.get("attention"), condition["guard"])
        if key in seen:
            raise _damaged(path, f"condition {number} (guard {condition['guard']}, "
                                 f"{condition.get('attention') or DEFAULT_ATTENTION} attention) appears twice")
        seen.add(key)
        problem = _condition_problem(condition, batch, kind)
        if problem:
            raise _damaged(path, f"condition {number} (guard {condition['guard']}): {problem}")


def _condition_problem(condition: dict[str, Any], batch: int, kind: RunKind) -> str | None:
    if not all("kind" in call.get("fault", {}) for call in condition.get("altered_calls") or []):
        return "an altered call has no fault kind"  # how MPS stopped is read from it (runs.kind.stop_kind)
    for name in (*kind.counts, "wrong_values_before_stop"):
        value = condition.get(name)
        if value is not None and not _is_count(value, None if name == "wrong_values_before_stop" else batch + 1):
            return f"{name} is {_said(value)}, not a count of at most {batch}"
    first = condition.get("first_corrupted_index")
    if first is not None and not _is_count(first, batch):
        return f"first_corrupted_index is {_said(first)}, not a position below {batch}"
    for name in kind.fractions:
        value = condition.get(name)
        if value is not None and not (type(value) in (int, float) and math.isfinite(value) and 0 <= value <= 1):
            return f"{name} is {_said(value)}, not a number between 0 and 1"
    if condition.get("status") == "completed" and (condition.get("corrupted_count") or 0) and first is None:
        return "it corrupted texts but has no first corrupted position"
    return None


def _check_corrupted_sets(where: Path, report: dict[str, Any], corrupted: dict[str, frozenset[int]]) -> None:
    """The positions file (`where`) must be this report's: positions within the batch, and for every completed
    condition the corrupted set the report counts (count and first position)."""
    batch = report["geometry"]["batch_size"]
    conditions = {condition_key(c.get("attention"), c["guard"]): c for c in report["conditions"]}
    for key, positions in corrupted.items():
        condition = conditions.get(key)
        if condition is None:
            raise _damaged(where, f"it holds guard {key}, a condition report.json does not have")
        guard = condition["guard"]
        if positions and not (min(positions) >= 0 and max(positions) < batch):
            raise _damaged(where, f"guard {guard} has positions outside 0..{batch - 1}")
        count, first = condition.get("corrupted_count"), condition.get("first_corrupted_index")
        if condition.get("status") == "completed" and count is not None and (
                len(positions) != count or min(positions, default=None) != first):
            raise _damaged(where, f"guard {guard} has {len(positions)} corrupted texts from position "
                                  f"{min(positions, default=None)}; report.json says {count} from {first}")
    if corrupted:
        missing = [c["guard"] for key, c in conditions.items() if c.get("status") == "completed"
                   and key not in corrupted and key == c["guard"] and "corrupted_count" in c]  # eager ones
        if missing:
            raise _damaged(where, f"it has no texts of guard {missing[0]}, which completed")


def _is_run_report(report: Any) -> bool:
    """Whether parsed report.json has the shape `mpsimpact run` writes."""
    if not isinstance(report, dict) or not isinstance(report.get("geometry"), dict):
        return False
    conditions = report.get("conditions")
    return isinstance(conditions, list) and all(isinstance(c, dict) for c in conditions)


@dataclasses.dataclass(frozen=True)
class SweepFolder:
    """A folder written by `mpsimpact sweep`: summary.json and, when present, sweep.jsonl."""

    path: Path
    summary: dict[str, Any]
    rows: list[dict[str, Any]] | None
    kind = "sweep"

    @property
    def schema_version(self) -> int:
        return self.summary.get("schema_version", SCHEMA_VERSION)

    @property
    def mode(self) -> str:
        return str(self.summary.get("mode") or "-")

    @property
    def emulated(self) -> bool:
        return self.mode.startswith("EMULATED")

    def environment(self) -> dict[str, Any]:
        first = self.rows[0] if self.rows else {}
        device = first.get("device") or _get(self.summary, ("config", "device"))
        return {"torch": first.get("torch"), "device": device, "mode": self.mode}

    def geometry(self) -> dict[str, Any]:
        config = self.summary.get("config") or {}
        grid = {key: config.get(key) for key in ("quick", "dtypes", "layouts")}
        return {"index bits": config.get("index_bits"), "grid": json.dumps(grid), "kind": "sweep"}

    def cells(self) -> dict[tuple, dict[str, Any]]:
        """Each row by its cell: (m, k, n, batch, layout, dtype)."""
        order = ("m", "k", "n", "batch", "layout", "dtype")
        return {tuple(row["cell"].get(key) for key in order): row for row in self.rows or []}

    def profile(self) -> FaultProfile | None:
        """The release profile the sweep measured: its profile.json, or for a sweep written before there
        was one, derived from its rows now (None without rows, or rows it cannot be derived from)."""
        from mpsimpact.engine.profile_file import ProfileFileError
        from mpsimpact.engine.release import load_profile, profile_from_json
        from mpsimpact.runs.profile_fit import derive_profile

        path = self.path / "profile.json"
        try:
            if os.path.lexists(path):
                return load_profile(path)
            if not self.rows:
                return None
            first = self.rows[0]
            predicted = str(_get(self.summary, ("profile", "release")) or first.get("torch"))
            derived = derive_profile(self.rows, device=first.get("device"), emulated=self.emulated,
                                     emulated_release=predicted, torch_version=str(first.get("torch")),
                                     machine="", index_bits=int(first.get("index_bits", MPS_INDEX_BITS)))
        except ProfileFileError as error:
            raise UsageError(error.message) from None
        except (KeyError, TypeError, ValueError):
            return None  # rows of an older or foreign format: no profile to compare
        return profile_from_json(derived, self.path / "sweep.jsonl")

    def agreement(self) -> dict[str, int]:
        counts = [sum(values) for values in zip(*(self.summary.get("by_class") or {}).values())] or [0, 0, 0]
        return dict(zip(("agree", "disagree", "skipped"), counts))


def load_sweep(path: Path) -> SweepFolder:
    """Reads a sweep folder; see SweepFolder."""
    summary = _read_json(path / "summary.json")
    if (not isinstance(summary, dict) or not isinstance(summary.get("by_class"), dict)
            or "cells" not in summary):
        raise UsageError(f"'{path / 'summary.json'}' is not an mpsimpact sweep summary (no cells or "
                         "by_class).")
    _check_schema(path / "summary.json", summary, SCHEMA_VERSION)
    _check_fields(path / "summary.json", summary, SUMMARY_FIELDS)
    _check_summary(path / "summary.json", summary)
    rows = _read_jsonl(path / "sweep.jsonl") if os.path.lexists(path / "sweep.jsonl") else None
    if rows is not None:
        _check_sweep_rows(path / "sweep.jsonl", rows, summary)
    return SweepFolder(path, summary, rows)


def _check_summary(path: Path, summary: dict[str, Any]) -> None:
    """A sweep summary's counts: whole numbers, the classes' counts adding up to its cells (at least one)."""
    cells, by_class = summary["cells"], summary["by_class"]
    if not _is_count(cells) or not cells:
        raise _damaged(path, f"cells is {_said(cells)}, not a whole number >= 1")
    counts = list(by_class.values())
    if not all(isinstance(c, list) and len(c) == 3 and all(_is_count(n) for n in c) for c in counts):
        raise _damaged(path, "by_class holds something other than [agree, disagree, skipped] counts")
    if sum(map(sum, counts)) != cells:
        raise _damaged(path, f"its classes count {sum(map(sum, counts))} cells, not its {cells}")
    bits = _get(summary, ("config", "index_bits"))
    if bits is not None and not _is_count(bits):
        raise _damaged(path, f"config.index_bits is {_said(bits)}")


def _check_sweep_rows(path: Path, rows: list[Any], summary: dict[str, Any]) -> None:
    """sweep.jsonl must be its summary's: every cell once, well-formed, of one device, torch and index width
    (the summary's), and counted by class and verdict exactly as summary.json counts them."""
    from mpsimpact.runs.sweep import summarize

    if len(rows) != summary["cells"]:
        raise _damaged(path, f"it holds {len(rows)} cells, summary.json counts {summary['cells']}")
    cells = set()
    for number, row in enumerate(rows, 1):
        problem = _sweep_row_problem(row)
        if problem:
            raise _damaged(path, f"line {number}: {problem}")
        _check_fields(path, row, SWEEP_ROW_FIELDS, f"line {number}: ")
        key = tuple(row["cell"][k] for k in ("m", "k", "n", "batch", "layout", "dtype"))
        if key in cells:
            raise _damaged(path, f"line {number} repeats the cell of an earlier line")
        cells.add(key)
    bits = _get(summary, ("config", "index_bits"))
    for field, values in (("device", {r.get("device") for r in rows}), ("torch", {r.get("torch") for r in rows}),
                          ("index bits", {r.get("index_bits") for r in rows} | ({bits} if bits else set()))):
        if len(values - {None}) > 1:
            raise _damaged(path, f"its rows (and summary.json) name {len(values - {None})} {field} values: "
                                 f"{', '.join(sorted(map(str, values - {None})))}")
    counted = summarize(rows)
    if any(counted[key] != summary.get(key, counted[key]) for key in ("by_class", "by_layout", "disagree")):
        raise _damaged(path, "its cells' classes and verdicts are not the ones summary.json counts")
    expected = _grid_of(summary)
    if expected is not None and cells != expected:
        raise _damaged(path, f"its cells are not the grid summary.json's config makes ({len(cells - expected)} "
                             f"cells not in it, {len(expected - cells)} missing)")


def _grid_of(summary: dict[str, Any]) -> set[tuple] | None:
    """The cells the sweep's config makes (runs.sweep.grid), or None where the config does not say."""
    from mpsimpact.runs.sweep import DTYPES, LAYOUTS, grid

    config = summary.get("config") if isinstance(summary.get("config"), dict) else {}
    bits, dtypes, layouts, quick = (config.get(k) for k in ("index_bits", "dtypes", "layouts", "quick"))
    low, high = INDEX_BITS_RANGE
    if not (_is_count(bits) and low <= bits <= high and isinstance(quick, bool) and isinstance(dtypes, list)
            and isinstance(layouts, list) and set(dtypes) <= set(DTYPES) and set(layouts) <= set(LAYOUTS)):
        return None
    return {(c.m, c.k, c.n, c.batch, c.layout, c.dtype) for c in grid(bits, tuple(dtypes), tuple(layouts), quick)}


def _sweep_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict) or not isinstance(row.get("cell"), dict):
        return "a row without a cell"
    cell = row["cell"]
    if not all(_is_count(cell.get(k)) and cell.get(k) for k in ("m", "k", "n", "batch")) or not all(
            isinstance(cell.get(k), str) for k in ("layout", "dtype")):
        return "a cell without whole-number sizes, a layout and a dtype"
    if not isinstance(row.get("observed"), str):
        return "a row without an observed class"
    first = row.get("first_bad_batch")
    if first is not None and not _is_count(first, cell["batch"]):
        return f"first_bad_batch {_said(first)} is not a batch of its cell"
    if "agree" not in row or row["agree"] not in (True, False, None):
        return f"agree is {_said(row.get('agree'))}"
    return None


def load_folder(folder: str | Path) -> RunFolder | SweepFolder:
    """A run folder (report.json) or a sweep folder (summary.json); UsageError for anything else."""
    path = Path(folder)
    problem = name_problem(path)
    if problem is not None:
        raise UsageError(f"Folder '{shown_path(path)}' {problem}; {WHAT_TO_PASS}.")
    if not path.exists():
        raise UsageError(f"Folder '{path}' does not exist; {WHAT_TO_PASS}.")
    if not path.is_dir():
        raise UsageError(f"'{path}' is not a folder; {WHAT_TO_PASS}.")
    if os.path.lexists(path / "report.json"):  # read as a regular file, or refused in one line
        return load_run(path)
    if os.path.lexists(path / "summary.json"):
        return load_sweep(path)
    raise UsageError(f"'{path}' holds neither report.json (a run) nor summary.json (a sweep); "
                     f"{WHAT_TO_PASS}.")
