"""A release is judged once per command, at its edge, and travels down as a value (counted by patching every
binding of the string-to-profile turns, not by reading the code); plan and check take their prediction from one
PredictionSection (run's, with the runner's one prediction per attention: tests/test_run.py). Tiny models."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import mpsimpact.modes.guard  # noqa: F401 (every module that binds a counted name is imported before the
import mpsimpact.prediction.demo_size  # noqa: F401  patches: one imported under them would keep the stand-in)
import mpsimpact.prediction.version_table  # noqa: F401
import mpsimpact.runs.environment  # noqa: F401
import mpsimpact.runs.train_kind  # noqa: F401
from mpsimpact.config import CheckConfig, MatrixConfig, PlanConfig, RunConfig, SweepConfig
from mpsimpact.engine import release
from mpsimpact.errors import UsageError
from mpsimpact.prediction import check, outcome, plan
from mpsimpact.runs import runner, scenario, sweep_run  # noqa: F401
from tiny import tiny_bert_config

SRC = Path(__file__).parent.parent / "src" / "mpsimpact"


@pytest.fixture
def counted(monkeypatch):
    """Every call of resolve_profile, installed_profile and outcome.predict (its plan), wherever bound: in their
    modules and in each mpsimpact module that imported them by name; and every PredictionSection made."""
    calls = {"resolve_profile": [], "installed_profile": [], "predict": [], "sections": []}

    def counting(name, real):
        def call(*args, **kwargs):
            calls[name].append(args[0] if args else None)
            return real(*args, **kwargs)
        return call

    class Section(outcome.PredictionSection):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            calls["sections"].append(self)

    patches = {"resolve_profile": release.resolve_profile, "installed_profile": release.installed_profile,
               "predict": outcome.predict, "PredictionSection": outcome.PredictionSection}
    stand_ins = {name: Section if name == "PredictionSection" else counting(name, real)
                 for name, real in patches.items()}
    for module in [m for name, m in sys.modules.items() if name.startswith("mpsimpact")]:
        for name, real in patches.items():
            if getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, stand_ins[name])
    return calls


@pytest.fixture
def tiny(tmp_path):
    """A folder with a tiny BERT's config (2 layers, 4 heads): what plan and check trace."""
    tiny_bert_config(num_labels=3).to_json_file(tmp_path / "config.json")
    return tmp_path


def plan_tiny(folder):
    return plan.build_plan_report(PlanConfig("sentiment", model=str(folder), batch_size=2, max_length=16,
                                             torch_profile="2.14.0"), scenario.get_scenario("sentiment")(str(folder)))


def check_tiny(folder):
    return check.build_check_report(CheckConfig(str(folder / "config.json"), seq_len=16, torch_profile="2.14.0"))


def assert_judged_once(counted):
    assert len(counted["resolve_profile"]) == 1, counted["resolve_profile"]
    assert len(counted["installed_profile"]) <= 1  # the installed torch, for what it would do on a Mac


@pytest.mark.parametrize("command", ["plan", "check"])
def test_plan_and_check_judge_once_and_take_their_prediction_from_one_section(counted, tiny, command):
    report = (plan_tiny if command == "plan" else check_tiny)(tiny)
    assert_judged_once(counted)
    [section] = counted["sections"]
    assert section.release.profile.release == report["release"]["judged"] == "2.14.0"
    words = section.to_json({})
    assert report["release"] == section.release_json()
    assert [report[key] == words[key] for key in ("faulting_calls", "prediction", "estimated_peak_gib")] == [True] * 3


@pytest.mark.parametrize(("asked", "judged"), [("2.13.0", "2.13.0"), (None, "2.14.0")])
def test_a_sweep_resolves_its_release_once_not_per_cell(counted, tmp_path, monkeypatch, asked, judged):
    from mpsimpact.runs import family_cells, figures, sweep

    # Two bmm cells and two op-family cells, each predicted and emulated under 2.13.0; the figure left out.
    cells, families = sweep.grid(16, ("fp32",), ("contiguous",), True)[:2], family_cells.family_grid(16)[:2]
    monkeypatch.setattr(sweep, "grid", lambda *_: cells)
    monkeypatch.setattr(family_cells, "family_grid", lambda *_: families)
    monkeypatch.setattr(figures, "outcome_map", lambda *_: b"")
    quiet = dict.fromkeys(("plan", "estimate", "cell", "write", "summary", "interrupted"), lambda *_, **__: None)
    show = SimpleNamespace(**quiet)
    config = SweepConfig(device="cpu", emulate=True, index_bits=16, torch_profile=asked,
                         max_memory="1", out=str(tmp_path / "sweep"))
    summary = sweep_run.run_sweep(config, show)
    assert summary["cells"] == 2 and summary["families"]["cells"] == 2 and summary["disagree"] == 0
    # With no --torch-profile, off a Mac, the release every command judges: 2.14.0, not the installed 2.13.0.
    assert counted["resolve_profile"] == [judged] and summary["profile"]["release"] == judged
    assert len(counted["installed_profile"]) <= 1  # the installed torch, said beside the judged one


def test_a_release_is_checked_at_the_boundary_by_its_form_alone(counted, tmp_path):
    for value in ("2.12.1", "conservative", str(tmp_path / "missing.json")):  # a file is read by the command
        RunConfig(torch_profile=value).validate()
    assert counted["resolve_profile"] == counted["installed_profile"] == []
    with pytest.raises(UsageError, match="--torch-profile: 'newest' is not a torch release"):
        RunConfig(torch_profile="newest").validate()
    fresh = ("import sys; from mpsimpact.config import RunConfig; RunConfig(torch_profile='2.12.1').validate(); "
             "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True).stdout == "False\n"


def test_no_module_reaches_through_a_decorator():
    # modes/stand_in.py's EntryPoint has torch's function as its __wrapped__ (functools.update_wrapper sets it,
    # for inspect.signature) and reads it as `original`: no module reads any __wrapped__.
    read = {path.relative_to(SRC).as_posix() for path in SRC.rglob("*.py")
            if re.search(r"\.__wrapped__\b|getattr\([^)]*__wrapped__", path.read_text())}
    assert read == set()


def test_the_public_faces_take_a_profile_value_as_it_is_and_resolve_a_string_once(counted):
    from mpsimpact import emulate, guard, trace_faults

    profile = release.profile_for("2.14.0")
    with emulate(profile=profile), guard("raise", profile=profile):
        trace_faults(lambda: None, profile=profile)
    assert counted["resolve_profile"] == []
    with guard("chunk", profile="2.14.0"):
        pass
    assert counted["resolve_profile"] == ["2.14.0"]


def test_a_matrix_resolves_its_releases_once_and_its_probe_each_column_once(counted, tiny, tmp_path):
    import transformers

    from mpsimpact.upgrade import matrix, overlay, probe

    cache = overlay.OverlayCache(tmp_path / "envs", lambda version, target: {"installed": [], "reused": {}})
    before_probe = {}

    def in_process(path, job):  # the probe's process, run here: its strings are resolved there once more
        before_probe.update(job=job, resolved=list(counted["resolve_profile"]))
        return probe.probe(job)

    config = MatrixConfig("sentiment", (transformers.__version__,), model=str(tiny), batch_size=2,
                          max_length=16, torch_profile="2.14.0")
    report = matrix.build_matrix(config, cache=cache, prober=in_process)
    assert report["rows"][0]["status"] == "probed" and report["release"]["judged"] == "2.14.0"
    assert before_probe["resolved"] == ["2.14.0"]  # the command: its --torch-profile, once
    job = before_probe["job"]
    in_probe = counted["resolve_profile"][1:]  # the probe: every column's release and the emulated one, once each
    assert in_probe == list(dict.fromkeys([None, *job["profiles"], job["emulated_profile"]]))  # None: installed
    assert job["profiles"] == [c["profile"] for c in report["columns"]]
