"""Fuzzing every command's options and every environment variable mpsimpact reads with values of the wrong type,
size and kind (Hypothesis: a fixed number of examples, derandomized, so CI sees the same cases every time). Each
case must end without a traceback, with an exit code of 0 to 3, within HANG_BOUND_S, having written nothing
outside --out and the cache and changed nothing it was pointed at.

Validation alone is fuzzed: the library call each command makes once its input is checked is replaced by a
stand-in that stops there (ReachedWork), so a case that passes every check costs nothing. What the library
calls check deeper (a dataset's rows, a model folder's files) is tested case by case in test_nothing_lost.py."""

import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import traceback
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mpsimpact.cli import app
from said import one_message

runner = CliRunner()
SRC = Path(__file__).resolve().parents[1]
BERT = str(Path(__file__).parent / "data" / "bert-base")  # a config.json alone
HANG_BOUND_S = 30  # one case; validation answers in well under a second
EXAMPLES = 30  # per command, and for the environment
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Where each command's work starts once its input is checked: module, function.
WORK = {
    "run": ("mpsimpact.runs.runner", "run_scenario"),
    "plan": ("mpsimpact.prediction.plan", "build_plan_report"),
    "check": ("mpsimpact.prediction.check", "build_check_report"),
    "sweep": ("mpsimpact.runs.sweep_run", "run_sweep"),
    "compare": ("mpsimpact.upgrade.compare", "compare_folders"),
    "matrix": ("mpsimpact.upgrade.matrix", "build_matrix"),
    "train-head": ("mpsimpact.runs.head", "train_head"),
}
# Every environment variable mpsimpact reads (test_the_fuzzed_variables_are_every_one_the_code_reads keeps it so).
VARIABLES = ("MPSIMPACT_ATTENTION_BUDGET", "MPSIMPACT_GUARD", "MPSIMPACT_EMBEDDED_MODEL", "MPSIMPACT_CACHE",
             "XDG_CACHE_HOME", "HOME", "UV_OFFLINE", "PIP_NO_INDEX", "PYTORCH_ENABLE_MPS_FALLBACK", "COLUMNS",
             "PYTORCH_MPS_HIGH_WATERMARK_RATIO")

# Things a path may name, made in each case's own folder ("<fifo>" becomes the path of a FIFO, ...).
THINGS = ("<fifo>", "<socket>", "<dangling>", "<device>", "<folder>", "<file>", "<long-name>", "<long-path>",
          "<nul>")
WRONG = ["", " ", "banana", "nan", "inf", "-inf", "-1", "0", "1e400", "10^30", str(10**30), str(2**64),
         "-" + str(2**63), "1.5", "0x10", "None", "[]", "'", "\\", "-", ",", "a,,b", "fp32,fp32", "auto", "16GB", "2.12.1",
         "conservative", "sentiment", "…", "\u00fc" * 3, "\udcff", "x" * 5000]
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)
VALUES = st.sampled_from(WRONG) | st.sampled_from(THINGS) | TEXT | st.integers(-(2**70), 2**70).map(str)


class ReachedWork(Exception):
    """A case got past every check to the command's work: nothing more to fuzz."""


class Hung(BaseException):
    """A case ran past HANG_BOUND_S (a BaseException: no handler of the code under test swallows it)."""


# Mostly values of the option's own type, of every size and sign (what gets past click to our checks), and
# now and then anything at all.
EDGES = [0, -1, 2**31 - 1, 2**31, 2**63, 2**64, 10**30]
INTEGERS = (st.integers(-(2**70), 2**70) | st.sampled_from(EDGES)).map(str)
FLOATS = st.floats(allow_nan=True, allow_infinity=True).map(repr) | st.sampled_from(["nan", "inf", "-0", "1e400"])
SOUND = {"scenario": ["sentiment"] * 4 + ["finetune", "retrieval"], "model": [BERT] * 5, "old": ["<folder>"],
         "new": ["<folder>"]}


def type_of(param) -> str:
    """"int", "float", "str" or "bool": a number option's kind as its --help names it (the options declare numbers
    as text, read by the one rule: commands.options.number), else typer's own name for its type."""
    if param.metavar in ("INTEGER", "FLOAT"):
        return {"INTEGER": "int", "FLOAT": "float"}[param.metavar]
    bare = getattr(param, "bare_type", None)
    name = bare() if callable(bare) else param.type.name
    return {"integer": "int", "boolean": "bool", "text": "str"}.get(name, name)


def value_of(param) -> st.SearchStrategy[str]:
    """Values for one option or argument: of its type mostly (wrong in size or sign), or anything (VALUES)."""
    if type_of(param) == "int":
        return INTEGERS | INTEGERS | VALUES
    if type_of(param) == "float":
        return FLOATS | FLOATS | VALUES
    if param.param_type_name == "argument":
        return st.sampled_from(SOUND.get(param.name, ["<folder>"])) | VALUES
    return VALUES


def words_of(param, value: str) -> list[str]:
    if param.param_type_name == "argument":
        return [value]
    if param.is_flag:
        return [(param.secondary_opts or param.opts)[0] if value == "off" else param.opts[0]]
    return [param.opts[0], value]


@st.composite
def command_args(draw, word: str) -> list[str]:
    """A random command line for `word`: its arguments (sound ones mostly, so that the options are reached),
    then up to four of its options, each with a wrong value (a flag: on or off)."""
    params = [p for p in typer.main.get_command(app).commands[word].params if p.name != "help"]
    line = [draw(value_of(p)) for p in params if p.param_type_name == "argument"]
    options = [p for p in params if p.param_type_name == "option"]
    for param in draw(st.lists(st.sampled_from(options), max_size=4, unique_by=lambda p: p.name)):
        line += words_of(param, draw(st.sampled_from(["on", "off"]) if param.is_flag else value_of(param)))
    return line


def variables() -> st.SearchStrategy[dict[str, str]]:
    return st.dictionaries(st.sampled_from(VARIABLES), VALUES, max_size=3)


def materialize(value: str) -> str:
    """A THINGS token as the path of that thing, made in the current folder (once); any other value as it is."""
    made = value.strip("<>")
    if value in THINGS and os.path.lexists(made):
        return made
    if value == "<fifo>":
        os.mkfifo("fifo")
        return "fifo"
    if value == "<socket>":
        server = socket.socket(socket.AF_UNIX)
        server.bind("socket")
        server.close()
        return "socket"
    if value == "<dangling>":
        os.symlink("nowhere", "dangling")
        return "dangling"
    if value == "<device>":
        os.symlink("/dev/null", "device")
        return "device"
    if value == "<folder>":
        os.makedirs("folder", exist_ok=True)
        return "folder"
    if value == "<file>":
        Path("file").write_bytes(b"\x00\xffnot what anyone expects\n")
        return "file"
    return {"<long-name>": "n" * 300, "<long-path>": "/".join(["p" * 200] * 25), "<nul>": "a\0b"}.get(value, value)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` (links not followed): its kind, size, link target."""
    found = {}
    for folder, names, files in os.walk(root):
        for name in names + files:
            path = os.path.join(folder, name)
            info = os.lstat(path)
            target = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
            found[os.path.relpath(path, root)] = (stat.S_IFMT(info.st_mode), info.st_size if stat.S_ISREG(
                info.st_mode) else 0, target)
    return found


def allowed_roots(args: list[str], env: dict[str, str]) -> list[str]:
    """Where a case may write, relative to its folder: its --out, the default outputs/, the cache."""
    roots = ["cache", "outputs", "home"]
    roots += [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--out"]
    roots += [env[name] for name in ("MPSIMPACT_CACHE", "XDG_CACHE_HOME") if env.get(name, "").strip()]
    return [os.path.normpath(root) for root in roots if root.strip() and "\0" not in root]


def is_under(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


@pytest.fixture
def stand_ins(monkeypatch):
    """Each command's work replaced by ReachedWork; the installed head's bytes, to check they never change."""
    import importlib

    def reached(*args, **kwargs):
        raise ReachedWork

    for module, name in WORK.values():
        monkeypatch.setattr(importlib.import_module(module), name, reached)
    from mpsimpact.runs.head import installed_head_folder

    folder = installed_head_folder()
    return {path: path.read_bytes() for path in folder.iterdir() if path.name.startswith("sentiment_head")}


def run_case(word: str, args: list[str], env: dict[str, str]) -> None:
    """One case in a fresh folder: the command line and the variables' values, things made, then the checks."""
    here = os.getcwd()
    folder = tempfile.mkdtemp(prefix="fz", dir="/tmp")  # short: a socket's path must fit 108 bytes
    try:
        os.chdir(folder)
        line = [materialize(v) for v in [word, *args]]
        values = {name: materialize(value) for name, value in env.items()}
        before = snapshot(Path(folder))
        base = {"MPSIMPACT_CACHE": os.path.join(folder, "cache"), "HOME": os.path.join(folder, "home"),
                "XDG_CACHE_HOME": None, "COLUMNS": "100"}
        result = invoke(line, base | {k: v.replace("\0", "") for k, v in values.items()})
        check_result(result, line, values)
        check_written(before, snapshot(Path(folder)), allowed_roots(line, values), line)
    finally:
        os.chdir(here)
        shutil.rmtree(folder, ignore_errors=True)


def invoke(line: list[str], env: dict[str, str | None]):
    def hung(signum, frame):
        raise Hung(f"{line} ran past {HANG_BOUND_S} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_BOUND_S)
    try:
        return runner.invoke(app, line, env=env)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_result(result, line: list[str], env: dict[str, str]) -> None:
    case = f"mpsimpact {line} with {env}"
    error = result.exception
    event("reached the work" if isinstance(error, ReachedWork) else f"exit {result.exit_code}")
    if isinstance(error, ReachedWork):
        return
    if error is not None and not isinstance(error, SystemExit):
        trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        pytest.fail(f"{case}: a traceback\n{trace}")
    assert result.exit_code in (0, 1, 2, 3), (case, result.exit_code, result.output)
    said = result.stderr if result.stderr_bytes else ""
    if result.exit_code == 2:
        assert one_message(said), (case, said)  # every refusal is one paragraph, click's usage errors too


def check_written(before: dict, after: dict, roots: list[str], line: list[str]) -> None:
    changed = sorted(path for path in before if after.get(path) != before[path])
    assert changed == [], (line, "changed what it was pointed at", changed)
    new = sorted(path for path in after if path not in before and not is_under(path, roots))
    assert new == [], (line, "wrote outside --out and the cache", new)


@pytest.mark.parametrize("word", sorted(WORK))
def test_wrong_options_never_end_in_a_traceback_a_hang_or_a_stray_file(word, stand_ins):
    @FUZZ
    @given(args=command_args(word))
    def case(args):
        run_case(word, args, {})

    case()
    from mpsimpact.runs.head import installed_head_folder

    assert {p: p.read_bytes() for p in installed_head_folder().iterdir() if p in stand_ins} == stand_ins


@pytest.mark.parametrize("word", ["check", "list", "doctor"])
def test_wrong_environment_variables_never_end_in_a_traceback_a_hang_or_a_stray_file(word, stand_ins):
    args = {"check": [BERT], "list": [], "doctor": []}[word]

    @FUZZ
    @given(env=variables())
    def case(env):
        run_case(word, args, env)

    case()


def readers() -> dict:
    """Each variable's reader, called as the library calls it (not through the CLI's up-front check)."""
    from mpsimpact.engine.release import cache_root
    from mpsimpact.errors import said
    from mpsimpact.models.classifier import embedded_model_path
    from mpsimpact.variables import attention_budget, guard_mode, is_offline

    return {"MPSIMPACT_ATTENTION_BUDGET": attention_budget, "MPSIMPACT_GUARD": guard_mode,
            "MPSIMPACT_EMBEDDED_MODEL": embedded_model_path, "MPSIMPACT_CACHE": cache_root,
            "XDG_CACHE_HOME": cache_root, "HOME": cache_root, "UV_OFFLINE": is_offline, "PIP_NO_INDEX": is_offline,
            "COLUMNS": lambda: said("error", "a message of some words " * 9)}  # any width: never a failure


def test_each_variables_reader_returns_or_raises_one_line_naming_it(monkeypatch):
    from mpsimpact.errors import EnvironmentVariableError

    read = readers()

    @FUZZ
    @given(name=st.sampled_from(sorted(read)), value=VALUES)
    def case(name, value):
        here, folder = os.getcwd(), tempfile.mkdtemp(prefix="fz", dir="/tmp")
        try:
            os.chdir(folder)
            value = materialize(value).replace("\0", "")
            for other in VARIABLES:  # one variable at a time: the others as if unset (HOME: this folder)
                monkeypatch.delenv(other, raising=False)
            monkeypatch.setenv("HOME", folder)
            monkeypatch.setenv(name, value)
            try:
                read[name]()
            except EnvironmentVariableError as error:
                assert error.message.startswith(f"{name}=") and "\n" not in error.message, error.message
        finally:
            os.chdir(here)
            shutil.rmtree(folder, ignore_errors=True)

    case()


def test_each_file_reader_refuses_what_is_not_a_regular_file_in_one_line_and_never_blocks():
    from mpsimpact.bounds import FileProblemError, read_file_bytes
    from mpsimpact.engine.release import load_profile
    from mpsimpact.errors import MpsImpactError
    from mpsimpact.models.classifier import check_model_folder
    from mpsimpact.models.dataset import load_file
    from mpsimpact.prediction.meta_model import load_model_config
    from mpsimpact.upgrade.folders import load_folder

    def read(path: str) -> None:
        try:
            read_file_bytes(path, 1 << 20)
        except FileProblemError as error:
            raise MpsImpactError(str(error)) from None

    readers_ = {"bytes": read, "dataset": load_file, "profile": load_profile, "config": load_model_config,
                "model folder": check_model_folder, "run folder": load_folder}

    @FUZZ
    @given(reader=st.sampled_from(sorted(readers_)), value=st.sampled_from(THINGS) | VALUES,
           suffix=st.sampled_from(["", ".json", ".csv", "/config.json", "/report.json"]))
    def case(reader, value, suffix):
        here, folder = os.getcwd(), tempfile.mkdtemp(prefix="fz", dir="/tmp")
        try:
            os.chdir(folder)
            path = materialize(value) + (suffix if value in THINGS[:6] and suffix.startswith(".") else "")
            if value == "<folder>" and suffix.startswith("/"):
                os.mkfifo("folder" + suffix)  # a folder holding a FIFO where a file is expected
            with_bound(lambda: readers_[reader](path), f"{reader} of {path!r}")
        finally:
            os.chdir(here)
            shutil.rmtree(folder, ignore_errors=True)

    case()


def with_bound(call, what: str) -> None:
    """`call()` under HANG_BOUND_S: it may return or raise an MpsImpactError (one line), nothing else."""
    from mpsimpact.errors import MpsImpactError

    def hung(signum, frame):
        raise Hung(f"{what} ran past {HANG_BOUND_S} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_BOUND_S)
    try:
        call()
    except MpsImpactError as error:
        assert "\n" not in error.message, (what, error.message)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def constants(text: str) -> dict[str, str]:
    """NAME = "VALUE" assignments of upper-case strings at the start of a line."""
    return dict(re.findall(r'^\s*([A-Z_][A-Z0-9_]*)\s*=\s*"([A-Z][A-Z0-9_]+)"', text, re.M))


def read_variables(path: Path, shared: dict[str, str]) -> set[str]:
    """The environment variables a source file reads: names in os.environ / getenv calls (and variables.py's
    _value), directly or through a constant of that file or of mpsimpact.variables (`shared`, imported under
    any name)."""
    text = path.read_text()
    names = constants(text) | shared
    aliases = re.findall(r"\b([A-Z_]+) as ([A-Z_]+)\b", text)
    names |= {alias: shared[name] for name, alias in aliases if name in shared}
    found = set()
    for call in re.findall(r"(?:environ\.get|getenv|environ\[|_value)\(?\s*([A-Za-z_\"][\w\"]*)", text):
        name = call.strip('"')
        found.add(names.get(name, name))
    return {name for name in found if name.isupper() and name.replace("_", "").isalnum()}


def test_the_fuzzed_variables_are_every_one_the_code_reads():
    package = SRC / "src" / "mpsimpact"
    variables_py = (package / "variables.py").read_text()
    shared = constants(variables_py)
    offline = set(re.findall(r'"([A-Z][A-Z0-9_]+)"', re.search(r"^OFFLINE = \((.*?)\)", variables_py, re.M)[1]))
    read = offline.union(*(read_variables(path, shared) for path in [*package.rglob("*.py"),
                                                                      *SRC.joinpath("scenarios").rglob("*.py")]))
    # the reader finds them at all
    assert {"MPSIMPACT_ATTENTION_BUDGET", "MPSIMPACT_CACHE", "MPSIMPACT_EMBEDDED_MODEL", "UV_OFFLINE"} <= read
    assert read - set(VARIABLES) == set(), "a variable the code reads is not fuzzed: add it to VARIABLES"
