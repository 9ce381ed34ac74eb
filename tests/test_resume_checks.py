"""A resumed sweep checks what it reads: every row of its unfinished folder is judged again from its cell (an
`agree` is never read back); rows of another sweep and damaged rows (wrong types, NaN, observations that
contradict themselves) are dropped and their cells run again, said in one warning line; nothing is read or
written through a symbolic link, and nothing is written outside the command's own folders."""

import json
import os

import pytest
from typer.testing import CliRunner

import mpsimpact.runs.cell as cell_module
from mpsimpact.cli import app
from mpsimpact.runs.cell import predicted_rows
from mpsimpact.runs.sweep import Cell, grid
from interrupted import interrupted_sweep as interrupted
from said import flat, messages, one_message

runner = CliRunner()
SMALL = ["sweep", "--device", "cpu", "--emulate", "--torch-profile", "2.13.0", "--index-bits", "16",
         "--dtypes", "fp32", "--layouts", "contiguous"]
CELLS = grid(16, ("fp32",), ("contiguous",), True)
# At 16 bits, 256x256x64 at batch 2..4 wraps input a (2 * 65536 elements > 2**16, output 2 * 16384 below it):
# wrong_tail from batch 1; every other contiguous fp32 cell here is ok.
WRAPS = 9  # CELLS[9]: 256x256x64 batch 2


def interrupted_sweep(tmp_path, monkeypatch, after=12):
    """The SMALL sweep into tmp_path/s, interrupted after `after` cells: returns the partial folder."""
    partial = interrupted(SMALL, tmp_path, monkeypatch, after)
    assert len(read_rows(partial)) == after
    return partial


def read_rows(folder):
    return [json.loads(line) for line in (folder / "sweep.jsonl").read_text().splitlines()]


def write_rows(folder, rows):
    (folder / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def resume(tmp_path, monkeypatch):
    """Runs the sweep again; returns (result, the cells it ran)."""
    real, ran = cell_module.observe, []
    monkeypatch.setattr(cell_module, "observe", lambda cell, *a, **k: ran.append(cell) or real(cell, *a, **k))
    return runner.invoke(app, [*SMALL, "--out", str(tmp_path / "s")]), [c for c in ran if isinstance(c, Cell)]


def damage_text(rows):
    rows[1]["observed"] = "banana"  # no such class
    return {1}


def damage_nan_and_flip(rows):
    rows[WRAPS] |= {"observed": "ok", "first_bad_batch": float("nan")}  # a wrong cell read back as ok, NaN batch
    rows[WRAPS + 1]["agree"] = False  # a verdict flipped: judged again, it agrees
    return {WRAPS, WRAPS + 1}


def damage_types(rows):
    rows[2]["max_rel_error"] = "0.1"
    rows[3]["first_bad_batch"] = True
    rows[4]["cell"]["batch"] = 5.0  # the cell of row 4, as a float: not this sweep's cell
    return {2, 3, 4}


def damage_contradiction(rows):
    rows[5]["max_rel_error"] = 0.7  # "ok" with an error far above the fp32 tolerance (1e-3)
    rows[WRAPS + 2] |= {"first_bad_batch": 0}  # wrong_tail from batch 0 is wrong_all
    return {5, WRAPS + 2}


def damage_other_sweep(rows):
    rows[6]["torch"] = "2.4.1"  # another torch
    rows[7]["device"] = "cuda"  # another device
    rows[8]["prediction"]["kind"] = "wrong_all"  # another profile's prediction
    rows.append(dict(rows[0]))  # the same cell twice: which one is right cannot be told
    return {0, 6, 7, 8}


DAMAGES = {"unknown class": damage_text, "nan and flipped": damage_nan_and_flip, "wrong types": damage_types,
           "contradictions": damage_contradiction, "another sweep's rows": damage_other_sweep}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_damaged_or_foreign_rows_are_dropped_rerun_and_said_in_one_line(tmp_path, monkeypatch, damage):
    partial = interrupted_sweep(tmp_path, monkeypatch)
    rows = read_rows(partial)
    clean = {json.dumps(r["cell"]): json.loads(json.dumps(r)) for r in rows}
    damaged = DAMAGES[damage](rows)
    write_rows(partial, rows)
    result, ran = resume(tmp_path, monkeypatch)
    assert result.exit_code == 0, result.output  # every cell agrees: nothing damaged reached the result
    warnings = [line for line in messages(result.stderr) if line.startswith("warning:")]
    assert len(warnings) == 1 and "are dropped and their cells run again" in warnings[0], result.stderr
    assert "Traceback" not in result.output
    reran = {(c.m, c.k, c.n, c.batch) for c in ran[:len(damaged)]}
    assert reran == {(CELLS[i].m, CELLS[i].k, CELLS[i].n, CELLS[i].batch) for i in damaged}
    assert len(ran) == len(CELLS) - 12 + len(damaged)  # the damaged cells, then the ones never run
    final = read_rows(tmp_path / "s")
    assert [r["cell"] for r in final] == [c.to_json() for c in CELLS]
    assert all(r["agree"] for r in final) and final[WRAPS]["observed"] == "wrong_tail"
    for index in damaged:  # run again: the row a clean run writes
        assert final[index] == clean[json.dumps(CELLS[index].to_json())], index
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["disagree"] == 0 and summary["resumed_cells"] == 12 - len(damaged)


def test_an_honest_partial_file_resumes_without_a_warning(tmp_path, monkeypatch):
    interrupted_sweep(tmp_path, monkeypatch)
    result, ran = resume(tmp_path, monkeypatch)
    assert result.exit_code == 0 and "warning" not in flat(result.stderr), result.stderr
    assert len(ran) == len(CELLS) - 12


def test_a_consistent_row_is_kept_and_judged_from_its_cell(tmp_path, monkeypatch):
    # A wrong_tail cell read back as "ok", every field consistent with "ok": a disagreement nobody can tell
    # from a real one, so it is kept; its verdict is the one its cell gives (False), whatever `agree` says.
    partial = interrupted_sweep(tmp_path, monkeypatch)
    rows = read_rows(partial)
    rows[WRAPS] |= {"observed": "ok", "first_bad_batch": None, "max_rel_error": 1e-7, "agree": False}
    write_rows(partial, rows)
    result, ran = resume(tmp_path, monkeypatch)
    assert result.exit_code == 1 and "1 cells disagree with the fault model" in flat(result.stderr), result.output
    assert "warning" not in flat(result.stderr) and len(ran) == len(CELLS) - 12
    assert read_rows(tmp_path / "s")[WRAPS]["agree"] is False


def test_a_symlinked_partial_file_is_not_followed_and_nothing_outside_is_written(tmp_path, monkeypatch):
    partial = interrupted_sweep(tmp_path, monkeypatch)
    elsewhere = tmp_path / "finished-sweep"
    elsewhere.mkdir()
    (elsewhere / "sweep.jsonl").write_text((partial / "sweep.jsonl").read_text())
    before = (elsewhere / "sweep.jsonl").read_bytes()
    (partial / "sweep.jsonl").unlink()
    (partial / "sweep.jsonl").symlink_to(elsewhere / "sweep.jsonl")
    (partial / "families.jsonl").symlink_to(elsewhere / "families.jsonl")  # dangling: never created
    result, ran = resume(tmp_path, monkeypatch)
    assert result.exit_code == 0, result.output
    assert (elsewhere / "sweep.jsonl").read_bytes() == before and os.listdir(elsewhere) == ["sweep.jsonl"]
    warnings = [line for line in messages(result.stderr) if line.startswith("warning:")]
    assert len(warnings) == 2 and all("is a symbolic link" in line for line in warnings)
    assert len(ran) == len(CELLS)  # what the link held is not this folder's: every cell runs
    assert not (tmp_path / "s" / "sweep.jsonl").is_symlink() and len(read_rows(tmp_path / "s")) == len(CELLS)


def test_a_symlinked_partial_folder_or_lock_is_not_followed(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (tmp_path / ".s.partial").symlink_to(elsewhere)
    result, _ = resume(tmp_path, monkeypatch)
    assert result.exit_code == 0, result.output
    assert os.listdir(elsewhere) == ["keep.txt"] and "is a symbolic link" in one_message(result.stderr, "warning")
    (tmp_path / "b").mkdir()
    partial = interrupted_sweep(tmp_path / "b", monkeypatch)
    (partial / ".lock").unlink()
    (partial / ".lock").symlink_to(elsewhere / "lock")
    result = runner.invoke(app, [*SMALL, "--out", str(tmp_path / "b" / "s")])
    assert result.exit_code == 0, result.output
    assert os.listdir(elsewhere) == ["keep.txt"]


def test_an_out_that_is_a_symbolic_link_is_refused_in_one_line(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    result = runner.invoke(app, [*SMALL, "--out", str(tmp_path / "link")])
    assert result.exit_code == 2 and one_message(result.stderr), result.output
    assert "is a symbolic link" in one_message(result.stderr) and os.listdir(tmp_path / "real") == []


def test_observation_checks_by_hand():
    cell = Cell(256, 256, 64, 4, "contiguous", "fp32")
    row = predicted_rows([cell], 16, "2.13.0")[0]  # wrong_tail from batch 1
    seen = {"observed": "wrong_tail", "first_bad_batch": 1, "max_rel_error": 1.4, "message": None}
    assert row["expected"]["first_bad_batch"] == 1 and cell.observation_problem(seen) is None
    cases = [({"first_bad_batch": 4}, "not a batch of this cell (0..3)"),
             ({"max_rel_error": float("inf")}, "not a finite number"),
             ({"max_rel_error": 1e-4}, "within the tolerance"),
             ({"observed": "ok"}, "it says ok"),
             ({"observed": "error"}, "holds values judged"),
             ({"message": 7}, "not text")]
    for change, words in cases:
        assert words in cell.observation_problem(seen | change), change
