"""compare checks what it reads: a sweep folder whose sweep.jsonl is empty, cut, of another sweep, or out of
step with its summary.json, NaN anywhere in summary.json, a run folder whose samples are another run's or whose
numbers are out of range: one line, exit 2. A cell one sweep did not run is "cannot tell" (exit 3), never
"fixed" or "still present"."""

import json
import shutil

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from test_compare import BATCH, FIRST, OFF, report, write_run
from said import one_message

runner = CliRunner()
SMALL = ["sweep", "--device", "cpu", "--emulate", "--torch-profile", "2.13.0", "--index-bits", "16",
         "--dtypes", "fp32"]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Two real sweeps (16 bits, fp32): contiguous cells, and a_transposed ones (as many cells, another grid)."""
    root = tmp_path_factory.mktemp("sweeps")
    for name, layout in (("contiguous", "contiguous"), ("transposed", "a_transposed")):
        result = runner.invoke(app, [*SMALL, "--layouts", layout, "--out", str(root / name)])
        assert result.exit_code == 0, result.output
    return root


def copy_of(sweeps, tmp_path, name="contiguous"):
    return shutil.copytree(sweeps / name, tmp_path / f"{name}-copy")


def one_line_exit_2(old, new, *words):
    result = runner.invoke(app, ["compare", str(old), str(new)])
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and one_message(result.stderr) and "Traceback" not in result.output
    for word in words:
        assert word in one_message(result.stderr), result.stderr
    return one_message(result.stderr)


def test_a_real_sweep_compared_with_itself_is_unchanged(sweeps):
    result = runner.invoke(app, ["compare", str(sweeps / "contiguous"), str(sweeps / "contiguous")])
    assert result.exit_code == 0, result.output
    assert "bug still present (same 3 faulting cells)" in " ".join(result.stdout.split())


def emptied(folder):
    (folder / "sweep.jsonl").write_text("")


def cut(folder):
    lines = (folder / "sweep.jsonl").read_text().splitlines(keepends=True)
    (folder / "sweep.jsonl").write_text("".join(lines[:-5]))


def doubled_line(folder):
    lines = (folder / "sweep.jsonl").read_text().splitlines(keepends=True)
    (folder / "sweep.jsonl").write_text("".join(lines[:-1] + lines[:1]))


def nan_in_summary(folder):
    text = (folder / "summary.json").read_text()
    (folder / "summary.json").write_text(text.replace('"wall_s": ', '"wall_s": NaN, "was": ', 1))


def nan_in_a_row(folder):
    rows = (folder / "sweep.jsonl").read_text().splitlines()
    rows[9] = rows[9].replace('"first_bad_batch": 1', '"first_bad_batch": NaN')
    (folder / "sweep.jsonl").write_text("\n".join(rows) + "\n")


def flipped_row(folder):  # a faulting cell read as ok: the counts in summary.json no longer match
    rows = [json.loads(line) for line in (folder / "sweep.jsonl").read_text().splitlines()]
    rows[9] |= {"observed": "ok", "first_bad_batch": None}
    (folder / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def cells_miscounted(folder):
    summary = json.loads((folder / "summary.json").read_text())
    summary["cells"] = "30"
    (folder / "summary.json").write_text(json.dumps(summary))


DAMAGES = {
    "empty sweep.jsonl": (emptied, "holds 0 cells, summary.json counts 30"),
    "cut sweep.jsonl": (cut, "holds 25 cells, summary.json counts 30"),
    "a line twice": (doubled_line, "repeats the cell of an earlier line"),
    "NaN in summary.json": (nan_in_summary, "summary.json': NaN is not a number JSON allows"),
    "NaN in a row": (nan_in_a_row, "line 10: NaN is not a number JSON allows"),
    "flipped observation": (flipped_row, "are not the ones summary.json counts"),
    "cells miscounted": (cells_miscounted, 'cells is text, not a whole number'),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_sweep_folder_is_one_line_and_exit_2(sweeps, tmp_path, damage):
    make, words = DAMAGES[damage]
    folder = copy_of(sweeps, tmp_path)
    make(folder)
    one_line_exit_2(sweeps / "contiguous", folder, words)
    one_line_exit_2(folder, sweeps / "contiguous", words)  # on either side


def test_another_sweeps_rows_are_refused(sweeps, tmp_path):
    folder = copy_of(sweeps, tmp_path)
    shutil.copy(sweeps / "transposed" / "sweep.jsonl", folder / "sweep.jsonl")  # 30 cells too, another layout
    one_line_exit_2(sweeps / "contiguous", folder, "is damaged or mixes two results")


def test_a_cell_one_sweep_did_not_run_is_cannot_tell(sweeps, tmp_path):
    # At 3 MiB the 256x256x64 cells from batch 5 are not run (tests/test_sweep_resume.py), the wrapping ones
    # (batch 2..4) are: the faults stay comparable, the cells not run are not claimed either way.
    small = tmp_path / "small"
    result = runner.invoke(app, [*SMALL, "--layouts", "contiguous", "--max-memory", "3MiB", "--out", str(small)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["compare", str(sweeps / "contiguous"), str(small)], env={"COLUMNS": "200"})
    text = " ".join(result.stdout.split())
    assert result.exit_code == 3, result.output
    assert "cannot tell:" in text and "cells were not run in one of the sweeps (over its --max-memory)" in text
    assert "changed outcome" not in text and "bug fixed" not in text


def run_pair(tmp_path, new_run, samples=None):
    old = write_run(tmp_path / "old", report())
    new = write_run(tmp_path / "new", new_run)
    if samples is not None:
        (new / "samples.jsonl").write_text(samples)
    return old, new


def test_a_run_whose_samples_are_another_runs_is_refused(tmp_path):
    shifted = report()
    shifted["conditions"][OFF]["first_corrupted_index"] = FIRST - 1  # the samples still say 1365 on
    old = write_run(tmp_path / "old", report())
    new = write_run(tmp_path / "new", report())
    (new / "report.json").write_text(json.dumps(shifted))
    one_line_exit_2(old, new, "samples.jsonl' is damaged or mixes two results: guard off has 683 corrupted texts "
                              "from position 1365; report.json says 683 from 1364")


@pytest.mark.parametrize(("samples", "words"), [
    ("", "it holds no texts"),
    ('{"guard": "off", "position": -1, "corrupted": true}\n', "line 1 has no guard, position or corrupted flag"),
    ('{"guard": "off", "position": 0, "corrupted": false}\n' * 2, "line 2 repeats position 0 of guard off"),
    (json.dumps({"guard": "warn", "position": 0, "corrupted": False}) + "\n", "a condition report.json does not have"),
], ids=["empty", "negative position", "repeated", "foreign condition"])
def test_bad_samples_are_one_line_and_exit_2(tmp_path, samples, words):
    one_line_exit_2(*run_pair(tmp_path, report(), samples), words)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("accuracy", float("nan"), "accuracy is NaN, not a number between 0 and 1"),
    ("corrupted_count", BATCH + 1, f"corrupted_count is {BATCH + 1}, not a count of at most {BATCH}"),
    ("first_corrupted_index", "1365", 'first_corrupted_index is text, not a whole number'),
    ("first_corrupted_index", 2048, "first_corrupted_index is 2048, not a position below 2048"),
    ("flips", -3, "flips is -3"),
])
def test_a_report_number_out_of_range_is_one_line_and_exit_2(tmp_path, field, value, words):
    run = report()
    run["conditions"][OFF][field] = value
    old = write_run(tmp_path / "old", report())
    new = write_run(tmp_path / "new", report())
    (new / "report.json").write_text(json.dumps(run))  # json writes NaN as NaN, as a run's report.json could
    one_line_exit_2(old, new, "report.json' is damaged or mixes two results: conditions.0." + words)
