"""Nothing lost, part four (issue #59): inputs bad in new ways, and options that do not apply. Every number,
size and release a person types is read by one rule (Note [Numbers typed by a user] in bounds), in every
option and variable; an option given twice, two that set one, an empty value, an option the chosen scenario
does not read, and click's usage errors are each one line, exit 2, before any work, nothing written.

The cases are made from the CLI itself (every option of every command, every kind of run) rather than listed
one by one, so an option added later is held to the same rule."""

import os

import pytest
import typer
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.runs.kind import KIND_OPTIONS
from said import one_message

runner = CliRunner()
BERT = os.path.join(os.path.dirname(__file__), "data", "bert-base")  # a config.json alone
# Where each command's work starts once its input is checked (module, function): replaced by a stop.
WORK = {"run": ("mpsimpact.runs.runner", "run_scenario"),
        "plan": ("mpsimpact.prediction.plan", "build_plan_report"),
        "check": ("mpsimpact.prediction.check", "build_check_report"),
        "sweep": ("mpsimpact.runs.sweep_run", "run_sweep"),
        "matrix": ("mpsimpact.upgrade.matrix", "build_matrix"), "train-head": ("mpsimpact.runs.head", "train_head"),
        "compare": ("mpsimpact.upgrade.compare", "compare_folders")}
BASE = {"run": ["run", "sentiment"], "plan": ["plan", "sentiment"], "check": ["check", BERT], "sweep": ["sweep"],
        "matrix": ["matrix", "sentiment"], "train-head": ["train-head"], "compare": ["compare", "a", "b"],
        "doctor": ["doctor"], "list": ["list"]}
# Digits of other systems: int() and re's \d take them all for 16; no script, tool or reader does.
DIGIT_SYSTEMS = {"arabic-indic": "١٦", "fullwidth": "１６", "devanagari": "१६", "bengali": "১৬",
                 "thai": "๑๖",
                 "superscript": "¹⁶", "math-bold": "𝟏𝟔", "extended-arabic": "۱۶"}
WHOLE_SPELLINGS = [*DIGIT_SYSTEMS.values(), "1_6", "16.0", " 16", "16 ", "+16", "0x10", "1e3", "0b10", "16\n", "½"]
DECIMAL_SPELLINGS = [*DIGIT_SYSTEMS.values(), "1_6", " 0.5", "0.5 ", "0x10", "nan", "inf", "-inf", "Infinity",
                     "1,5", "0.5.1"]


class ReachedWork(Exception):
    """A command got past every check to its work."""


@pytest.fixture(autouse=True)
def work(tmp_path, monkeypatch):
    """Each test in its own empty folder and cache (both looked at afterwards), every command's work stopped;
    returns each command's real work function, for a test that lets one run."""
    import importlib

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path.parent / f"{tmp_path.name}-cache"))

    def reached(*args, **kwargs):
        raise ReachedWork

    real = {}
    for word, (module, name) in WORK.items():
        real[word] = getattr(importlib.import_module(module), name)
        monkeypatch.setattr(importlib.import_module(module), name, reached)
    return real


def refused(args: list[str], env: dict | None = None) -> str:
    """The one line of a command refused before any work, nothing written (exit 2, no traceback)."""
    result = runner.invoke(app, [str(a) for a in args], env=env)
    assert result.exit_code == 2, (args, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == "" and "╭" not in result.stderr, result.output
    assert os.listdir() == [], (args, os.listdir())
    return one_message(result.stderr)


def reaches_work(args: list[str]) -> None:
    result = runner.invoke(app, [str(a) for a in args])
    assert isinstance(result.exception, ReachedWork), (args, result.output, result.exception)


def options_of(word: str) -> list:
    return [p for p in typer.main.get_command(app).commands[word].params
            if p.param_type_name == "option" and p.name != "help"]


def number_options() -> list[tuple[str, str, str]]:
    """(command, flag, "INTEGER" or "FLOAT") for every option of every command that takes a number."""
    return [(word, p.opts[0], p.metavar) for word in BASE for p in options_of(word)
            if p.metavar in ("INTEGER", "FLOAT")]


# One rule for numbers: every number option of every command, every spelling that is not digits 0-9.

NUMBER_OPTIONS = number_options()


def test_the_number_options_are_found():
    found = {(word, flag) for word, flag, _ in NUMBER_OPTIONS}
    assert {("run", "--batch-size"), ("run", "--lr"), ("run", "--seed"), ("check", "--target-len"),
            ("sweep", "--index-bits"), ("train-head", "--limit"), ("matrix", "--max-length")} <= found


@pytest.mark.parametrize(("word", "flag", "kind"), NUMBER_OPTIONS, ids=[f"{w}{f}" for w, f, _ in NUMBER_OPTIONS])
def test_a_number_in_any_other_spelling_is_one_line_naming_the_option(word, flag, kind):
    spellings = WHOLE_SPELLINGS if kind == "INTEGER" else DECIMAL_SPELLINGS
    for spelling in spellings:
        said = refused([*BASE[word], flag, spelling])
        assert said.startswith(f"error: {flag} must be ") and "written with the digits 0-9" in said, said


@pytest.mark.parametrize("value", ["16", "0016"])
def test_a_number_in_digits_is_read(value):
    reaches_work(["plan", "sentiment", "--batch-size", value])


@pytest.mark.parametrize("value", ["0.5", "5e-4", ".5", "1E-3"])
def test_a_decimal_in_digits_is_read(value):
    reaches_work(["run", "finetune", "--lr", value])


@pytest.mark.parametrize("command", ["run", "plan", "check", "sweep"])
@pytest.mark.parametrize("system", sorted(DIGIT_SYSTEMS))
def test_a_mac_memory_in_other_digits_is_refused(command, system):
    said = refused([*BASE[command], "--memory", DIGIT_SYSTEMS[system] + "GB"])
    assert said.startswith("error: --memory: '") and "is not a Mac's unified memory" in said


@pytest.mark.parametrize("value", [*DIGIT_SYSTEMS.values(), " 20", "2_0", "1e30", "20.0.0", "0x14"])
def test_a_max_memory_in_other_spellings_is_refused_and_never_called_a_size_below_0(value):
    said = refused(["sweep", "--max-memory", value])
    assert said.startswith(f"error: --max-memory: '{value}' is not a size: a number written with the digits 0-9")
    assert "above 0" not in said


@pytest.mark.parametrize(("name", "value"), [(name, value) for name in ("MPSIMPACT_ATTENTION_BUDGET", "COLUMNS")
                                             for value in [*DIGIT_SYSTEMS.values(), "1_6", " 80", "8e1"]])
def test_a_variable_holding_a_number_in_other_spellings_is_refused(name, value):
    said = refused(["plan", "sentiment"], env={name: value})
    assert said.startswith(f"error: {name}={value!r} is not a "), said


@pytest.mark.parametrize("word", ["run", "plan", "check", "sweep", "matrix"])
@pytest.mark.parametrize("release", ["２.14.0", "2.１4.0", "٢.14.0", " 2.14.0", "2.14.0 ", "2.14.0-rc1",
                                     "2.14.0rc",
                                     "v2.14.0", "2.14.0+", "2.14.0.1"])
def test_a_release_in_another_spelling_is_refused(word, release):
    said = refused([*BASE[word], "--torch-profile", release])
    assert said.startswith(f"error: --torch-profile: {release!r} is not a torch release".replace('"', "'")), said


@pytest.mark.parametrize("releases", ["４.44.2", "4.44.2,٥.24.0", "4.44.2, 5.24", "4.44", "4.44.2,"])
def test_matrix_refuses_a_transformers_release_in_another_spelling_and_makes_no_environment(releases):
    from mpsimpact.engine.release import cache_root

    if releases in ("4.44.2, 5.24", "4.44"):  # releases in their own form (5.24 is 5.24.0): reach the work
        reaches_work(["matrix", "sentiment", "--transformers", releases])
        return
    said = refused(["matrix", "sentiment", "--transformers", releases])
    assert said.startswith("error: --transformers: ")
    assert not cache_root().exists()  # no environment, no lock file


# A release typed with a pre-release, development or post-release part is named as such wherever it is judged.

@pytest.mark.parametrize(("asked", "label", "measured"), [
    ("2.14.0rc1", "2.14.0rc1 (unmeasured pre-release: conservative)", False),
    ("2.15.0a0", "2.15.0a0 (unmeasured pre-release: conservative)", False),
    ("2.14.0.dev20260101", "2.14.0.dev20260101 (unmeasured pre-release: conservative)", False),
    ("2.13.0b2+cpu", "2.13.0b2 (unmeasured pre-release: conservative)", False),
    ("2.14.0.post1", "2.14.0.post1 (taken as 2.14.0)", False),
    ("2.12.0", "2.12.0 (taken as 2.10.0-2.12.1)", False),
    ("2.14.0+cpu", "2.14.0", True),
    ("2.14", "2.14.0", True)])
def test_a_release_is_judged_as_what_it_is_and_named_so(asked, label, measured):
    from mpsimpact.engine.release import judge_release

    judged = judge_release(asked, apple_gpu=False)
    assert judged.profile.label == label and judged.profile.measured is measured
    assert judged.sentence().startswith(f"Judged as torch {label}, as --torch-profile asked")
    assert judged.to_json()["release"] == label.split(" ")[0]


def test_plan_names_a_pre_release_it_judges(monkeypatch, work):
    monkeypatch.setattr("mpsimpact.prediction.plan.build_plan_report", work["plan"])
    result = runner.invoke(app, ["plan", "sentiment", "--torch-profile", "2.14.0rc1", "--batch-size", "16",
                                 "--max-length", "128"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "Judged as torch 2.14.0rc1 (unmeasured pre-release: conservative), as --torch-profile asked" in text
    assert "torch 2.14.0 " not in text and "torch 2.14.0," not in text and "torch 2.14.0." not in text


# An option given twice, or two options that set one: refused, whatever the values (no value silently wins).

def given_twice() -> list[tuple[str, list[str], str]]:
    """(command, the two words, the refusal's start) for every option of every command."""
    cases = []
    for word in BASE:
        for param in options_of(word):
            flag = param.opts[0]
            if param.is_flag and param.secondary_opts:  # a pair: each side twice, and both sides
                off = param.secondary_opts[0]
                cases += [(word, [flag, flag], f"{flag} is given 2 times"),
                          (word, [off, off], f"{off} is given 2 times"),
                          (word, [flag, off], f"{flag} and {off} are both given")]
            elif param.is_flag:
                cases.append((word, [flag, flag], f"{flag} is given 2 times"))
            else:
                cases.append((word, [flag, "a", f"{flag}=b"], f"{flag} is given 2 times"))
    return cases


REPEATS = given_twice()


@pytest.mark.parametrize(("word", "words", "start"), REPEATS, ids=[f"{w}:{' '.join(x)}" for w, x, _ in REPEATS])
def test_an_option_given_twice_or_both_sides_of_a_pair_is_refused(word, words, start):
    said = refused([*BASE[word], *words])
    assert said.startswith(f"error: {start}"), said


def test_the_repeats_cover_every_command_with_options():
    assert {word for word, _, _ in REPEATS} == {"run", "plan", "check", "sweep", "matrix", "train-head", "compare"}
    assert ("run", ["--memory", "a", "--memory=b"], "--memory is given 2 times") in REPEATS


@pytest.mark.parametrize(("words", "start"), [
    (["--memory", "16GB", "--memory", "64GB"], "--memory is given 2 times"),
    (["--workload", "inference", "--phase", "training"], "--workload and --phase are both given"),
    (["--phase", "training", "--workload", "training"], "--phase and --workload are both given"),
    (["--cache", "--no-cache"], "--cache and --no-cache are both given")])
def test_check_refuses_repeats_and_an_option_beside_its_former_name(words, start):
    assert refused(["check", BERT, *words]).startswith(f"error: {start}")


def test_the_former_name_alone_still_works():
    reaches_work(["check", BERT, "--phase", "training"])


# An option the chosen scenario does not read: refused in one line naming the scenario, the option and why.

VALUES = {"steps": "5", "lr": "0.5", "threshold": "0.9", "reference_device": "device", "dataset": "texts.csv"}


def kinds() -> dict:
    from mpsimpact.runs.scenario import available

    return {name: cls.kind for name, cls in available().items()}


def unread_options() -> list[tuple[str, str]]:
    return [(scenario, name) for scenario, kind in kinds().items() for name in KIND_OPTIONS if name not in kind.reads]


@pytest.mark.parametrize(("scenario", "name"), unread_options())
def test_an_option_the_scenario_does_not_read_is_refused_saying_why(scenario, name):
    flag = "--" + name.replace("_", "-")
    said = refused(["run", scenario, "--quick", flag, VALUES[name], "--out", "k"])
    assert said.startswith(f"error: run {scenario} does not use {flag}: ") and said.endswith(f"; drop {flag}."), said


def test_the_issues_cases_are_among_them():
    unread = set(unread_options())
    assert {("sentiment", "steps"), ("sentiment", "lr"), ("retrieval", "threshold")} <= unread
    assert ("finetune", "steps") not in unread and ("sentiment", "threshold") not in unread


def test_every_kind_declares_what_it_reads_and_why_not_the_rest():
    from mpsimpact.config import RunConfig

    fields = {field.name for field in __import__("dataclasses").fields(RunConfig)}
    assert set(KIND_OPTIONS) <= fields
    for kind in set(kinds().values()):
        assert kind.reads <= set(KIND_OPTIONS), kind
        assert set(KIND_OPTIONS) - kind.reads <= set(kind.not_read), (kind, "an unread option without a reason")


@pytest.mark.parametrize(("scenario", "words"), [("finetune", ["--steps", "2", "--lr", "0.5", "--threshold", "0.01"]),
                                                 ("sentiment", ["--threshold", "0.01", "--reference-device", "cpu"]),
                                                 ("retrieval", ["--reference-device", "cpu"])])
def test_an_option_the_scenario_reads_is_taken(scenario, words):
    reaches_work(["run", scenario, "--quick", *words, "--out", "k"])


def test_the_library_refuses_an_unread_option_too():
    from mpsimpact.config import RunConfig
    from mpsimpact.errors import UsageError
    from mpsimpact.runs.runner import check_run

    with pytest.raises(UsageError, match="run sentiment does not use --lr"):
        check_run(RunConfig(scenario="sentiment", lr=0.5))
    check_run(RunConfig(scenario="finetune", lr=0.5))


@pytest.mark.parametrize("guard", ["chunk", "raise"])
def test_expect_without_the_guard_off_condition_is_refused_before_any_work(guard):
    said = refused(["run", "sentiment", "--quick", "--expect", "corrupted", "--guard", guard, "--out", "k"])
    assert said == (f"error: --expect judges the guard-off condition, which --guard {guard} does not run; give "
                    "--guard off or all, or drop --expect.")


def test_run_length_past_the_scenarios_own_length_is_refused_before_any_work():
    said = refused(["run", "sentiment", "--run-length", "600", "--out", "k"])  # sentiment's length: 512
    assert said.startswith("error: --run-length 600 is more than the length asked (512, ")


def test_sweep_in_process_on_an_emulated_sweep_is_refused(work, monkeypatch):
    monkeypatch.setattr("mpsimpact.runs.sweep_run.run_sweep", work["sweep"])
    said = refused(["sweep", "--device", "cpu", "--in-process", "--out", "s"])
    assert said.startswith("error: --in-process runs a real device's cells in this process") and "emulated" in said
    monkeypatch.setattr("mpsimpact.output.files.fresh_out_dir", lambda *a, **k: (_ for _ in ()).throw(ReachedWork))
    reaches_work(["sweep", "--device", "cpu", "--no-emulate", "--in-process", "--out", "s"])


def test_check_target_len_on_a_model_that_is_no_encoder_decoder_is_refused(work, monkeypatch):
    monkeypatch.setattr("mpsimpact.prediction.check.build_check_report", work["check"])
    said = refused(["check", BERT, "--target-len", "8", "--out", "r"])
    assert said.startswith("error: --target-len is the decoder's length of an encoder-decoder") and "'bert'" in said


@pytest.mark.parametrize(("size", "words"), [
    ("3.5GB", "is less than any Mac's unified memory (the smallest Mac with an Apple GPU has 8 GB)"),
    ("4", "is less than any Mac's unified memory"), ("0.5GB", "is less than any Mac's unified memory"),
    ("16.5GB", "is not a Mac's unified memory, which Apple sells in whole GB"),
    ("5000GB", "is more than any Mac's unified memory")])
def test_a_mac_that_is_no_mac_is_refused_not_described(size, words):
    for command in ("run", "plan", "check", "sweep"):
        said = refused([*BASE[command], "--memory", size])
        assert said.startswith(f"error: --memory: '{size}' {words}") and f"A {size}" not in said, said


def test_a_reference_device_that_changes_nothing_is_said_once(monkeypatch, capsys):
    import numpy as np
    from types import SimpleNamespace

    from mpsimpact.config import RunConfig
    from mpsimpact.runs import classify_kind

    monkeypatch.setattr(classify_kind, "reference_logits", lambda *a: (np.zeros((2, 3)), False))
    geometry = SimpleNamespace(device="cpu", run_length=8)
    _, info = classify_kind.select_reference(RunConfig(reference_device="device"), None, ["a", "b"], geometry,
                                             None, lambda *a: None)
    assert info["device"] == "cpu"
    said = capsys.readouterr().err
    assert one_message(said, "warning").startswith("warning: --reference-device device computes the reference on "
                                                   "the run's device, and that is the CPU here")


# Usage mistakes click finds: one line with the fix, as every other refusal.

USAGE = [(["plan", "sentiment", "--batch-size", "0x10"], "--batch-size must be a whole number >= 1"),
         (["plan", "sentiment", "--batch-size="], "--batch-size is given an empty value"),
         (["run", "sentiment", "--seed", "1e3"], "--seed must be a whole number >= 0"),
         (["doctor", "extra"], "Got unexpected extra argument(s) (extra); `mpsimpact doctor --help` lists"),
         (["list", "--json"], "No such option: --json; `mpsimpact list --help` lists what it takes."),
         (["plan"], "Missing argument 'scenario'; `mpsimpact plan --help` lists"),
         (["plan", "sentiment", "--out"], "Option '--out' requires an argument; `mpsimpact plan --help` lists"),
         (["nosuch"], "No such command 'nosuch'; `mpsimpact --help` lists"),
         (["--nosuch"], "No such option: --nosuch; `mpsimpact --help` lists"),
         (["compare", "a"], "Missing argument 'new'; `mpsimpact compare --help` lists")]
USAGE += [([*BASE[word], "--no-such-option"], f"No such option: --no-such-option") for word in BASE]
USAGE += [([*BASE[word], "extra", "words"], "Got unexpected extra argument(s)") for word in BASE]
USAGE += [([*BASE[word], "''"], "Got unexpected extra argument(s)") for word in ("doctor", "list")]
USAGE += [([*BASE[word][:1], ""], "argument is empty ('')") for word in ("run", "plan", "check", "matrix")]


@pytest.mark.parametrize(("args", "start"), USAGE, ids=[" ".join(a) for a, _ in USAGE])
def test_a_usage_mistake_is_one_line_with_the_fix(args, start):
    said = refused(args)
    assert start in said, said


# Words that say what is wrong.

def test_an_empty_model_or_dataset_is_called_empty():
    for flag in ("--model", "--dataset", "--out", "--torch-profile", "--memory"):
        other = ["--out", "k"] if flag != "--out" else ["--seed", "1"]
        said = refused(["run", "sentiment", flag, "", *other])
        assert said == f"error: {flag} is given an empty value (''); give a value, or leave {flag} out.", said
        assert "config.json" not in said and "is a folder" not in said


def test_memory_on_a_run_that_is_not_emulated_is_refused():
    said = refused(["run", "sentiment", "--quick", "--device", "cpu", "--no-emulate", "--memory", "16GB", "--out", "k"])
    assert said.startswith("error: --memory emulates a Mac's memory, and this run on cpu is not emulated")
    reaches_work(["run", "sentiment", "--quick", "--device", "cpu", "--memory", "16GB", "--out", "k"])


@pytest.mark.parametrize("word", ["plan", "check"])
def test_verbose_beside_json_is_refused(word):
    said = refused([*BASE[word], "--json", "--verbose"])
    assert said.startswith("error: --verbose adds the internals to the console's tables, and --json prints")


def test_a_threshold_below_what_half_precision_is_judged_at_is_refused_not_raised_silently():
    said = refused(["run", "sentiment", "--quick", "--dtype", "float16", "--threshold", "0.005", "--out", "k"])
    assert said.startswith("error: --threshold 0.005 is below the 0.02 a float16 run is judged at")
    reaches_work(["run", "sentiment", "--quick", "--dtype", "float16", "--out", "k"])  # the floor, by default
    reaches_work(["run", "sentiment", "--quick", "--dtype", "bfloat16", "--threshold", "0.05", "--out", "k"])
