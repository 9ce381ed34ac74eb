"""The sweep under each release's profile: every emulated cell agrees with that release's rules,
uncharacterised cells included (reported as wrong_other, not emulated), the family cells too."""

import collections

import pytest

from mpsimpact.engine.release import group_representatives
from mpsimpact.runs.cell import run_cells
from mpsimpact.runs.family_cells import FamilyCell, family_grid
from mpsimpact.runs.sweep import Cell, grid

LAYOUTS = ("contiguous", "a_transposed", "b_transposed", "both_sliced")


def sweep(release, bits, families=None, dtypes=("fp32", "fp16")):
    cells = [c for c in grid(bits, dtypes, LAYOUTS, True) if families is None or (c.m, c.k, c.n) in families]
    return list(run_cells(cells, "cpu", True, bits, False, release))


@pytest.mark.parametrize("release", ["2.4.1", "2.5.1", "2.9.1"])
def test_the_releases_that_differ_most_agree_cell_by_cell(release):
    # The study's two series ("out" 256x64x256, "in" 256x256x64) at index width 17.
    rows = sweep(release, 17, {(256, 64, 256), (256, 256, 64)}, ("fp32",))
    assert [r for r in rows if r["agree"] is False] == []
    seen = collections.Counter(r["observed"] for r in rows)
    expected = {"2.4.1": {"truncated", "wrong_other", "wrong_tail"}, "2.5.1": {"abort", "error", "wrong_all", "wrong_tail"},
                "2.9.1": {"error", "wrong_all", "wrong_tail"}}[release]
    assert expected <= set(seen), seen


@pytest.mark.slow
@pytest.mark.parametrize("release", [p.release for p in group_representatives()] + ["2.15.0"])
def test_every_release_group_agrees_on_the_whole_quick_grid(release):
    rows = sweep(release, 20)
    assert rows and [r for r in rows if r["agree"] is False] == []


def test_a_planted_off_by_one_is_caught(monkeypatch):
    # The sweep is only worth something if it can disagree: emulate 2.5.1's abort band one element
    # late, then judge the observations against the real rules.
    import mpsimpact.engine.faults as faults

    real = faults._view_fault
    monkeypatch.setattr(faults, "_view_fault", lambda name, s, limit, view_limit, prof: real(name, s, limit, view_limit + 1, prof))
    cells = [c for c in grid(17, ("fp32",), ("a_transposed",), True) if (c.m, c.k, c.n) == (256, 256, 64)]
    rows = list(run_cells(cells, "cpu", True, 17, False, "2.5.1"))
    monkeypatch.undo()
    judged = [row | {"expected": faults.classify_bmm(*cell.specs(), index_bits=17, profile="2.5.1").to_json()} for row, cell in zip(rows, cells)]
    assert [row["cell"]["batch"] for row in judged if not Cell.judge(row)] == [1]  # 65536 elements: abort, not ok


@pytest.mark.parametrize("release", [p.release for p in group_representatives()] + ["2.15.0"])
def test_every_release_groups_family_cells_agree_when_emulated(release):
    # The 16 first-pass cells at 16 bits, run under the emulator; each agrees with its trace's prediction.
    rows = list(run_cells(family_grid(16), "cpu", True, 16, False, release))
    assert len(rows) == 16 and [r["cell"]["test"] for r in rows if r["agree"] is not True] == []


def test_an_emulator_with_another_releases_family_rows_is_caught():
    # Run under 2.14.0's rows, judged against 2.13.0's: 2.13.0 wraps the 1-D sum (2.14.0 raises its 64-bit
    # error), raises on 1-D indexing (2.14.0 is wrong), dies on the scale and softmax of multi-dimensional
    # scores (2.14.0 is right), has no measured multi-dimensional sum (2.14.0 raises) and its multi-dimensional
    # cat takes int32 offsets (2.14.0 is right): six cells; the Linear, masked_fill and the others agree.
    cells = family_grid(16)
    rows = list(run_cells(cells, "cpu", True, 16, False, "2.14.0"))
    judged = [row | {"expected": cell.predict(profile="2.13.0").to_json()} for row, cell in zip(rows, cells)]
    assert [row["cell"]["test"] for row in judged if not FamilyCell.judge(row)] == [
        "reduction-1d", "indexing-1d", "scale", "softmax", "reduction", "cat"]
