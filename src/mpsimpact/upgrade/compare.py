"""Comparisons of two run folders or two sweep folders (before and after an upgrade): the
environments side by side, each condition's (or cell's) outcome old -> new, and verdicts in plain
words, each saying whether something that matters changed (the exit code of `mpsimpact compare`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mpsimpact.engine.faults import SILENT_KINDS, STOP_KINDS
from mpsimpact.errors import UsageError
from mpsimpact.output.page import cell_name, without_rule_names
from mpsimpact.runs.kind import RunKind, status_words, stop_kind, stopped_in
from mpsimpact.runs.kinds import kind_of
from mpsimpact.runs.sweep import NOT_RUN
from mpsimpact.config import DEFAULT_ATTENTION
from mpsimpact.upgrade.folders import RunFolder, SweepFolder, load_folder
from mpsimpact.upgrade.profile_change import describe_change

VERSIONS = ("torch", "transformers")
PROFILES = ("installed torch's rules", "rules used", "--torch-profile")
# Observed sweep classes in which MPS (or its emulation) did something wrong.
FAULTED = SILENT_KINDS | STOP_KINDS | {"crash"}


# Exit codes: nothing that matters changed; something did; (2: bad input, the CLI's); cannot tell,
# because a side of a compared condition did not run (not emulated on an unmeasured release).
UNCHANGED, CHANGED, CANNOT_TELL = 0, 1, 3


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One plain-words finding; `changed` when it is something that matters (exit code 1);
    `undecided` when a side did not run, so nothing can be said (exit code 3 unless something changed)."""

    text: str
    changed: bool
    undecided: bool = False


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Two folders compared: what `mpsimpact compare` prints, writes and exits with."""

    kind: str  # "run" or "sweep"
    old: str
    new: str
    modes: tuple[str, str]
    emulated: tuple[bool, bool]
    environment: list[dict[str, Any]]  # {"field", "old", "new"}
    verdicts: list[Verdict]
    # Runs: the titles of the compared condition values, and per condition
    # {"guard", "attention", "values": {title: [old, new]}}.
    columns: list[str] = dataclasses.field(default_factory=list)
    conditions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Sweeps: {"cell", "old", "new"} for each cell whose outcome changed; {"old"|"new": counts}.
    cells: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    agreement: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(v.changed for v in self.verdicts)

    @property
    def undecided(self) -> bool:
        return any(v.undecided for v in self.verdicts)

    @property
    def exit_code(self) -> int:
        return CHANGED if self.changed else CANNOT_TELL if self.undecided else UNCHANGED

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"changed": self.changed, "exit_code": self.exit_code}


def compare_folders(old: str | Path, new: str | Path) -> Comparison:
    """Compares two run folders or two sweep folders.

    Args:
        old: the folder written before the upgrade.
        new: the folder written after it.

    Returns:
        The comparison; its `exit_code` is 1 when any verdict is a change that matters (including
        a geometry that makes the two not comparable), else 0.

    Raises:
        UsageError: a folder is missing, neither a run nor a sweep, unreadable, of another kind
            than the other, or of another (or a newer) schema version.
    """
    before, after = load_folder(old), load_folder(new)
    if before.kind != after.kind:
        raise UsageError(f"Cannot compare a {before.kind} ('{old}') with a {after.kind} ('{new}'); "
                         "pass two run folders or two sweep folders.")
    environment = _environment_rows(before, after)
    part = _compare_runs(before, after) if isinstance(before, RunFolder) else _compare_sweeps(before, after)
    differing = _differing_geometry(before, after)
    if differing:
        part["verdicts"] = [Verdict(f"different geometry: not comparable ({'; '.join(differing)})", True)]
    if isinstance(before, SweepFolder):  # a profile is the same at any index width: always comparable
        part["verdicts"] = _profile_verdicts(before, after) + part["verdicts"]
    part["verdicts"] += _context_verdicts(environment, before, after)
    return Comparison(kind=before.kind, old=str(old), new=str(new), modes=(before.mode, after.mode),
                      emulated=(before.emulated, after.emulated), environment=environment, **part)


def _environment_rows(before, after) -> list[dict[str, Any]]:
    """Field, old value, new value; rows absent on both sides are left out."""
    old_env, new_env = before.environment(), after.environment()
    old, new = ("emulated" if side.emulated else "real" for side in (before, after))
    rows = [{"field": "emulated or real", "old": old, "new": new}]
    for field in [*old_env, *(f for f in new_env if f not in old_env)]:
        if old_env.get(field) is not None or new_env.get(field) is not None:
            rows.append({"field": field, "old": old_env.get(field), "new": new_env.get(field)})
    return rows


def _differing_geometry(before, after) -> list[str]:
    """'batch size 2048 vs 4096' for every field that makes two folders not comparable."""
    old_geo, new_geo = before.geometry(), after.geometry()
    differing = [name for name in old_geo if old_geo.get(name) != new_geo.get(name)]
    return [f"{name} {old_geo.get(name)} vs {new_geo.get(name)}" for name in differing]


def _context_verdicts(environment: list[dict[str, Any]], before, after) -> list[Verdict]:
    """Informational lines: versions, fault profile, emulated or real."""
    # A key one side lacks (an older report) is no change.
    rows = {row["field"]: row for row in environment if row["old"] is not None and row["new"] is not None}
    versions = [rows[name] for name in VERSIONS if name in rows]
    moved = [f"{r['field']} {r['old']} -> {r['new']}" for r in versions if r["old"] != r["new"]]
    verdicts = []
    if moved:
        verdicts.append(Verdict("versions changed: " + ", ".join(moved), False))
    elif versions:
        same = ", ".join(f"{r['field']} {r['old']}" for r in versions)
        verdicts.append(Verdict(f"same versions: {same}", False))
    profiles = [
        f"{'' if name == PROFILES[0] else name + ' '}{rows[name]['old']} -> {rows[name]['new']}"
        for name in PROFILES if name in rows and rows[name]["old"] != rows[name]["new"]
    ]
    if profiles:
        verdicts.append(Verdict("fault profile changed: " + ", ".join(profiles), False))
    if before.emulated != after.emulated:
        verdicts.append(Verdict(f"emulated vs real: old is {before.mode}, new is {after.mode}", False))
    elif before.emulated:
        verdicts.append(Verdict("both emulated: no Apple GPU was used on either side", False))
    return verdicts


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """One condition's result, reduced to what verdicts compare."""

    state: str  # clean, corrupted, stopped, error, skipped_predicted_abort, ...
    detail: str  # a verb phrase: "corrupts 683 texts, first at text 1365"
    count: int
    first: int | None
    positions: frozenset[int] | None  # exact corrupted positions, where samples say
    wrong_before_stop: int
    signature: tuple  # what "the same" means when positions are unknown


def _outcome(condition: dict[str, Any], positions: frozenset[int] | None, kind: RunKind) -> _Outcome:
    """Reduces a report condition to its _Outcome; `kind`: the run's kind, which says what it got wrong."""
    status, where = condition.get("status"), stopped_in(condition)
    count, wrong = condition.get("corrupted_count") or 0, condition.get("wrong_values_before_stop") or 0
    first, parts = condition.get("first_corrupted_index"), kind.corrupted_parts(condition)
    if status == "completed":  # "corrupts 683 texts, first at text 1365" (and gradient tensors in training)
        state = "corrupted" if parts else "clean"
        at = f", first at text {first}" if first is not None else ""
        detail = "corrupts " + " and ".join(parts) + at if parts else "is clean"
    elif status == "stopped_by_guard":
        when = f"after {wrong} wrong values" if wrong else "before any wrong value"
        state, detail = "stopped", f"stops{where} {when}"
    elif status == "error":
        state = "abort" if stop_kind(condition) == "abort" else "error"
        dies = "dies (the process aborts)" if state == "abort" else "fails with an error"
        detail = f"{dies}{where}" + (f" after corrupting {count} texts" if count else "")
    else:
        state, detail = str(status), f"was not run ({status})"
    exact = positions if state == "corrupted" else None
    return _Outcome(state, detail, count, first, exact, wrong, (state, count, first, tuple(parts), where, wrong))


def _compare_runs(old: RunFolder, new: RunFolder) -> dict[str, Any]:
    """The condition table and one verdict per condition."""
    compared = kind_of(new.report).compared_columns(new.report)
    old_conditions, new_conditions = old.conditions(), new.conditions()
    rows, verdicts = [], []
    for key in [*old_conditions, *(k for k in new_conditions if k not in old_conditions)]:
        a, b = old_conditions.get(key), new_conditions.get(key)
        who = (a or b)["guard"], str((a or b).get("attention") or DEFAULT_ATTENTION)
        values = {title: [_value(a, name), _value(b, name)] for name, title in compared}
        rows.append({"guard": who[0], "attention": who[1], "values": values})
        if a is None or b is None:
            side = "new" if a is None else "old"
            verdicts.append(Verdict(f"{_label(who)} ran only in the {side} run: not compared", False))
            continue
        judge = {"raise": _raise_verdict, "chunk": _chunk_verdict}.get(who[0], _bug_verdict)
        unrun = [(side, folder, c) for side, folder, c in (("old", old, a), ("new", new, b))
                 if c.get("status") == "not_emulated"]
        if unrun:
            verdicts.append(_cannot_tell(who, *unrun[0]))
        else:
            verdicts.append(judge(who, _outcome(a, old.corrupted.get(key), kind_of(old.report)),
                                  _outcome(b, new.corrupted.get(key), kind_of(new.report))))
    return {"columns": [title for _, title in compared], "conditions": rows, "verdicts": verdicts}


def _value(condition: dict[str, Any] | None, name: str) -> Any:
    """A condition's value for the table; its status in words ("abort", "stopped by guard")."""
    if condition is None:
        return None
    return status_words(condition) if name == "status" else condition.get(name)


def _cannot_tell(key: tuple[str, str], side: str, folder: RunFolder, condition: dict[str, Any]) -> Verdict:
    """A condition one side could not run: no verdict on it, why, and what to do about that."""
    from mpsimpact.engine.release import is_profile_path, profile_for

    release = str(folder.report.get("geometry", {}).get("profile") or folder.environment().get("torch") or "?")
    why = condition.get("message") or "not emulated"
    text = f"{_label(key)}: the {side} side could not be emulated ({without_rule_names(why)})"
    if is_profile_path(release):
        text += f"; the profile {release} leaves these calls unmeasured: measure them on a Mac with `mpsimpact sweep"
        text += " --device mps`"
        return Verdict(text, False, True)
    try:
        unmeasured = profile_for(release).conservative
    except ValueError:
        unmeasured = True
    if unmeasured:
        text += (f"; torch {release} is an unmeasured release: measure it on a Mac with `mpsimpact sweep --device "
                 "mps`, run again with `--torch-profile` set to the sweep's profile.json, and compare that run")
    return Verdict(text, False, True)


def _who(key: tuple[str, str]) -> str:
    return key[0] if key[1] == DEFAULT_ATTENTION else f"{key[0]} ({key[1]} attention)"


def _label(key: tuple[str, str]) -> str:
    return f"guard {_who(key)}"


def _bug_verdict(key: tuple[str, str], old: _Outcome, new: _Outcome) -> Verdict:
    """Guard off (or any guard that does not intervene): is the bug still there, on the same texts?"""
    prefix = "" if key == ("off", DEFAULT_ATTENTION) else f"{_label(key)}: "
    if old.state == new.state == "clean":
        return Verdict(f"{prefix}no bug: {_label(key)} is clean in both runs", False)
    if new.state == "clean":
        return Verdict(f"bug fixed: {_label(key)} is now clean", True)
    if old.state == "clean":
        return Verdict(f"new failure: {_label(key)} now {new.detail}", True)
    if old.state != new.state:
        return Verdict(f"{prefix}bug still present, but different (before: {old.detail}; now: {new.detail})", True)
    if old.positions is not None and new.positions is not None:  # two exact corrupted sets
        before, now = old.positions, new.positions
        if before == now:
            return Verdict(f"{prefix}bug still present (same {len(now)} texts)", False)
        return Verdict(f"{prefix}bug still present, different texts ({len(before)} -> {len(now)} corrupted: "
                       f"{len(now - before)} newly, {len(before - now)} no longer; first at text "
                       f"{min(before, default=None)} -> {min(now, default=None)})", True)
    if old.signature == new.signature:
        same = (f"same count: {new.count} texts, first at text {new.first}; no samples to compare texts"
                if new.state == "corrupted" else f"{_label(key)} {new.detail} in both runs")
        return Verdict(f"{prefix}bug still present ({same})", False)
    return Verdict(f"{prefix}bug still present, different texts (before: {old.detail}; now: {new.detail})", True)


def _stops_in_time(outcome: _Outcome) -> bool:
    return outcome.state == "clean" or (outcome.state == "stopped" and not outcome.wrong_before_stop)


def _raise_verdict(key: tuple[str, str], old: _Outcome, new: _Outcome) -> Verdict:
    """Guard raise: it must stop before any wrong value (or have nothing to stop)."""
    who = _who(key)
    if _stops_in_time(old) and not _stops_in_time(new):
        in_time = " in time" if new.state == "stopped" else ""
        return Verdict(f"guard regression: {who} no longer stops{in_time} (now {new.detail})", True)
    if not _stops_in_time(old) and _stops_in_time(new):
        return Verdict(f"guard {who} fixed: now {new.detail}", True)
    if old.signature != new.signature:
        return Verdict(f"guard {who} changed: before, it {old.detail}; now it {new.detail}", True)
    if not _stops_in_time(new):
        return Verdict(f"guard {who} still does not stop in time ({new.detail})", False)
    if new.state == "clean":
        return Verdict(f"guard {who} is clean in both runs (nothing to stop)", False)
    return Verdict(f"guard {who} still {new.detail}", False)


def _chunk_verdict(key: tuple[str, str], old: _Outcome, new: _Outcome) -> Verdict:
    """Guard chunk: it must complete with values equal to the reference."""
    who = _who(key)
    if old.state == "clean" and new.state != "clean":
        return Verdict(f"guard regression: {who} no longer clean (now {new.detail})", True)
    if old.state != "clean" and new.state == "clean":
        return Verdict(f"guard {who} fixed: now clean", True)
    if new.state == "clean":
        return Verdict(f"guard {who} still clean", False)
    if old.signature != new.signature:
        return Verdict(f"guard {who} changed: before, it {old.detail}; now it {new.detail}", True)
    return Verdict(f"guard {who} still not clean ({new.detail})", False)


def _observed(row: dict[str, Any]) -> str:
    first = row.get("first_bad_batch")
    return str(row.get("observed")) + (f" from batch {first}" if first is not None else "")


def _compare_sweeps(old: SweepFolder, new: SweepFolder) -> dict[str, Any]:
    """The changed cells, the agreement counts, and their verdicts. A cell one side did not run (over its
    --max-memory) is not compared: its outcome there is unknown, so it is said as "cannot tell"."""
    old_cells, new_cells = old.cells(), new.cells()
    shared = [key for key in old_cells if key in new_cells]
    unrun = [key for key in shared if NOT_RUN in (old_cells[key].get("observed"), new_cells[key].get("observed"))]
    changed = [
        {"cell": old_cells[key]["cell"], "old": _observed(old_cells[key]), "new": _observed(new_cells[key])}
        for key in shared if key not in unrun and _observed(old_cells[key]) != _observed(new_cells[key])
    ]
    agreement = {"old": old.agreement(), "new": new.agreement()}
    verdicts = _fault_verdicts(old, new, changed, set(unrun)) + [_agreement_verdict(agreement)]
    if unrun:
        first = cell_name(old_cells[unrun[0]]["cell"])
        verdicts.append(Verdict(f"cannot tell: {len(unrun)} cells were not run in one of the sweeps (over its "
                                f"--max-memory), e.g. {first}: not compared", False, True))
    for side, here, there in (("old", old_cells, new_cells), ("new", new_cells, old_cells)):
        alone = [key for key in here if key not in there]
        if alone:
            verdicts.append(Verdict(f"{len(alone)} cells only in the {side} sweep: not compared", False))
    return {"cells": changed, "agreement": agreement, "verdicts": verdicts}


def _profile_verdicts(old: SweepFolder, new: SweepFolder) -> list[Verdict]:
    """How the release profile each sweep measured changed, in plain words (upgrade.profile_change); a
    change matters."""
    before, after = old.profile(), new.profile()
    if before is None or after is None:
        return []
    return [Verdict(*describe_change(before, after))]  # (text, changed)


def _faulted(sweep: SweepFolder, leave_out: set[tuple] = frozenset()) -> int:
    """Faulting cells: counted on its rows, leaving out cells the other side did not run; else its summary."""
    if sweep.rows is not None:
        return sum(row.get("observed") in FAULTED for key, row in sweep.cells().items() if key not in leave_out)
    counts = sweep.summary.get("by_class") or {}
    return sum(sum(counts.get(name, ())) for name in FAULTED)


def _fault_verdicts(old: SweepFolder, new: SweepFolder, changed: list[dict[str, Any]],
                    unrun: set[tuple] = frozenset()) -> list[Verdict]:
    """Is the bug still there, in the same cells? (Cells one side did not run are left out of both counts.)"""
    before, after = _faulted(old, unrun), _faulted(new, unrun)
    verdicts = []
    if before and not after:
        verdicts.append(Verdict(f"bug fixed: no cell faults any more ({before} before)", True))
    elif after and not before:
        verdicts.append(Verdict(f"new failure: {after} cells now fault (none before)", True))
    if old.rows is None or new.rows is None:
        side = "old" if old.rows is None else "new"
        same = old.summary.get("by_class") == new.summary.get("by_class")
        text = (f"cells not compared (no sweep.jsonl in the {side} sweep); counts by class "
                f"{'un' * same}changed")
        return verdicts + [Verdict(text, not same, same)]  # the same counts may hide other cells: cannot tell
    if changed:
        first = changed[0]
        example = f"{cell_name(first['cell'])}: {first['old']} -> {first['new']}"
        return verdicts + [Verdict(f"{len(changed)} cells changed outcome (e.g. {example})", True)]
    if before:
        return verdicts + [Verdict(f"bug still present (same {before} faulting cells)", False)]
    return verdicts + [Verdict("no cell faults in either sweep", False)]


def _agreement_verdict(agreement: dict[str, dict[str, int]]) -> Verdict:
    """Agreement with the fault model, old -> new."""
    old, new = agreement["old"], agreement["new"]
    if old == new:
        counts = f"{new['agree']} agree, {new['disagree']} disagree"
        return Verdict(f"agreement with the fault model unchanged ({counts})", False)
    return Verdict(f"agreement with the fault model changed: {old['agree']} -> {new['agree']} agree, "
                   f"{old['disagree']} -> {new['disagree']} disagree", old["disagree"] != new["disagree"])
