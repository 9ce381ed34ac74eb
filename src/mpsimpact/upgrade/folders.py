"""A run or sweep folder read back from disk for comparisons: report.json (and each condition's
exact corrupted positions from samples.jsonl or logits.npz), or summary.json and sweep.jsonl. Every
malformed input is a UsageError."""

from __future__ import annotations

import dataclasses
import json
import zipfile
import zlib
from pathlib import Path
from typing import Any

from mpsimpact.config import CORRUPTION_THRESHOLD
from mpsimpact.engine.release import FaultProfile
from mpsimpact.errors import UsageError
from mpsimpact.runs import classify_kind, embed_kind, train_kind  # noqa: F401  (they register their kinds)
from mpsimpact.runs.kind import SCHEMA_VERSION

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
DEFAULT_ATTENTION = "eager"
WHAT_TO_PASS = "pass a folder written by `mpsimpact run` or `mpsimpact sweep`"


def _get(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path`, or None where any key is absent."""
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _read_json(path: Path) -> Any:
    """Parsed JSON, or a UsageError naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"Cannot read '{path}': {error}; {WHAT_TO_PASS}.") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One parsed object per non-empty line, or a UsageError naming the file and line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"Cannot read '{path}': {error}.") from None
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            if line.strip():
                rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise UsageError(f"Cannot read '{path}' line {number}: {error}.") from None
    return rows


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
    corrupted positions (from samples.jsonl or logits.npz)."""

    path: Path
    report: dict[str, Any]
    corrupted: dict[tuple[str, str], frozenset[int]]
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
        return geometry | {"kind": self.report.get("kind", "inference")}

    def conditions(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Each condition by its key: (guard, attention)."""
        return {condition_key(c): c for c in self.report["conditions"]}


def condition_key(condition: dict[str, Any]) -> tuple[str, str]:
    """A condition's identity across runs: its guard, and its attention (eager unless said)."""
    return str(condition.get("guard")), str(condition.get("attention") or DEFAULT_ATTENTION)


def load_run(path: Path) -> RunFolder:
    """Reads a run folder; see RunFolder."""
    report = _read_json(path / "report.json")
    if not _is_run_report(report):
        raise UsageError(f"'{path / 'report.json'}' is not an mpsimpact run report (no conditions or "
                         f"geometry); {WHAT_TO_PASS}.")
    _check_schema(path / "report.json", report, None)
    if (path / "samples.jsonl").is_file():
        corrupted = _corrupted_from_samples(path / "samples.jsonl")
    elif (path / "logits.npz").is_file():
        corrupted = _corrupted_from_logits(path / "logits.npz", report)
    else:
        corrupted = {}
    return RunFolder(path, report, corrupted)


def _is_run_report(report: Any) -> bool:
    """Whether parsed report.json has the shape `mpsimpact run` writes."""
    if not isinstance(report, dict) or not isinstance(report.get("geometry"), dict):
        return False
    conditions = report.get("conditions")
    return isinstance(conditions, list) and all(isinstance(c, dict) for c in conditions)


def _corrupted_from_samples(path: Path) -> dict[tuple[str, str], frozenset[int]]:
    """Corrupted positions per condition, from samples.jsonl."""
    positions: dict[tuple[str, str], set[int]] = {}
    try:
        for sample in _read_jsonl(path):
            found = positions.setdefault(condition_key(sample), set())
            if sample.get("corrupted"):
                found.add(int(sample["position"]))
    except (AttributeError, KeyError, TypeError, ValueError):
        raise UsageError(f"'{path}' is not an mpsimpact samples file (a line without guard or "
                         "position).") from None
    return {key: frozenset(found) for key, found in positions.items()}


def _corrupted_from_logits(path: Path, report: dict[str, Any]) -> dict[tuple[str, str], frozenset[int]]:
    """Corrupted positions per guard, recomputed from logits.npz at the report's threshold."""
    import numpy as np

    from mpsimpact.runs.metrics import relative_error

    if any(c.get("attention") for c in report["conditions"]):
        return {}  # logits.npz is keyed by guard alone: ambiguous when attention varies
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as error:  # truncated, garbled
        raise UsageError(f"Cannot read '{path}' ({type(error).__name__}: {error}); it is damaged or truncated: "
                         "rerun `mpsimpact run` for this folder.") from None
    if "reference" not in arrays:
        raise UsageError(f"'{path}' has no reference logits; it was not written by `mpsimpact run`.")
    for name, logits in arrays.items():
        if name.startswith("guard_") and logits.shape != arrays["reference"].shape:
            raise UsageError(f"'{path}': '{name}' has shape {list(logits.shape)}, the reference "
                             f"{list(arrays['reference'].shape)}; it is damaged: rerun `mpsimpact run` for this "
                             "folder.")
    threshold = report.get("config", {}).get("threshold", CORRUPTION_THRESHOLD)
    return {(name.removeprefix("guard_"), DEFAULT_ATTENTION):
            frozenset(np.flatnonzero(relative_error(logits, arrays["reference"]) > threshold).tolist())
            for name, logits in arrays.items() if name.startswith("guard_")}


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
            if path.is_file():
                return load_profile(path)
            if not self.rows:
                return None
            first = self.rows[0]
            predicted = str(_get(self.summary, ("profile", "release")) or first.get("torch"))
            derived = derive_profile(self.rows, device=first.get("device"), emulated=self.emulated,
                                     emulated_release=predicted, torch_version=str(first.get("torch")),
                                     machine="", index_bits=int(first.get("index_bits", 32)))
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
    rows = _read_jsonl(path / "sweep.jsonl") if (path / "sweep.jsonl").is_file() else None
    if rows and not all(isinstance(r, dict) and isinstance(r.get("cell"), dict) for r in rows):
        raise UsageError(f"'{path / 'sweep.jsonl'}' is not an mpsimpact sweep (rows without a cell).")
    return SweepFolder(path, summary, rows)


def load_folder(folder: str | Path) -> RunFolder | SweepFolder:
    """A run folder (report.json) or a sweep folder (summary.json); UsageError for anything else."""
    path = Path(folder)
    if not path.exists():
        raise UsageError(f"Folder '{path}' does not exist; {WHAT_TO_PASS}.")
    if not path.is_dir():
        raise UsageError(f"'{path}' is not a folder; {WHAT_TO_PASS}.")
    if (path / "report.json").is_file():
        return load_run(path)
    if (path / "summary.json").is_file():
        return load_sweep(path)
    raise UsageError(f"'{path}' holds neither report.json (a run) nor summary.json (a sweep); "
                     f"{WHAT_TO_PASS}.")
