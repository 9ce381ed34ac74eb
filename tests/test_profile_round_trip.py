"""The round trip of issue 23: a sweep under a release writes profile.json; a second sweep with
`--torch-profile <that file>` agrees on every cell with the same predictions; a run gives the same corrupted
texts with the file as with the release name; compare of the two sweeps finds nothing changed."""

import json

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.runs.family_cells import family_grid
from mpsimpact.runs.profile_fit import derive_profile
from mpsimpact.runs.cell import predicted_rows
from mpsimpact.runs.sweep import LAYOUTS, grid

runner = CliRunner()


def sweep(out, profile, bits, *extra):
    args = ["sweep", "--device", "cpu", "--emulate", "--torch-profile", str(profile),
            "--index-bits", str(bits), *extra, "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]


def decisions(rows):
    return [(r["cell"], r["prediction"]["kind"], r["prediction"]["first_bad_batch"],
             r["prediction"]["message"], r["observed"]) for r in rows]


def family_decisions(folder):
    """Each family cell's prediction and observation (rules aside: a file's release names no rule source)."""
    rows = [json.loads(line) for line in (folder / "families.jsonl").read_text().splitlines()]
    assert rows and all(row["agree"] for row in rows)
    return [(r["cell"]["test"], r["prediction"]["kind"], r["prediction"]["message"], r["observed"]) for r in rows]


def corrupted_texts(folder):
    samples = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line]
    return sorted(s["position"] for s in samples if s.get("corrupted"))


@pytest.mark.parametrize("release", ["2.5.1", "2.13.0"])
def test_the_rules_round_trip_through_a_profile_file_on_the_whole_quick_grid(tmp_path, release):
    # No tensors: the rows the rules predict at 20 bits, their profile, then the same grid under that file.
    cells = grid(20, ("fp32", "fp16", "bf16"), LAYOUTS, True)
    content = derive_profile(predicted_rows(cells, 20, release), device="cpu", emulated=True,
                             emulated_release=release, torch_version="2.13.0", machine="m", index_bits=20)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(content))
    again = predicted_rows(cells, 20, str(path))
    assert all(row["agree"] for row in again)
    assert [(r["prediction"]["kind"], r["prediction"]["first_bad_batch"], r["prediction"]["message"])
            for r in again] == [(r["prediction"]["kind"], r["prediction"]["first_bad_batch"],
                                 r["prediction"]["message"]) for r in predicted_rows(cells, 20, release)]
    # The family cells too, once their rows are in the profile: the same prediction for each, by the file.
    families = family_grid(20)
    content = derive_profile(predicted_rows(cells, 20, release), device="cpu", emulated=True,
                             emulated_release=release, torch_version="2.13.0", machine="m", index_bits=20,
                             family_rows=predicted_rows(families, 20, release))
    path.write_text(json.dumps(content))
    assert content["unmeasured"] == []
    by_file, by_name = predicted_rows(families, 20, str(path)), predicted_rows(families, 20, release)
    assert all(row["agree"] for row in by_file)
    assert [(r["observed"], r["prediction"]["kind"], r["prediction"]["message"]) for r in by_file] == [
        (r["observed"], r["prediction"]["kind"], r["prediction"]["message"]) for r in by_name]


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
@pytest.mark.parametrize("release", ["2.5.1", "2.13.0"])
def test_a_sweep_writes_a_profile_that_a_second_sweep_agrees_with_on_every_cell(tmp_path, release):
    # 16 bits, fp32, every layout: 120 cells of each sweep, emulated on the CPU.
    first = sweep(tmp_path / "first", release, 16, "--dtypes", "fp32")
    profile = tmp_path / "first" / "profile.json"
    content = json.loads(profile.read_text())
    assert content["release"] == release and content["cells"]["settings_agreeing"] == 1
    second = sweep(tmp_path / "second", profile, 16, "--dtypes", "fp32")
    assert all(row["agree"] for row in second) and decisions(second) == decisions(first)
    assert family_decisions(tmp_path / "second") == family_decisions(tmp_path / "first")
    assert content["unmeasured"] == [] and content["cells"]["family_cells"] == 16
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["disagree"] == 0 and summary["profile"]["source"] == str(profile)
    result = runner.invoke(app, ["compare", str(tmp_path / "first"), str(tmp_path / "second")])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"profile {release}: still wraps P V" in said and "op-family rows as before" in said


@pytest.mark.parametrize("release", ["2.5.1", "2.13.0"])
def test_a_run_corrupts_the_same_texts_with_the_file_as_with_the_release_name(tmp_path, release):
    # The release's rules and a profile derived from them at 20 bits, bmm and family cells. At 23 bits the
    # (16, 12, 256, 256) scores hold 12582912 > 2**23 elements (multi-dimensional): 2.5.1 scales them and
    # takes their softmax right, and P V wraps from text 2**23 // (256 * 256) // 12 = 10 (texts 10..15);
    # 2.13.0's scale of those scores aborts (inferred: int32-kernel), so both runs stop the same way.
    content = derive_profile(predicted_rows(grid(20, ("fp32",), LAYOUTS, True), 20, release), device="cpu",
                             emulated=True, emulated_release=release, torch_version="2.13.0", machine="m",
                             index_bits=20, family_rows=predicted_rows(family_grid(20), 20, release))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(content))
    outcomes = {}
    for name, profile in (("release", release), ("file", str(path))):
        out = tmp_path / name
        result = runner.invoke(app, ["run", "sentiment", "--batch-size", "16", "--max-length", "256",
                                     "--index-bits", "23", "--device", "cpu", "--guard", "off", "--seed", "0",
                                     "--torch-profile", profile, "--out", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads((out / "report.json").read_text())
        assert report["geometry"]["profile"] == profile
        stops = [(c["guard"], c["status"], c.get("message")) for c in report["conditions"]]
        outcomes[name] = (corrupted_texts(out), report["prediction"]["outcome"], stops)
    texts, outcome, stops = outcomes["file"]
    if release == "2.5.1":
        assert (texts, outcome, stops) == (list(range(10, 16)), "wrong", [("off", "completed", None)])
    else:
        assert (texts, outcome, stops[0][1]) == ([], "abort", "error") and "SIGSEGV" in stops[0][2]
    assert outcomes["release"] == outcomes["file"]


@pytest.mark.slow
@pytest.mark.parametrize("release", ["2.5.1", "2.13.0"])
def test_the_issues_round_trip_at_20_bits_quick(tmp_path, release):
    first = sweep(tmp_path / "first", release, 20, "--quick")
    second = sweep(tmp_path / "second", tmp_path / "first" / "profile.json", 20, "--quick")
    assert all(row["agree"] for row in second) and decisions(second) == decisions(first)
    assert family_decisions(tmp_path / "second") == family_decisions(tmp_path / "first")
