"""A sweep on a Mac's own memory (issue #45): a cell whose allocation the device refuses ("Invalid buffer
size", "MPS backend out of memory") did not fit and measured nothing, so it is not run, never the op's fault,
and leaves what it decides unmeasured in profile.json; a cell one of whose tensors reaches the Mac's largest
buffer is not run at all."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

import mpsimpact.engine.mac_memory as mac_memory
import mpsimpact.runs.sweep as sweep_module
from mpsimpact.cli import app
from mpsimpact.config import SweepConfig
from mpsimpact.engine.mac_memory import MEASURED, MacMemory
from mpsimpact.engine.release import INT_MAX_MESSAGE
from mpsimpact.runs import family_cells
from mpsimpact.runs.cell import NOT_RUN, is_allocation_failure, not_run_counts, run_cells
from mpsimpact.runs.family_cells import FamilyCell, family_grid
from mpsimpact.runs.profile_fit import derive_profile
from mpsimpact.runs.sweep import grid
from mpsimpact.runs.sweep_run import mac_buffer

REFUSED = "Invalid buffer size: 8.19 GB"  # MPSAllocator's text on a 16 GB Mac (pytorch#78042 has 9.75 GB)
OUT_OF_MEMORY = ("MPS backend out of memory (MPS allocated: 9.05 GB, other allocations: 3.56 GB, max "
                 "allowed: 18.13 GB). Tried to allocate 8.19 GB on private pool.")
# The 16-bit quick grid's 256x64x256 series, fp32, contiguous: 8 cells (a second in all, emulated as 2.13.0).
CELLS = [c for c in grid(16, ("fp32",), ("contiguous",), True) if (c.m, c.k, c.n) == (256, 64, 256)]
CHOSEN = CELLS[3]


def bmm_rows(monkeypatch, where, text, release="2.13.0"):
    """The series emulated as `release`, in this process, with the chosen cell raising RuntimeError(`text`)
    `where` it allocates: "operands" (making them) or "output" (the bmm itself)."""
    def refuse(batch):
        if batch == CHOSEN.batch:
            raise RuntimeError(text)

    if where == "operands":
        make = sweep_module.make_operands
        monkeypatch.setattr(sweep_module, "make_operands",
                            lambda cell, *args: refuse(cell.batch) or make(cell, *args))
    else:
        real = torch.bmm

        def bmm(a, b):
            if a.dtype == torch.float32:  # the cell's call, not the float64 reference
                refuse(a.shape[0])
            return real(a, b)

        monkeypatch.setattr(torch, "bmm", bmm)
    rows = list(run_cells(CELLS, "cpu", True, 16, True, release))
    monkeypatch.undo()
    return rows


def test_the_predicate_knows_mps_refusals_and_nothing_else():
    assert is_allocation_failure(RuntimeError(REFUSED)) and is_allocation_failure(RuntimeError(OUT_OF_MEMORY))
    assert is_allocation_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_allocation_failure(RuntimeError(INT_MAX_MESSAGE))
    assert not is_allocation_failure(ValueError(REFUSED))  # not what torch raises


@pytest.mark.parametrize("where, text", [("operands", REFUSED), ("output", REFUSED),
                                         ("output", OUT_OF_MEMORY)])
def test_a_bmm_cell_whose_allocation_is_refused_is_not_run_not_an_error(monkeypatch, where, text):
    rows = bmm_rows(monkeypatch, where, text)
    row = next(r for r in rows if r["cell"]["batch"] == CHOSEN.batch)
    assert (row["observed"], row["agree"], row["first_bad_batch"]) == (NOT_RUN, None, None)
    assert row["message"] == f"allocation refused: {text}; not run, unmeasured"
    assert not_run_counts(rows) == {"allocation refused by the device": 1}
    assert all(r["agree"] for r in rows if r is not row)


def test_a_bmm_cell_that_raises_another_error_is_the_ops_error(monkeypatch):
    # The control: the same raise with MPS's INT_MAX text is what the op did ("error"), judged as such.
    rows = bmm_rows(monkeypatch, "output", INT_MAX_MESSAGE)
    row = next(r for r in rows if r["cell"]["batch"] == CHOSEN.batch)
    assert (row["observed"], row["message"]) == ("error", INT_MAX_MESSAGE)


def family_rows(monkeypatch, test, text, release="2.13.0"):
    """The family cell `test` at 16 bits, emulated as `release`, whose op raises RuntimeError(`text`) on a
    real tensor (its trace on meta tensors, the prediction, is left alone)."""
    spec = family_cells.TESTS_BY_NAME[test]

    def run(x, device, bits):
        if device != "meta":
            raise RuntimeError(text)
        return spec.run(x, device, bits)

    monkeypatch.setitem(family_cells.TESTS_BY_NAME, test, dataclasses.replace(spec, run=run))
    rows = list(run_cells([FamilyCell(test, 16)], "cpu", True, 16, True, release))
    monkeypatch.undo()
    return rows


def derived(bmm, families):
    return derive_profile(bmm, device="cpu", emulated=True, emulated_release="2.13.0", torch_version="2.13.0",
                          machine="m", index_bits=16, family_rows=families)


def test_a_family_cell_whose_allocation_is_refused_is_not_run_and_its_rule_stays_unmeasured(monkeypatch):
    # 1-D indexing past LIMIT: 2.13.0 raises the INT_MAX error. Refused, the row decides nothing; the same
    # cell raising the INT_MAX text decides "error" (the control: the test can fail).
    refused = family_rows(monkeypatch, "indexing-1d", REFUSED)
    assert (refused[0]["observed"], refused[0]["agree"]) == (NOT_RUN, None)
    assert refused[0]["message"] == f"allocation refused: {REFUSED}; not run, unmeasured"
    control = family_rows(monkeypatch, "indexing-1d", INT_MAX_MESSAGE)
    assert (control[0]["observed"], control[0]["agree"]) == ("error", True)
    undecided, decided = derived([], refused), derived([], control)
    assert decided["rules"]["families"]["indexing"] == ["error", "unmeasured"]
    assert undecided["rules"]["families"] is None and "families" in undecided["unmeasured"]
    assert undecided["cells"]["family_cells_not_run"] == 1
    assert "Family cells not run (allocation refused by the device): indexing-1d (indexing, 1-D)" in " ".join(
        undecided["notes"])


def test_a_bmm_cell_whose_allocation_is_refused_decides_nothing(monkeypatch):
    # 2.13.0 computes this series right at 16 bits: 32 settings of the bmm rules agree with it. The refused
    # cell drops out of the fit exactly as a cell over --max-memory does; the same cell raising MPS's INT_MAX
    # text is measured, and no setting explains an error there (the control: were it the op's, it decides).
    refused = bmm_rows(monkeypatch, "output", REFUSED)
    control = bmm_rows(monkeypatch, "output", INT_MAX_MESSAGE)
    budget_row = {"observed": NOT_RUN, "agree": None,
                  "message": "needs 9 GiB, more than the 8 GiB budget (--max-memory): not run, unmeasured"}
    over_budget = [r | budget_row if r["cell"]["batch"] == CHOSEN.batch else r for r in refused]
    undecided, decided = derived(refused, []), derived(control, [])
    assert undecided["rules"]["bmm"] == derived(over_budget, [])["rules"]["bmm"]
    assert undecided["cells"]["settings_agreeing"] == 32 and "bmm" not in undecided["unmeasured"]
    assert (undecided["cells"]["not_run"], undecided["cells"]["measured"]) == (1, len(CELLS) - 1)
    assert "1 of 8 cells were not run (allocation refused by the device)" in " ".join(undecided["notes"])
    assert decided["rules"]["bmm"] is None and decided["cells"]["unexplained"] == [
        f"256x64x256 batch {CHOSEN.batch} contiguous fp32: observed error"]
    # every cell refused: bmm unmeasured, and no word of cells no setting explains (none was measured)
    nothing = derived([r | {"observed": NOT_RUN, "message": f"allocation refused: {REFUSED}", "agree": None}
                       for r in refused], [])
    assert nothing["rules"]["bmm"] is None and "bmm" in nothing["unmeasured"]
    assert nothing["cells"]["measured"] == 0 and nothing["cells"]["unexplained"] == []
    assert not any(note.startswith("No setting of the bmm rules") for note in nothing["notes"])


# A Mac measured by `doctor` (injected: there is no Mac here) whose largest buffer is 1 MiB: at 16 bits the
# series' output, batch x 256 x 256 fp32 (256 KiB a batch), reaches it from batch 4 on (4 x 256 KiB = 1 MiB).
SMALL_MAC = MacMemory(None, 1 << 20, 3 << 20, MEASURED, "injected")


def test_on_mps_the_sweep_plans_within_this_macs_own_buffer_and_elsewhere_within_none(monkeypatch):
    monkeypatch.setattr(mac_memory, "this_mac", lambda cache: SMALL_MAC)
    assert mac_buffer(SweepConfig(index_bits=16), "mps") == (SMALL_MAC, 1 << 20)  # real bytes at any width
    assert mac_buffer(SweepConfig(index_bits=16), "cpu") == (None, None)
    # --memory: an emulated Mac, its buffer scaled to the width as every limit is: 8 GiB >> (32 - 16), 128 KiB
    assert mac_buffer(SweepConfig(index_bits=16, memory="16GB"), "cpu") == (MacMemory.of_size(16), 1 << 17)


@pytest.mark.parametrize("in_process", [True, False])
def test_a_cell_whose_tensor_reaches_the_largest_buffer_is_not_run(in_process):
    # In this process, and through the crash-isolating worker a real Mac uses (unemulated: the CPU control).
    rows = list(run_cells(CELLS[:6], "cpu", False, 16, in_process, "2.13.0", buffer=SMALL_MAC.largest_buffer))
    assert [r["cell"]["batch"] for r in rows] == [1, 2, 3, 4, 5, 7]
    assert [r["observed"] for r in rows] == ["ok"] * 3 + [NOT_RUN] * 3
    assert rows[3]["message"] == ("a tensor of 0.000977 GiB reaches the Mac's largest buffer, 0.000977 GiB "
                                  "(MPS: 'Invalid buffer size: 1024.00 KB'): not run, unmeasured")
    assert not_run_counts(rows) == {"reaching the largest buffer": 3}
    unbounded = run_cells(CELLS[:6], "cpu", False, 16, True, "2.13.0")  # no Mac: every cell runs
    assert [r["cell"]["batch"] for r in unbounded if r["observed"] == NOT_RUN] == []


def test_sweep_memory_skips_the_cells_that_mac_cannot_allocate_and_says_so(tmp_path):
    # A 192 GB Mac at 16 bits: 96 GiB >> 16 = 1.5 MiB. The cells over it are counted before the sweep starts,
    # not run, counted again in the summary; the others run and agree; profile.json says why.
    buffer = 96 * 2**30 >> 16
    cells = grid(16, ("fp32",), ("contiguous",), True)
    over = [c for c in cells if c.largest_tensor_bytes() >= buffer]
    over_families = [c.test for c in family_grid(16) if c.largest_tensor_bytes() >= buffer]
    assert 0 < len(over) < len(cells)
    out = tmp_path / "s"
    result = CliRunner().invoke(app, ["sweep", "--device", "cpu", "--emulate", "--torch-profile", "2.13.0",
                                      "--index-bits", "16", "--dtypes", "fp32", "--layouts", "contiguous",
                                      "--memory", "192GB", "--out", str(out)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    words = ("a 192 GB Mac's largest buffer 96.0 GiB (assumed: half of 192 GB unified memory), 0.00146 GiB "
             "at this index width")
    skipped = len(over) + len(over_families)
    assert f"{skipped} cells hold a tensor that reaches {words}: MPS refuses it" in said
    assert "0 cells need more than the" in said
    assert f"30 bmm cells, every cell agrees, {len(over)} not run (reaching the largest buffer: unmeasured)" \
        in said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["largest_buffer"] == {"bytes": buffer, "words": words}
    assert summary["not_run_why"] == {"reaching the largest buffer": len(over)}
    assert summary["families"]["not_run"] == len(over_families) and summary["disagree"] == 0
    profile = json.loads((out / "profile.json").read_text())
    assert f"{len(over)} of 30 cells were not run (reaching the largest buffer)" in " ".join(profile["notes"])


@pytest.mark.parametrize("value, message", [
    ("16XB", "--memory: '16XB' is not a Mac's unified memory"),
    ("auto", "--memory auto reads this Mac's own memory and needs a Mac")])
def test_sweep_refuses_a_memory_that_is_no_size_or_auto_off_a_mac(tmp_path, value, message):
    if value == "auto" and torch.backends.mps.is_available():
        pytest.skip("this is a Mac: auto reads its memory")
    argv = ["sweep", "--device", "cpu", "--memory", value, "--out", str(tmp_path / "x")]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert list(tmp_path.iterdir()) == []  # no folder claimed
