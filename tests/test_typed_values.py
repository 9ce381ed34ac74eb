"""What each command concludes is one typed value, written and read by the same class (issue 57): the files of run
(every kind), plan, check and sweep read back through their classes write the same bytes; run's prediction block
speaks plan's and check's vocabulary; a class's reader refuses what its writer would never write."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpsimpact.bounds import parse_json
from mpsimpact.cli import app
from mpsimpact.output.record import ABSENT, Damaged, Record
from mpsimpact.prediction.check import CheckReport
from mpsimpact.prediction.plan import PlanReport
from mpsimpact.runs.run_report import RunReport

runner = CliRunner()
DATA = Path(__file__).parent / "data"
PROFILE = ["--torch-profile", "2.14.0"]


def written_again(path, typed):
    """The file at `path` read through the typed value and written as its writer writes it."""
    return json.dumps(typed.from_json(parse_json(path.read_text(), allow_nan=True)).to_json(), indent=2) + "\n"


@pytest.fixture(scope="module")
def plan_and_check(tmp_path_factory):
    root = tmp_path_factory.mktemp("typed")
    for args in (["plan", "sentiment", *PROFILE, "--out", str(root / "plan")],
                 ["check", str(DATA / "bert-base"), *PROFILE, "--seq-len", "512", "--out", str(root / "check")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    return root


def test_plan_and_check_json_read_back_write_the_same_bytes(plan_and_check):
    for path, typed in ((plan_and_check / "plan" / "plan.json", PlanReport),
                        (plan_and_check / "check" / "check.json", CheckReport)):
        assert written_again(path, typed) == path.read_text()


def test_runs_prediction_block_has_plans_and_checks_keys_and_its_guard_advice(plan_and_check, tmp_path):
    result = runner.invoke(app, ["run", "sentiment", "--quick", *PROFILE, "--guard", "off", "--out",
                                 str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    run = json.loads((tmp_path / "run" / "report.json").read_text())
    plan = json.loads((plan_and_check / "plan" / "plan.json").read_text())
    check = json.loads((plan_and_check / "check" / "check.json").read_text())
    assert plan["prediction"].keys() == check["prediction"].keys() <= run["prediction"].keys()
    assert list(run["prediction"])[:9] == ["outcome", "first_corrupted_text", "first_corrupted_head",  # schema 1's
                                           "corrupted_count", "corrupted_fraction", "uncharacterised_faults",
                                           "unmeasured_faults", "stops", "silent_faults"]
    p = run["prediction"]  # one prediction, in both vocabularies: the same numbers
    assert (p["first_wrong_sample"], p["wrong_samples"], p["wrong_fraction"]) == (
        p["first_corrupted_text"], p["corrupted_count"], p["corrupted_fraction"]) == (10, 6, 6 / 16)
    assert run["guard_advice"] and run["guard_advice"][0].startswith("guard 'chunk'")
    assert {"guard_advice"} <= plan.keys() & check.keys()
    assert written_again(tmp_path / "run" / "report.json", RunReport) == (tmp_path / "run" / "report.json").read_text()


@pytest.mark.ci  # two whole runs (retrieval, finetune): CI runs them after the default selection
@pytest.mark.parametrize("scenario", ["retrieval", "finetune"])
def test_every_kinds_report_reads_back_as_the_same_bytes(tmp_path, scenario):
    result = runner.invoke(app, ["run", scenario, "--quick", *PROFILE, "--out", str(tmp_path / scenario)])
    assert result.exit_code == 0, result.output
    path = tmp_path / scenario / "report.json"
    assert written_again(path, RunReport) == path.read_text()


def test_a_writer_cannot_write_what_its_reader_refuses():
    # RunReport.of reads what a writer made as a reader would: fields that disagree are a bug, raised at once.
    geometry = {"device": "cpu", "batch_size": 16, "max_length": 64}
    made = {"schema_version": 2, "config": {"scenario": "sentiment", "batch_size": 16}, "geometry": geometry,
            "conditions": [{"guard": "off", "status": "completed", "corrupted_count": 6, "corrupted_fraction": 0.5,
                            "first_corrupted_index": 10}]}
    with pytest.raises(Damaged, match="corrupted_fraction is 0.5, not corrupted_count / batch = 6/16"):
        RunReport.of(made)
    made["conditions"][0]["corrupted_fraction"] = 6 / 16
    assert RunReport.of(made)["conditions"][0]["first_corrupted_index"] == 10


def test_a_record_keeps_the_files_order_and_the_keys_it_does_not_know():
    import dataclasses

    @dataclasses.dataclass(frozen=True, eq=False)
    class Small(Record):
        name: str
        count: int = ABSENT

    data = {"later": [1, {"x": None}], "count": 3, "name": "a"}
    small = Small.from_json(data)
    assert list(small.to_json()) == ["later", "count", "name"] and small.to_json() == data
    assert small["later"] == [1, {"x": None}] and "missing" not in small and small.get("missing") is None
    assert list(Small(name="b").to_json()) == ["name"]  # made, not read: the fields it holds, declared order
