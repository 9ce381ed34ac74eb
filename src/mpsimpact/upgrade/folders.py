"""A run or sweep folder read back from disk for comparisons: report.json (and each condition's
exact corrupted positions, from the files its kind names), or summary.json and sweep.jsonl. Every
malformed input is a UsageError."""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpsimpact.bounds import FileProblemError, name_problem, parse_json, path_problem, read_file_bytes
from mpsimpact.bounds import shown_path
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.engine.release import FaultProfile
from mpsimpact.errors import UsageError
from mpsimpact.output.record import Damaged
from mpsimpact.runs.kind import SCHEMA_VERSION, condition_key
from mpsimpact.runs.run_report import RunReport
from mpsimpact.runs.sweep_summary import SweepRow, SweepSummary

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


def _get(data: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path`, or None where any key is absent."""
    for key in path:
        if not isinstance(data, Mapping):
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


def _typed(path: Path, read: Any, data: Any) -> Any:
    """`read(data)` (a typed value's reader), its damage one line naming the file and the field."""
    try:
        return read(data)
    except Damaged as error:
        raise _damaged(path, str(error)) from None


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


def _refuse_newer(path: Path, data: dict[str, Any]) -> None:
    """A file of a newer schema than this mpsimpact reads is refused in one line, before its fields are read."""
    version = data.get("schema_version")
    if type(version) is int and version > SCHEMA_VERSION:
        raise UsageError(f"'{path}' has schema_version {version}, newer than this mpsimpact reads "
                         f"({SCHEMA_VERSION}); upgrade mpsimpact to compare it.")


def _damaged(path: Path, problem: str) -> UsageError:
    """The one line for a folder whose files do not hold together."""
    return UsageError(f"'{path}' is damaged or mixes two results: {problem}; rerun the command that wrote it.")


@dataclasses.dataclass(frozen=True)
class RunFolder:
    """A folder written by `mpsimpact run`: report.json and, when present, each condition's exact
    corrupted positions (from the files its kind names: RunKind.corrupted_positions)."""

    path: Path
    report: RunReport
    corrupted: dict[str, frozenset[int]]  # by runs.kind.condition_key
    kind = "run"

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
        return geometry | {"kind": self.report.run_kind.name}

    def conditions(self) -> dict[str, dict[str, Any]]:
        """Each condition by its runs.kind.condition_key."""
        return {condition_key(c.get("attention"), c["guard"]): c for c in self.report["conditions"]}


def load_run(path: Path) -> RunFolder:
    """Reads a run folder (see RunFolder): report.json as a RunReport, and its kind's positions file, which must be
    that report's."""
    data = _read_json(path / "report.json", allow_nan=True)  # a NaN device output makes an error infinite
    if not (isinstance(data, dict) and "geometry" in data and "conditions" in data):
        raise UsageError(f"'{path / 'report.json'}' is not an mpsimpact run report (no conditions or "
                         f"geometry); {WHAT_TO_PASS}.")
    _refuse_newer(path / "report.json", data)
    report = _typed(path / "report.json", RunReport.from_json, data)
    where, corrupted = report.run_kind.corrupted_positions(report, FolderFiles(path))
    if where is not None and (problem := report.positions_problem(corrupted)) is not None:
        raise _damaged(path / where, problem)
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


@dataclasses.dataclass(frozen=True)
class SweepFolder:
    """A folder written by `mpsimpact sweep`: summary.json and, when present, sweep.jsonl."""

    path: Path
    summary: SweepSummary
    rows: list[SweepRow] | None
    kind = "sweep"

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
    """Reads a sweep folder (see SweepFolder): summary.json as a SweepSummary and sweep.jsonl's rows, which must be
    that summary's."""
    data = _read_json(path / "summary.json")
    if not isinstance(data, dict) or "by_class" not in data or "cells" not in data:
        raise UsageError(f"'{path / 'summary.json'}' is not an mpsimpact sweep summary (no cells or by_class).")
    _refuse_newer(path / "summary.json", data)
    summary = _typed(path / "summary.json", SweepSummary.from_json, data)
    rows = None
    if os.path.lexists(path / "sweep.jsonl"):
        rows = [_typed(path / "sweep.jsonl", lambda row: SweepRow.from_json(row, f"line {number}: "), row)
                for number, row in enumerate(_read_jsonl(path / "sweep.jsonl"), 1)]
        if (problem := summary.rows_problem(rows)) is not None:
            raise _damaged(path / "sweep.jsonl", problem)
    return SweepFolder(path, summary, rows)


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
