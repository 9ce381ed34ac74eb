"""`mpsimpact sweep`: the emulator checked cell by cell against the fault model, a deliberately
broken emulator caught, and the real-device path."""

import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import mpsimpact.modes.emulator
from mpsimpact.cli import app
from mpsimpact.runs.family_cells import family_grid
from mpsimpact.runs.cell import observe, run_cells
from mpsimpact.runs.sweep import Cell, grid, summarize, thresholds
from said import flat

runner = CliRunner()


def test_thresholds_place_batches_around_every_limit():
    # 256x64x256 at 20 bits: per_out = 65536 -> 2**20 / 65536 = 16; views at 2**19: a per 16384 -> 32.
    sizes = thresholds(256, 64, 256, 20)
    assert {15, 16, 17, 31, 32, 33}.issubset(sizes)


@pytest.mark.ci  # a whole run, 7 to 12 s: CI runs it after the default selection (pytest -m ci)
def test_quick_emulated_sweep_covers_every_class_and_layout_and_agrees(tmp_path):
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["sweep", "--device", "cpu", "--emulate", "--index-bits", "18", "--dtypes", "fp32,fp16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["disagree"] == 0
    assert set(summary["by_class"]) == {"ok", "error", "wrong_all", "wrong_tail"}
    assert set(summary["by_layout"]) == {"contiguous", "a_transposed", "b_transposed", "both_sliced"}
    rows = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert len(rows) == summary["cells"] and all(r["agree"] for r in rows)
    assert (out / "outcome_map.png").stat().st_size > 0


def test_a_broken_emulator_is_caught(monkeypatch):
    def off_by_one_batch(x, start, stop, wrap_elements):
        # Bug on purpose: wraps one batch too late.
        if wrap_elements is None:
            return x[start:stop]
        per = x[0].numel()
        offset = (start * per) % wrap_elements + per
        return x.as_strided((stop - start, *x.shape[1:]), x.stride(), x.storage_offset() + offset)

    monkeypatch.setattr(mpsimpact.modes.emulator, "_wrapped_segment", off_by_one_batch)
    cells = [c for c in grid(18, ("fp32",), ("contiguous",), quick=True) if c.m == 256 and c.k == 256 and c.n == 64]
    rows = list(run_cells(cells, "cpu", True, 18, in_process=True))
    wrong = {r["cell"]["batch"] for r in rows if r["agree"] is False}
    predicted_tail = {r["cell"]["batch"] for r in rows if r["prediction"]["kind"] == "wrong_tail"}
    assert summarize(rows)["disagree"] > 0 and wrong == predicted_tail


def test_unknown_layout_is_refused(tmp_path):
    result = runner.invoke(app, ["sweep", "--device", "cpu", "--layouts", "diagonal", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--layouts must be one of contiguous, a_transposed, b_transposed, both_sliced; got 'diagonal'." in flat(result.output)


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
def test_real_cpu_cells_run_in_a_worker_and_are_clean():
    # The CPU without emulation is a control: every cell is expected ok, whatever MPS would do
    # (the model's MPS prediction is kept beside it). Runs through the crash-isolating worker.
    cells = [Cell(256, 64, 256, b, "a_transposed", "fp32") for b in (15, 17)]
    rows = list(run_cells(cells, "cpu", False, 20, in_process=False))
    assert [r["observed"] for r in rows] == ["ok", "ok"] and all(r["agree"] for r in rows)
    assert [r["prediction"]["kind"] for r in rows] == ["ok", "wrong_all"]


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
def test_real_cpu_family_cells_run_in_a_worker_and_a_crash_is_recorded(monkeypatch):
    # The control again, for the family cells at 16 bits: every one ok against the CPU (2.13.0's predictions
    # kept beside them: its scale aborts). Then a worker that dies on its second cell: that cell is a crash
    # with the last line the process printed, and the next cells run in a new worker.
    cells = family_grid(16)
    rows = list(run_cells(cells, "cpu", False, 16, False, "2.13.0"))
    assert [r["observed"] for r in rows] == ["ok"] * 16 and all(r["agree"] for r in rows)
    assert next(r for r in rows if r["cell"]["test"] == "scale")["prediction"]["kind"] == "abort"
    dying = str(Path(__file__).parent / "_dying_family_worker")
    monkeypatch.setenv("PYTHONPATH", dying + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = list(run_cells(cells[:3], "cpu", False, 16, False, "2.13.0"))
    assert [r["observed"] for r in rows] == ["ok", "crash", "ok"]
    assert rows[1]["message"] == "exit code -6: planted abort in elementwise-1d" and rows[1]["agree"] is False


@pytest.mark.mps
def test_real_mps_agrees_with_the_model_at_full_scale():
    cells = [Cell(256, 256, 64, 131073, "contiguous", "fp32"), Cell(128, 64, 512, 65536, "b_transposed", "fp32")]
    rows = list(run_cells(cells, "mps", False, 32, in_process=False))
    assert all(r["agree"] for r in rows), rows


@pytest.mark.cuda
def test_cuda_is_clean_at_full_scale():
    rows = [observe(Cell(256, 64, 256, 65537, "a_transposed", "fp16"), "cuda", False, 32)]
    assert rows[0]["observed"] == "ok"


@pytest.mark.parametrize("test", ["scale", "softmax", "linear", "sdpa", "masked_fill"])
def test_a_cell_judged_row_by_row_sees_one_wrong_row_and_agrees_with_the_whole(test, monkeypatch):
    # The ops acting on each row alone are judged a block of rows at a time (half the memory on a Mac): with
    # blocks of one row (CHUNK_ELEMENTS shrunk), a right output is ok with the error the whole comparison
    # gives, and one wrong last row is caught.
    import torch

    from mpsimpact.runs import family_cells
    from mpsimpact.runs.family_cells import FamilyCell, _judge, make_inputs, relative_error

    cell = FamilyCell(test, 18)
    inputs = make_inputs(cell, "cpu", torch.Generator().manual_seed(0))
    out = cell.spec.run(inputs, "cpu", 18)
    widest = max([out[0].numel(), *(inputs[name][0].numel() for name in cell.spec.rows_of)])
    monkeypatch.setattr(family_cells, "CHUNK_ELEMENTS", widest)
    assert cell.block_rows(inputs, out) == 1 and out.shape[0] >= 3  # a block per row
    whole = relative_error(out, cell.spec.run(inputs, "cpu", 18))
    observed, rel = _judge(cell, inputs, out)
    assert observed == "ok" and rel == pytest.approx(whole, abs=1e-5)  # a product's rows may round differently
    bad = out.clone()
    bad[-1] = bad[-1] + 1 if bad.dtype != torch.bool else ~bad[-1]
    observed, rel = _judge(cell, inputs, bad)
    assert observed == "wrong" and rel > 1e-2


def test_a_cell_whose_bad_values_are_mostly_zero_is_truncated(monkeypatch):
    # The study's criterion: at least 90% of the wrong elements of the bad batches exactly 0. A device
    # that zeroes batches 5.. (and makes one element of batch 4 wrong but not 0: 1 of 193 wrong elements)
    # is "truncated"; one that negates batches 4.. is a wrong tail.
    real = torch.bmm

    def zero_tail(out):
        out[5:] = 0
        out[4, 0, 0] += 1

    def negate_tail(out):
        out[4:] *= -1

    cell = Cell(8, 8, 8, 8, "contiguous", "fp32")
    for damage, kind in ((zero_tail, "truncated"), (negate_tail, "wrong_tail")):
        def bmm(a, b):
            out = real(a, b)
            if a.dtype == torch.float32:  # the cell's call, not the float64 reference
                damage(out)
            return out

        monkeypatch.setattr(torch, "bmm", bmm)
        row = observe(cell, "cpu", False, 20)
        monkeypatch.undo()
        assert (row["observed"], row["first_bad_batch"]) == (kind, 4), row
