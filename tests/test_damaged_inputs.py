"""Damaged inputs get one line, never a traceback. compare refuses a report.json, summary.json or sweep.jsonl
whose fields have the wrong JSON type (exit 2, naming the file and the field); a resumed sweep drops a row of
its unfinished logs whose observation has the wrong type (one warning line; its cell runs again); a file where
a sweep keeps its unfinished folder is refused and left as it is."""

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

import mpsimpact.runs.cell as cell_module
from mpsimpact.cli import app
from mpsimpact.engine.release import resolve_profile
from mpsimpact.output.record import field_type, fits
from mpsimpact.runs.family_cells import FamilyCell, family_grid
from mpsimpact.runs.run_report import RunReport
from mpsimpact.runs.sweep_summary import SweepRow, SweepSummary
from mpsimpact.bounds import parse_json
from mpsimpact.runs.row_check import reread_problem, reread_rows
from mpsimpact.runs.sweep import Cell, grid
from interrupted import interrupted_sweep
from said import messages, one_message

runner = CliRunner()
WRONG = (None, [], "x", 5, {})  # one value of each JSON type but bool
RUN = ["run", "sentiment", "--quick", "--device", "cpu", "--emulate", "--torch-profile", "2.14.0"]
SWEEP = ["sweep", "--device", "cpu", "--emulate", "--torch-profile", "2.13.0", "--index-bits", "16",
         "--dtypes", "fp32", "--layouts", "contiguous"]
CELLS, FAMILY_CELLS = grid(16, ("fp32",), ("contiguous",), True), family_grid(16)
# Every top-level field is read through the file's typed value (runs.run_report.RunReport,
# runs.sweep_summary.SweepSummary); those of them that may also be null.
COUNTED = {"by_layout", "disagree"}  # checked against the rows: said as counts summary.json does not match
MAY_BE_NULL = {"model", "data_source", "mode", "derived_profile", "largest_buffer"}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A real quick run (folder "run") and a real small sweep (folder "sweep")."""
    root = tmp_path_factory.mktemp("real")
    for args, name in ((RUN, "run"), (SWEEP, "sweep")):
        result = runner.invoke(app, [*args, "--out", str(root / name)])
        assert result.exit_code == 0, result.output
    return root


def damaged_copy(folder, tmp_path, name, change):
    """A copy of `folder` whose file `name` (JSON, or JSON lines: a list of rows) went through `change`."""
    copy = tmp_path / f"damaged-{folder.name}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    text = (copy / name).read_text()
    if name.endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines()]
        change(rows)
        (copy / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        data = json.loads(text)
        change(data)
        (copy / name).write_text(json.dumps(data))
    return copy


def compare_both_ways(good, damaged):
    """compare run with the damaged folder as the old side, then as the new one: [(exit code, stderr)]."""
    said = []
    for old, new in ((good, damaged), (damaged, good)):
        result = runner.invoke(app, ["compare", str(old), str(new)])
        assert "Traceback" not in result.output and not isinstance(result.exception, (TypeError, ValueError,
                                                                                       AttributeError, KeyError))
        said.append((result.exit_code, result.stderr, result.output))
    return said


def wrong_values(field, value, typed):
    """The values of WRONG of another JSON type than `value` (and than null, where the field may be null) that the
    file's typed value (`typed`, a Record class) does not take for the field."""
    allowed = {type(value)} | ({type(None)} if field in MAY_BE_NULL else set())
    return [wrong for wrong in WRONG if type(wrong) not in allowed and not fits(wrong, field_type(typed, field))]


@pytest.mark.parametrize("what", ["run", "sweep"])
def test_every_top_level_field_of_the_wrong_type_is_one_line_exit_2_or_changes_nothing(real, tmp_path, what):
    name, typed = ("report.json", RunReport) if what == "run" else ("summary.json", SweepSummary)
    original = json.loads((real / what / name).read_text())
    for field, value in original.items():
        wrong_ones = wrong_values(field, value, typed)
        assert len(wrong_ones) >= 2, field  # every field is held to a type
        for wrong in wrong_ones:
            damaged = damaged_copy(real / what, tmp_path, name, lambda data: data.update({field: wrong}))
            for code, stderr, output in compare_both_ways(real / what, damaged):
                assert code == 2, (field, wrong, output)
                line = one_message(stderr)
                assert name in line and (field in line or field in COUNTED), (field, wrong, line)


def set_in(path, value):
    """A change that sets the field at `path` (keys and list indexes) to `value`."""
    def change(data):
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value
    return change


def error_condition(calls):
    """A change that makes the run's guard-raise condition an error, with `calls` as its altered calls."""
    def change(report):
        report["conditions"][1].update(status="error", message="stopped", altered_calls=calls)
    return change


NESTED = {  # what the tester saw crash, and its neighbours: (folder, file, change, the words of the one line)
    "kind a list": ("run", "report.json", set_in(["kind"], []), "kind is a list, not text"),
    "columns null": ("run", "report.json", set_in(["columns"], None), "columns is null, not a list"),
    "columns text": ("run", "report.json", set_in(["columns"], "x"), "columns is text, not a list"),
    "a column null": ("run", "report.json", set_in(["columns"], [None]), "columns.0 is null, not a list"),
    "a column of one": ("run", "report.json", set_in(["columns", 0], ["guard"]), "columns.0 holds 1 item, not 2"),
    "a column's key a list": ("run", "report.json", set_in(["columns", 1, 0], []), "columns.1.0 is a list"),
    "a call a number": ("run", "report.json", error_condition([5]), "conditions.1.altered_calls.0 is a whole"),
    "a call's fault absent": ("run", "report.json", error_condition([{}]), "conditions.1.altered_calls.0.fault is "
                                                                           "missing"),
    "a fault's kind a list": ("run", "report.json", error_condition([{"fault": {"kind": []}}]),
                              "altered_calls.0.fault.kind is a list, not text"),
    "threshold text": ("run", "report.json", set_in(["config", "threshold"], "x"), "config.threshold is text"),
    "attention a list": ("run", "report.json", set_in(["conditions", 0, "attention"], []),
                         "conditions.0.attention is a list, not text"),
    "config text": ("sweep", "summary.json", set_in(["config"], "x"), "config is text, not an object"),
    "dtypes [[]]": ("sweep", "summary.json", set_in(["config"], {"dtypes": [[]]}), "config.dtypes.0 is a list"),
    "layouts text": ("sweep", "summary.json", set_in(["config", "layouts"], "x"), "config.layouts is text"),
    "a row's device a list": ("sweep", "sweep.jsonl", set_in([0, "device"], []), "line 1: device is a list"),
    "a row's torch an object": ("sweep", "sweep.jsonl", set_in([2, "torch"], {}), "line 3: torch is an object"),
    "a row's width text": ("sweep", "sweep.jsonl", set_in([1, "index_bits"], "16"), "line 2: index_bits is text"),
}


# A quick run's report.json and samples.jsonl, damaged as a tester did (issue 57): each one line, exit 2, naming
# the file and the field (before, compare answered most of them as if nothing were wrong).
def cut_last_line(rows):
    rows.pop()


AGREEMENT = {
    "a status nobody writes": ("run", "report.json", set_in(["conditions", 0, "status"], "banana"),
                               'conditions.0.status is "banana", not one of completed'),
    "another kind": ("run", "report.json", set_in(["kind"], "training"),
                     "columns are not those of a run of kind training"),
    "schema_version true": ("run", "report.json", set_in(["schema_version"], True), "schema_version is true"),
    "samples' last line cut": ("run", "samples.jsonl", cut_last_line, "holds 15 of the batch's 16 texts"),
    "a fraction beside its count": ("run", "report.json", set_in(["conditions", 0, "corrupted_fraction"], 0.9),
                                    "conditions.0.corrupted_fraction is 0.9, not corrupted_count / batch = 6/16"),
    "wall_s NaN": ("run", "report.json", set_in(["conditions", 0, "wall_s"], float("nan")),
                   "conditions.0.wall_s is NaN, not a finite number"),
    "release null": ("run", "report.json", set_in(["release"], None), "release is null, not an object"),
    "the config's batch another's": ("run", "report.json", set_in(["config", "batch_size"], 17),
                                     "config.batch_size is 17, geometry.batch_size 16"),
    # guard raise's stop: the largest whole batch, 128 bmm batches of 12 a text, said as 10 texts
    "a stop's samples beside its rows": ("run", "report.json", set_in(["conditions", 1, "stop", "whole_samples"], 3),
                                         "conditions.1.stop.whole_samples is 3, not whole_rows // rows_per_sample = "
                                         "128 // 12 = 10"),
}


@pytest.mark.parametrize("case", AGREEMENT, ids=list(AGREEMENT))
def test_a_report_whose_fields_disagree_is_one_line_naming_file_and_field(real, tmp_path, case):
    what, name, change, words = AGREEMENT[case]
    damaged = damaged_copy(real / what, tmp_path, name, change)
    for code, stderr, output in compare_both_ways(real / what, damaged):
        assert code == 2, output
        line = one_message(stderr)
        assert f"{damaged / name}' is damaged" in line and words in line, line


def test_a_quick_run_and_a_sweep_read_back_as_typed_values_write_the_same_bytes(real):
    for folder, name, typed in (("run", "report.json", RunReport), ("sweep", "summary.json", SweepSummary)):
        text = (real / folder / name).read_text()
        assert json.dumps(typed.from_json(parse_json(text, allow_nan=True)).to_json(), indent=2) + "\n" == text
    rows = (real / "sweep" / "sweep.jsonl").read_text()
    assert "".join(json.dumps(SweepRow.from_json(json.loads(line)).to_json()) + "\n"
                   for line in rows.splitlines()) == rows


@pytest.mark.parametrize("case", NESTED, ids=list(NESTED))
def test_a_nested_field_of_the_wrong_type_is_one_line_naming_file_and_field(real, tmp_path, case):
    what, name, change, words = NESTED[case]
    damaged = damaged_copy(real / what, tmp_path, name, change)
    for code, stderr, output in compare_both_ways(real / what, damaged):
        assert code == 2, output
        line = one_message(stderr)
        assert f"{damaged / name}' is damaged" in line and words in line, line


def test_every_field_of_a_sweep_row_of_the_wrong_type_is_dropped_when_resumed(real):
    # Resuming keeps a row only when it is exactly the row its cell and observation make now: a list or an
    # object in its observation, or any other value elsewhere (top level, or one level down), drops it with a
    # reason, and nothing raises. (Another single value that is a consistent observation is kept and judged.)
    profile = resolve_profile("2.13.0")

    def judge(row, cell):  # as SWEEP resumes: on cpu, emulated, 16 bits, torch 2.13.0's rules
        return reread_problem(row, cell, "cpu", True, 16, profile)

    for log, cells in (("sweep.jsonl", CELLS), ("families.jsonl", FAMILY_CELLS)):
        rows = [json.loads(line) for line in (real / "sweep" / log).read_text().splitlines()]
        assert reread_rows(rows, cells, judge) == (rows, [])  # as written: every row kept
        for row in rows[:3] + [r for r in rows if r["observed"] != "ok"][:2]:
            paths = [[key] for key in row] + [[key, inner] for key in row if isinstance(row[key], dict)
                                              for inner in row[key]]
            for path in paths:
                value = row[path[0]] if len(path) == 1 else row[path[0]][path[1]]
                for wrong in (w for w in WRONG if w != value or type(w) is not type(value)):
                    damaged = json.loads(json.dumps(row))
                    set_in(path, wrong)(damaged)
                    kept, dropped = reread_rows([damaged], cells, judge)
                    if path[0] in cells[0].seen_fields and not isinstance(wrong, (list, dict)):
                        assert len(kept + dropped) == 1, (log, path, wrong)
                    else:
                        assert kept == [] and len(dropped) == 1, (log, path, wrong)


def rows_of(folder, log):
    return [json.loads(line) for line in (folder / log).read_text().splitlines()]


@pytest.mark.parametrize("log", ["sweep.jsonl", "families.jsonl"])
def test_a_resumed_sweep_drops_rows_whose_observation_has_the_wrong_type_and_runs_their_cells_again(
        tmp_path, monkeypatch, log):
    partial = interrupted_sweep(SWEEP, tmp_path, monkeypatch, 12 if log == "sweep.jsonl" else len(CELLS) + 6)
    rows = rows_of(partial, log)
    assert len(rows) == (12 if log == "sweep.jsonl" else 6)
    clean = [json.loads(json.dumps(row)) for row in rows]
    rows[1]["observed"] = []  # what the tester saw crash: unhashable type 'list'
    rows[2]["max_rel_error"] = {}
    rows[3]["message"] = ["x"]
    rows[4]["rule" if log == "families.jsonl" else "first_bad_batch"] = [1]
    (partial / log).write_text("".join(json.dumps(row) + "\n" for row in rows))
    real, ran = cell_module.observe, []
    monkeypatch.setattr(cell_module, "observe", lambda cell, *a, **k: ran.append(cell) or real(cell, *a, **k))
    result = runner.invoke(app, [*SWEEP, "--out", str(tmp_path / "s")])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    warnings = [line for line in messages(result.stderr) if line.startswith("warning:")]
    assert len(warnings) == 1 and f"4 of {log} (line 2: its observed is a list, not one value; ...)" in warnings[0]
    kind, grid_cells = (Cell, CELLS) if log == "sweep.jsonl" else (FamilyCell, FAMILY_CELLS)
    again = [cell for cell in ran if isinstance(cell, kind)][:4]
    assert [cell.to_json() for cell in again] == [grid_cells[i].to_json() for i in (1, 2, 3, 4)]
    final = rows_of(tmp_path / "s", log)
    assert [final[i] for i in (1, 2, 3, 4)] == [clean[i] for i in (1, 2, 3, 4)]  # run again: the clean rows


@pytest.mark.parametrize("thing", ["file", "fifo"])
def test_a_file_where_the_unfinished_folder_goes_is_refused_and_left_alone(tmp_path, thing):
    partial = tmp_path / ".s.partial"
    if thing == "file":
        partial.write_text("mine")
    else:
        os.mkfifo(partial)
    result = runner.invoke(app, [*SWEEP, "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line = one_message(result.stderr)
    assert f"'{partial}' is not a folder, so not one this command made" in line and "another --out" in line
    assert sorted(os.listdir(tmp_path)) == [".s.partial"]  # nothing made, nothing deleted
    assert partial.read_text() == "mine" if thing == "file" else not partial.is_dir()
