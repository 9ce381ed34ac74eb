"""A sweep a Mac can finish: cells over --max-memory are not run and stay unmeasured (they agree with
nothing and decide nothing in profile.json); a killed sweep resumes where it stopped without redoing a
finished cell; progress lines say the time left; each bad input is one line, exit 2, nothing left."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import mpsimpact.runs.sweep as sweep_module
from mpsimpact.cli import app
from mpsimpact.runs.profile_fit import derive_profile
from mpsimpact.runs.sweep import Cell, grid, is_measured

runner = CliRunner()
# 30 small cells: the 16-bit quick grid, fp32, contiguous operands (a few seconds on 2 cores).
SMALL = ["sweep", "--device", "cpu", "--emulate", "--torch-profile", "2.13.0", "--index-bits", "16",
         "--dtypes", "fp32", "--layouts", "contiguous"]
CELLS = grid(16, ("fp32",), ("contiguous",), True)
MIB = 1 << 20


def rows_of(folder):
    return [json.loads(line) for line in (folder / "sweep.jsonl").read_text().splitlines()]


def test_a_cell_over_max_memory_is_not_run_and_reported_unmeasured(tmp_path):
    budget = 3 * MIB  # cells of 256x256x64 from batch 5, 128x64x512 from 7, ... need more
    over = {(c.m, c.k, c.n, c.batch) for c in CELLS if c.bytes_needed() > budget}
    assert 0 < len(over) < len(CELLS)
    out = tmp_path / "s"
    result = runner.invoke(app, [*SMALL, "--max-memory", "3MiB", "--out", str(out)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"{len(over)} cells need more than the 0.00293 GiB budget (--max-memory) and are not run" in said
    assert f"{len(over)} not run (over --max-memory: unmeasured)" in said
    rows = rows_of(out)
    skipped = [r for r in rows if not is_measured(r)]
    assert {(r["cell"]["m"], r["cell"]["k"], r["cell"]["n"], r["cell"]["batch"]) for r in skipped} == over
    assert all(r["agree"] is None and "not run, unmeasured" in r["message"] for r in skipped)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["not_run"] == len(over) and summary["disagree"] == 0
    # profile.json derives nothing from them: the same as from the measured rows alone.
    profile = json.loads((out / "profile.json").read_text())
    alone = derive_profile([r for r in rows if is_measured(r)], device="cpu", emulated=True,
                           emulated_release="2.13.0", torch_version=rows[0]["torch"], machine="m",
                           index_bits=16)
    assert profile["rules"] == alone["rules"] and profile["cells"]["not_run"] == len(over)
    assert profile["cells"]["measured"] == len(CELLS) - len(over)


def test_the_memory_and_time_of_each_cell_are_known_before_it_runs():
    # 256x256x64 at batch 65537 in fp16: operands 65537 * 65536 + 65537 * 16384 elements and an output
    # of 65537 * 16384, 2 bytes each; the fp32 draws go a chunk of 2**24 elements at a time.
    cell = Cell(256, 256, 64, 65537, "contiguous", "fp16")
    assert cell.bytes_needed() == (65537 * 65536 + 2 * 65537 * 16384) * 2 + (1 << 24) * 4
    assert cell.estimated_seconds("mps") < cell.estimated_seconds("cpu")
    clock = sweep_module.CellClock([cell, cell], "cpu")
    clock.finished(2 * clock.estimates[0])  # the first cell took twice its estimate
    assert clock.seconds_left() == pytest.approx(2 * clock.estimates[1])


KILLED_RUN = """
import sys, time
import mpsimpact.runs.sweep as sweep
real = sweep.observe
def slow(*args, **kwargs):
    time.sleep(0.3)
    return real(*args, **kwargs)
sweep.observe = slow
from mpsimpact.cli import app
app(sys.argv[1:], prog_name="mpsimpact")
"""


def test_a_killed_sweep_resumes_without_redoing_finished_cells(tmp_path, monkeypatch):
    out = tmp_path / "s"
    partial = tmp_path / ".s.partial"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, *SMALL, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        log = partial / "sweep.jsonl"
        if log.exists() and log.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = rows_of(partial)
    assert 3 <= len(finished) < len(CELLS) and not out.exists()
    ran = []
    real = sweep_module.observe
    monkeypatch.setattr(sweep_module, "observe",
                        lambda cell, *a, **k: ran.append(cell) or real(cell, *a, **k))
    result = runner.invoke(app, [*SMALL, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"{len(finished)} done by an earlier run (resumed)" in " ".join(result.output.split())
    assert len(ran) == len(CELLS) - len(finished)
    assert {(c.m, c.k, c.n, c.batch) for c in ran}.isdisjoint(
        {(r["cell"]["m"], r["cell"]["k"], r["cell"]["n"], r["cell"]["batch"]) for r in finished})
    rows = rows_of(out)
    assert [r["cell"] for r in rows] == [c.to_json() for c in CELLS]  # each cell once, in grid order
    assert all(row in rows for row in finished) and not partial.exists()
    assert sorted(p.name for p in out.iterdir()) == ["outcome_map.png", "profile.json", "summary.json",
                                                     "sweep.jsonl"]
    assert json.loads((out / "summary.json").read_text())["resumed_cells"] == len(finished)


def test_a_half_written_last_line_is_dropped_and_an_interruption_keeps_what_finished(tmp_path):
    from mpsimpact.output.files import resumable_folder

    out, partial, identity = tmp_path / "out", tmp_path / ".out.partial", {"work": 1}
    with pytest.raises(KeyboardInterrupt), resumable_folder(out, identity, "items.jsonl"):
        raise KeyboardInterrupt  # nothing finished: nothing is left behind
    assert not partial.exists()
    with pytest.raises(KeyboardInterrupt), resumable_folder(out, identity, "items.jsonl") as folder:
        folder.append({"n": 1})
        folder.append({"n": 2})
        raise KeyboardInterrupt
    with open(partial / "items.jsonl", "a") as fh:
        fh.write('{"n": 3')  # a kill in the middle of a line
    with resumable_folder(out, identity, "items.jsonl") as folder:
        assert (folder.items, folder.resumed) == ([{"n": 1}, {"n": 2}], 2)
        folder.append({"n": 3})
    assert (out / "items.jsonl").read_text().splitlines() == ['{"n": 1}', '{"n": 2}', '{"n": 3}']
    assert not partial.exists() and os.listdir(out) == ["items.jsonl"]


def test_another_sweeps_unfinished_folder_and_a_held_lock_are_refused(tmp_path):
    partial = tmp_path / ".s.partial"
    partial.mkdir()
    (partial / "identity.json").write_text(json.dumps({"index_bits": 17}))
    result = runner.invoke(app, [*SMALL, "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "index_bits 17 there, 16 now" in result.stderr and (partial / "identity.json").exists()
    (partial / "identity.json").unlink()
    with open(partial / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = runner.invoke(app, [*SMALL, "--out", str(tmp_path / "s")])
    assert result.exit_code == 2 and "Another mpsimpact process is writing" in result.stderr
    assert not (tmp_path / "s").exists()


def test_progress_lines_say_the_time_left_without_a_terminal(tmp_path):
    result = runner.invoke(app, [*SMALL, "--out", str(tmp_path / "s")])  # CliRunner's output is no TTY
    assert result.exit_code == 0
    lines = [line for line in result.output.splitlines() if line.startswith(f"[{len(CELLS)}/{len(CELLS)}]")]
    assert lines and "left" in " ".join(result.output.split())
    assert "To run: 30 cells, the largest holding" in " ".join(result.output.split())


@pytest.mark.parametrize("value", ["0", "-2", "lots", "3TB", "1.5 GiB x"])
def test_a_bad_max_memory_is_one_line_and_exit_2(tmp_path, value):
    result = runner.invoke(app, [*SMALL, "--max-memory", value, "--out", str(tmp_path / "s")])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: --max-memory: '{value}' is not a size above 0; give a size such as 20 "
                             "(GiB), 20GiB or 512MiB.\n")
    assert not list(tmp_path.iterdir())


def test_max_memory_sizes():
    from mpsimpact.config import memory_bytes

    assert [memory_bytes(t) for t in ("20", "20GiB", "1.5 g", "512MiB", "3M")] == [
        20 << 30, 20 << 30, 3 << 29, 512 << 20, 3 << 20]
