"""Every command validates the options it shares with others in one way: each bad value of each
shared option is one line on stderr, exit code 2, no traceback, and nothing written. A shared option is
declared once (one help text); an option not given keeps its config's default, and --help shows it."""

import ast
import dataclasses
import importlib
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.config import (INDEX_BITS_RANGE, CheckConfig, MatrixConfig, PlanConfig, RunConfig, SweepConfig,
                              TrainHeadConfig)
from mpsimpact.errors import UsageError
from said import flat, one_message

runner = CliRunner()
COMMANDS = {
    "run": ["run", "sentiment"],
    "plan": ["plan", "sentiment"],
    "sweep": ["sweep", "--device", "cpu"],
    "check": ["check", "some/model"],  # the values are checked before the model is looked for
    "matrix": ["matrix", "sentiment"],
}
SHARED = {  # option -> (bad value, the message's start), and which commands take it
    "--index-bits": [("40", "--index-bits must be in 8..32 (32 is MPS), got 40."),
                     ("7", "--index-bits must be in 8..32 (32 is MPS), got 7.")],
    "--batch-size": [("0", "--batch-size must be >= 1, got 0."),
                     ("-3", "--batch-size must be >= 1, got -3.")],
    "--max-length": [("0", "--max-length must be >= 1, got 0.")],
    "--device": [("tpu", "--device must be one of auto, mps, cuda, cpu; got 'tpu'.")],
    "--torch-profile": [("newest", "--torch-profile: 'newest' is not a torch release (expected e.g. 2.12.1); "
                                   "give a release such as 2.12.1 (measured: 2.4.1 .. 2.14.0; others are "
                                   "judged conservatively), 'conservative', or a profile.json written by "
                                   "`mpsimpact sweep`."),
                        ("/no/such/profile.json",
                         "Cannot read the profile '/no/such/profile.json': No such file or directory; pass a "
                         "profile.json written by `mpsimpact sweep`.")],
}
TAKES = {
    "run": set(SHARED),
    "plan": {"--index-bits", "--batch-size", "--max-length", "--torch-profile"},
    "sweep": {"--index-bits", "--device", "--torch-profile"},
    "check": {"--index-bits", "--batch-size", "--torch-profile"},
    "matrix": {"--batch-size", "--max-length", "--torch-profile"},
}
CASES = [(command, flag, value, message) for command, flags in TAKES.items() for flag in sorted(flags)
         for value, message in SHARED[flag]]


@pytest.mark.parametrize(("command", "flag", "value", "message"), CASES,
                         ids=[f"{c}{f}={v}" for c, f, v, _ in CASES])
def test_each_bad_shared_option_is_one_line_and_exit_2(tmp_path, command, flag, value, message):
    base = COMMANDS[command]
    if flag in base:  # given once: an option given twice is refused as such
        base = base[:base.index(flag)] + base[base.index(flag) + 2:]
    args = [*base, flag, value]
    if command not in ("plan", "check"):
        args += ["--out", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert one_message(result.stderr) == f"error: {message}"
    assert "Traceback" not in result.output and not list(tmp_path.iterdir())


def test_index_bits_range_is_the_one_the_message_names():
    assert INDEX_BITS_RANGE == (8, 32)


def test_sweep_below_the_smallest_family_says_which_width_works(tmp_path):
    args = ["sweep", "--device", "cpu", "--index-bits", "11", "--out", str(tmp_path / "s")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "use a larger --index-bits, e.g. 20" in flat(result.stderr) and not (tmp_path / "s").exists()


def test_run_only_options_are_checked_too(tmp_path):
    for flag, value, message in (
            ("--attention", "flash", "--attention must be one of eager, sdpa, both, blocked_eager; got 'flash'."),
            ("--dtype", "int8", "--dtype must be one of float32, float16, bfloat16; got 'int8'.")):
        result = runner.invoke(app, ["run", "sentiment", flag, value, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and one_message(result.stderr) == f"error: {message}"
    assert not list(tmp_path.iterdir())


def test_plan_out_must_be_a_fresh_folder(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    result = runner.invoke(app, ["plan", "sentiment", "--versions", "--out", str(tmp_path / "taken")])
    assert result.exit_code == 2 and "already exists and is not empty" in flat(result.stderr)
    assert (tmp_path / "taken" / "x").read_text() == "keep me"


# --help shows every default; an option not given keeps its config's default; a shared option is one option.

HELP_ENV = {"COLUMNS": "300"}  # wide enough that each option's help is one row
CONFIGS = {"run": RunConfig, "plan": PlanConfig, "check": CheckConfig, "sweep": SweepConfig,
           "matrix": MatrixConfig}
# Options whose absence means "not done", so they have no default to show.
NOT_DONE_WHEN_ABSENT = {
    ("run", "--expect"),  # no expectation checked
    ("plan", "--figure"), ("plan", "--memory"),  # no figure; no demo sizing
    ("check", "--out"), ("compare", "--out"),  # nothing written
}


def cli_commands() -> dict:
    return typer.main.get_command(app).commands


def help_rows(command: str) -> dict[str, str]:
    """flag -> its row in `mpsimpact COMMAND --help`."""
    result = runner.invoke(app, [command, "--help"], env=HELP_ENV)
    assert result.exit_code == 0, result.output
    rows = {}
    for line in result.output.splitlines():
        match = re.match(r"│ (--[\w-]+)\s", line)
        if match:
            rows[match.group(1)] = line
    return rows


def shown_default(row: str) -> str | None:
    match = re.search(r"\[default: (.*?)\]\s*│$", row.rstrip())
    return match.group(1) if match else None


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_help_shows_a_default_for_every_option_that_has_one(command):
    rows = help_rows(command)
    options = [p for p in cli_commands()[command].params
               if p.param_type_name == "option" and p.name != "help" and not p.hidden]  # hidden: a former name
    assert set(rows) >= {p.opts[0] for p in options}  # every option has its row
    for param in options:
        flag = param.opts[0]
        plain_flag = param.is_flag and not param.secondary_opts  # off unless given
        if plain_flag or (command, flag) in NOT_DONE_WHEN_ABSENT:
            assert shown_default(rows[flag]) is None, rows[flag]
        else:
            assert shown_default(rows[flag]), f"{command} {flag} shows no default: {rows[flag]}"


def cli_spelling(param, default) -> str:
    """How a config value is typed on the command line: the flag of an on/off pair, items with commas."""
    if isinstance(default, bool):
        return (param.opts if default else param.secondary_opts)[0].removeprefix("--")
    return ", ".join(default) if isinstance(default, tuple) else str(default)


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_help_shows_the_config_defaults_themselves(command):
    rows = help_rows(command)
    checked = 0
    for field in dataclasses.fields(CONFIGS[command]):
        flag = "--" + field.name.replace("_", "-")
        param = next((p for p in cli_commands()[command].params if p.opts[0] == flag), None)
        if param is None or field.default in (None, dataclasses.MISSING) or field.default is False:
            continue  # an argument, or no value to show (described instead, or an off flag)
        assert shown_default(rows[flag]) == cli_spelling(param, field.default), rows[flag]
        checked += 1
    assert checked >= {"run": 10, "plan": 1, "check": 5, "sweep": 5, "matrix": 1}[command]


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_help_cuts_nothing_at_80_columns(command):  # a default Mac terminal
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0 and "…" not in result.output, result.output


def test_help_says_train_heads_default_folder_and_that_replacing_the_installed_head_takes_install():
    rows = help_rows("train-head")
    assert "[default: (outputs/train-head-<time>/)]" in rows["--out"]  # never the installed package (#47)
    assert "Replace the installed package's head" in rows["--install"]


def test_help_describes_the_scenarios_defaults_where_the_config_has_none():
    rows = help_rows("run")
    assert shown_default(rows["--batch-size"]) == "(the scenario's, 2048)"
    assert shown_default(rows["--emulate"]) == "(on unless the device is mps)"
    # The config's default wins over the shared description.
    assert shown_default(help_rows("check")["--batch-size"]) == "1"


SHARED_FLAGS = ("--batch-size", "--max-length", "--model", "--device", "--emulate", "--index-bits",
                "--torch-profile", "--json")


def test_a_shared_option_has_one_help_text_everywhere():
    seen: dict[str, set[str]] = {}
    users: dict[str, list[str]] = {}
    for name, command in cli_commands().items():
        for param in command.params:
            if param.opts[0] in SHARED_FLAGS:
                seen.setdefault(param.opts[0], set()).add(param.help)
                users.setdefault(param.opts[0], []).append(name)
    assert {flag: len(texts) for flag, texts in seen.items()} == dict.fromkeys(SHARED_FLAGS, 1)
    assert sorted(users["--torch-profile"]) == ["check", "matrix", "plan", "run", "sweep"]  # once, for five
    outs = [p.help for c in cli_commands().values() for p in c.params if p.opts[0] == "--out"]
    assert len(outs) == 7 and all(" to this folder" in text for text in outs)


def config_lookups(source: str) -> list[str]:
    """What in a command module's source names a class by a string looked up at run time: a "module:Name" or
    a dotted "...Config" string, importlib, __import__."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                r"[\w.]+:\w+|[\w.]*\.\w*Config", node.value):
            found.append(repr(node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            found += [name for name in names if name.split(".")[0] == "importlib"]
        elif isinstance(node, ast.Name) and node.id == "__import__":
            found.append("__import__")
    return found


def test_every_command_imports_its_config_class_so_a_reader_follows_an_option_to_its_check():
    import mpsimpact.cli as cli

    folder = Path(cli.__file__).parent / "commands"
    sources = {path.name: path.read_text() for path in [*folder.glob("*.py"), Path(cli.__file__)]}
    assert len(sources) >= 11 and {name: config_lookups(text) for name, text in sources.items()
                                   if config_lookups(text)} == {}
    # The lookups it would find (the form every command had), and each command's config is the class itself.
    planted = ('import importlib\nCONFIG = "mpsimpact.config:RunConfig"\n'
               'X = "mpsimpact.upgrade.matrix.MatrixConfig"\n')
    assert config_lookups(planted) == ["importlib", "'mpsimpact.config:RunConfig'",
                                       "'mpsimpact.upgrade.matrix.MatrixConfig'"]
    configs = {module.__name__.rpartition(".")[2]: module.CONFIG for module in cli.COMMANDS
               if hasattr(module, "CONFIG")}
    assert configs == {"run": RunConfig, "plan": PlanConfig, "check": CheckConfig, "sweep": SweepConfig,
                       "matrix": MatrixConfig, "train_head": TrainHeadConfig}


# Each command hands its config to one library call; it is captured there (and the command stopped).
HANDED_TO = {
    "run": (["run", "sentiment"], "mpsimpact.runs.runner.run_scenario", {"scenario": "sentiment"}),
    "plan": (["plan", "sentiment"], "mpsimpact.prediction.plan.build_plan_report", {"scenario": "sentiment"}),
    "check": (["check", "x/y"], "mpsimpact.prediction.check.build_check_report", {"model": "x/y"}),
    "sweep": (["sweep"], "mpsimpact.runs.sweep_run.run_sweep", {}),
    "matrix": (["matrix", "sentiment"], "mpsimpact.upgrade.matrix.build_matrix", {"scenario": "sentiment"}),
}


# Config fields no option of their own name sets: what --quick set (RunConfig.quick_sizes) follows from which sizes
# were given (test_quick_records_the_sizes_it_set).
DERIVED = {("run", "quick_sizes")}


def captured_config(monkeypatch, target: str, args: list[str]):
    module, _, name = target.rpartition(".")
    seen = []

    def capture(config, *rest, **kwargs):
        seen.append(config)
        raise UsageError("captured")

    monkeypatch.setattr(importlib.import_module(module), name, capture)
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and one_message(result.stderr) == "error: captured", result.output
    return seen[0]


def other_value(param, field, hint):
    """(argv, the config's value) for a valid value other than the field's default (the command checks its
    options before it hands them on)."""
    flag, default, check = param.opts[0], field.default, field.metadata.get("check")
    if param.is_flag:  # on unless given, or an on/off pair: the other one
        off_given = bool(param.secondary_opts) and bool(default)
        return [param.secondary_opts[0] if off_given else flag], not off_given
    if flag == "--guard":  # one that runs the guard-off condition, which --expect (given too) judges
        return [flag, "off"], "off"
    if flag == "--memory":  # a Mac's size, read into the config's `mac` (TakesMemory)
        return [flag, "16GB"], "16GB"
    if check is not None and check.choices and isinstance(default, tuple):  # a subset: comma-separated
        return [flag, check.choices[0]], (check.choices[0],)
    if check is not None and check.choices:
        choice = next(c for c in reversed(check.choices) if c != default)
        return [flag, choice], choice
    if isinstance(default, tuple):  # comma-separated on the command line, as --help shows it
        return [flag, "4.44.2, 5.24.0"], ("4.44.2", "5.24.0")
    if check is not None and check.parse is not None:  # --torch-profile, --max-memory
        value = "2.12.1" if flag == "--torch-profile" else "20GiB"
        return [flag, value], value
    if hint in (int, int | None):
        value = 7 if check is None or check.low is None or check.low <= 7 <= (check.high or 7) else int(check.low) + 1
        return [flag, str(value)], value
    if hint in (float, float | None):
        return [flag, "0.25"], 0.25
    value = "fig.png" if flag == "--figure" else "x"  # plan refuses a figure inside --out x
    return [flag, value], value


@pytest.mark.parametrize("command", sorted(HANDED_TO))
def test_options_not_given_keep_the_config_defaults_and_every_given_one_reaches_the_config(
        tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)  # --out x etc. are looked at, never written: the call stops first
    args, target, positional = HANDED_TO[command]
    config = CONFIGS[command]
    # Every option at once: no scenario's kind reads them all (steps and lr are finetune's, and finetune runs eager
    # float32 alone), so what each kind reads is tested apart (test_bad_inputs_four.py); here, the plumbing.
    monkeypatch.setattr("mpsimpact.runs.runner.check_run", lambda *_: "cpu")
    assert captured_config(monkeypatch, target, args) == config(**positional)
    given, expected = list(args), dict(positional)
    params, hints = {p.name: p for p in cli_commands()[command].params}, typing.get_type_hints(config)
    for field in dataclasses.fields(config):
        if field.name in positional or (command, field.name) in DERIVED:
            continue
        argv, value = other_value(params[field.name], field, hints[field.name])
        given += argv
        expected[field.name] = value
    assert captured_config(monkeypatch, target, given) == config(**expected)


@pytest.mark.parametrize(("given", "sizes"), [
    ([], ("batch_size", "max_length", "index_bits")),
    (["--max-length", "512"], ("batch_size", "index_bits")),
    (["--batch-size", "8", "--index-bits", "24", "--max-length", "128"], ()),
])
def test_quick_records_the_sizes_it_set(monkeypatch, given, sizes):
    from mpsimpact.commands.run import QUICK

    config = captured_config(monkeypatch, HANDED_TO["run"][1], ["run", "sentiment", "--quick", *given])
    assert config.quick_sizes == sizes  # the run may choose these for the model, never one that was given
    asked = dict(zip(given[::2], map(int, given[1::2])))
    assert (config.batch_size, config.max_length, config.index_bits) == tuple(
        asked.get(flag, default) for flag, default in zip(("--batch-size", "--max-length", "--index-bits"), QUICK))
    assert captured_config(monkeypatch, HANDED_TO["run"][1], ["run", "sentiment", *given]).quick_sizes == ()


def test_check_task_choices_are_the_tasks_check_knows():
    from mpsimpact.config import CHECK_TASKS
    from mpsimpact.prediction.meta_model import TASKS

    assert CHECK_TASKS == tuple(TASKS)


def test_sweep_dtype_and_layout_choices_are_the_sweeps():
    from mpsimpact.config import SWEEP_DTYPES, SWEEP_LAYOUTS
    from mpsimpact.runs.sweep import DTYPES, LAYOUTS

    assert (SWEEP_DTYPES, SWEEP_LAYOUTS) == (tuple(DTYPES), LAYOUTS)


@pytest.mark.parametrize("word", ["run", "plan", "check", "sweep", "compare", "matrix", "doctor", "train-head"])
def test_help_shows_defaults_without_importing_torch(word):
    # `--help` must be instant: the configs whose defaults it shows live in the torch-free config module.
    code = ("import sys; from mpsimpact.cli import app\n"
            f"try: app(['{word}', '--help'])\nexcept SystemExit as e: assert e.code == 0, e.code\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert word in ("compare", "doctor") or "[default:" in result.stdout  # those two have no valued option


def test_the_torch_profile_default_names_the_release_judged_without_a_mac():
    # The help cannot import engine.release (no torch for --help): the release is written out, and must not drift.
    from mpsimpact.commands.options import SHARED
    from mpsimpact.engine.release import PUBLISHED_DEMO_RELEASE

    assert f"elsewhere {PUBLISHED_DEMO_RELEASE}" in SHARED["--torch-profile"][1]
