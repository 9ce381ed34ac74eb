"""Nothing lost, part three (issue #47): a FIFO, a socket, a device node, a dangling link or a folder where a file
is expected is refused in one line naming it, never opened or written over (Note [Only regular files]); reads
are bounded with the bound said; names too long for the file system are one line; every environment variable
mpsimpact reads is checked where it is read. Each case is refused before anything heavy runs."""

import json
import os
import signal
import socket
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpsimpact.bounds import FileProblemError, name_problem, path_problem, read_file_bytes
from mpsimpact.cli import app
from mpsimpact.errors import EnvironmentVariableError, UsageError
from mpsimpact.output.files import atomic_write_bytes
from said import messages, one_message

runner = CliRunner()
DATA = Path(__file__).parent / "data"
BERT = DATA / "bert-base"  # a config.json alone: `check` traces it on meta
HANG_BOUND_S = 60  # a case that blocks (a FIFO opened for reading) fails here instead of hanging the suite
WORDS = {  # what each kind of thing is called in the one line
    "fifo": "is a FIFO (named pipe), not a regular file",
    "socket": "is a socket, not a regular file",
    "device": "is a character device, not a regular file",
    "dangling": "is a symbolic link to",
    "folder": "is a folder",
}


@pytest.fixture(autouse=True)
def _bounded_and_hermetic(tmp_path, monkeypatch):
    """Every test here runs in its own folder and cache, and fails (never hangs) past HANG_BOUND_S."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))

    def hung(signum, frame):
        raise AssertionError(f"blocked for {HANG_BOUND_S} s: something opened a FIFO or waited forever")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_BOUND_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def make(kind: str, name: str = "thing") -> Path:
    """A thing of `kind` named `name` in the current folder (a socket's path must be short: it is relative)."""
    path = Path(name)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(name)
        server.close()  # the socket file stays
    elif kind == "device":
        path.symlink_to("/dev/null")  # a link to a character device: followed when read
    elif kind == "dangling":
        path.symlink_to("nowhere-at-all")
    elif kind == "folder":
        path.mkdir()
    elif kind == "file":
        path.write_bytes(b"keep me")
    return path


def fingerprint(path: Path) -> tuple:
    """What must not change about a thing the user pointed at: its kind, its link target, its bytes if a file."""
    mode = os.lstat(path).st_mode
    target = os.readlink(path) if stat.S_ISLNK(mode) else None
    data = path.read_bytes() if stat.S_ISREG(mode) else None
    return stat.S_IFMT(mode), target, data


def invoke(args, env=None):
    result = runner.invoke(app, [str(a) for a in args], env=env)
    return result, result.stderr if result.stderr_bytes else ""


def one_line(result, stderr: str) -> str:
    """The single error line of a refused command (exit 2, no traceback)."""
    assert result.exit_code == 2, (result.exit_code, result.output, stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return one_message(stderr) + "\n"


# Reading: looked at with stat first, never opened unless a regular file; bounded, the bound said.

@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "dangling", "folder"])
def test_a_path_that_is_not_a_regular_file_is_named_and_never_opened(kind):
    path = make(kind)
    assert WORDS[kind] in path_problem(path)
    with pytest.raises(FileProblemError) as error:
        read_file_bytes(path, 100)  # a FIFO opened for reading would block here (no writer)
    assert WORDS[kind] in str(error.value)


def test_a_read_is_bounded_and_says_its_bound():
    Path("big").write_bytes(b"x" * 101)
    with pytest.raises(FileProblemError, match="is 101 bytes, more than the 100 a note may have"):
        read_file_bytes("big", 100, "a note")
    assert read_file_bytes("big", 101) == b"x" * 101
    assert path_problem("absent") == "does not exist"


def test_names_too_long_for_the_file_system_are_said_before_any_system_call():
    # 300 bytes > NAME_MAX (255); 25 names of 200 bytes = 5,024 bytes > PATH_MAX (4,096)
    assert "has a name of 300 bytes" in name_problem("a" * 300)
    assert "more than the 4,095 a path may have" in name_problem("/".join(["b" * 200] * 25))
    assert "NUL" in name_problem("a\0b")
    assert name_problem("a" * 255) is None
    assert "has a name of 300 bytes" in path_problem("a" * 300)


# Writing: beside the target, renamed only over a regular file or nothing.

@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "dangling", "folder"])
def test_a_write_never_replaces_what_is_not_a_regular_file(kind):
    path = make(kind)
    before = fingerprint(path)
    with pytest.raises(UsageError) as error:
        atomic_write_bytes(path, b"png")
    assert "mpsimpact writes a file only where there is none or over a regular file" in error.value.message
    assert fingerprint(path) == before
    assert os.listdir() == ["thing"]  # no temporary file left beside it


def test_a_write_replaces_a_regular_file_and_creates_a_new_one():
    make("file")
    atomic_write_bytes(Path("thing"), b"new")
    atomic_write_bytes(Path("fresh"), b"made")
    assert Path("thing").read_bytes() == b"new" and Path("fresh").read_bytes() == b"made"


@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "dangling", "folder"])
def test_plan_refuses_a_figure_that_is_not_a_regular_file_and_leaves_it_as_it_was(kind):
    path = make(kind, "figure.png")
    before = fingerprint(path)
    result, stderr = invoke(["plan", "sentiment", "--sweep", "--figure", path])
    assert f"--figure '{path}'" in one_line(result, stderr)
    assert fingerprint(path) == before  # the issue: a FIFO, device node or dangling link became a PNG


def test_long_names_in_out_and_figure_are_one_line_before_any_work():
    name, deep = "a" * 300, "/".join(["b" * 200] * 25)
    cases = [
        (["plan", "sentiment", "--sweep", "--figure", f"{name}.png"], "has a name of 304 bytes"),
        (["check", BERT, "--out", name], "has a name of 300 bytes"),
        (["check", BERT, "--out", f"/tmp/{deep}"], "more than the 4,095 a path may have"),
        (["run", "sentiment", "--quick", "--out", name], "has a name of 300 bytes"),
        (["sweep", "--quick", "--out", name], "has a name of 300 bytes"),
        (["compare", "a", "b", "--out", name], "has a name of 300 bytes"),
        (["check", BERT, "--out", "c" * 250], "the partial folder written beside it first"),
        (["check", f"/tmp/{deep}"], "more than the 4,095 a path may have"),
        (["run", "sentiment", "--quick", "--dataset", f"{name}.csv", "--out", "o"], "has a name of 304 bytes"),
    ]
    for args, words in cases:
        result, stderr = invoke(args)
        assert words in one_line(result, stderr), args
        assert "…" in stderr  # the long name is cut in the middle, not printed whole
    assert sorted(os.listdir()) == []  # nothing was created


def test_check_of_a_fifo_config_or_a_folder_whose_config_is_a_fifo_is_one_line():
    make("fifo", "config.json")
    Path("model").mkdir()
    os.mkfifo("model/config.json")
    result, stderr = invoke(["check", "config.json"])
    assert "Model 'config.json' is a FIFO (named pipe), not a regular file" in one_line(result, stderr)
    result, stderr = invoke(["check", "model"])
    assert "Folder 'model': its config.json is a FIFO (named pipe)" in one_line(result, stderr)


@pytest.mark.parametrize("kind", ["fifo", "dangling", "folder"])
def test_a_torch_profile_that_is_not_a_regular_file_is_refused_at_the_boundary(kind):
    path = make(kind, "profile.json")
    result, stderr = invoke(["check", BERT, "--torch-profile", path])
    assert f"Profile '{path.absolute()}' {WORDS[kind]}" in one_line(result, stderr)


def test_a_profile_is_read_only_below_its_bounds(tmp_path):
    from mpsimpact.engine.profile_file import MAX_NOTES, MAX_PROFILE_BYTES

    Path("huge.json").write_text(json.dumps({"kind": "mpsimpact-fault-profile", "notes": ["n" * 80] * 150_000}))
    result, stderr = invoke(["check", BERT, "--torch-profile", "./huge.json"])
    assert f"bytes, more than the {MAX_PROFILE_BYTES:,} a profile may have" in one_line(result, stderr)
    from test_profile_fit import derived  # a real profile, then one note too many

    content = derived("2.13.0", bits=20) | {"notes": ["a note"] * (MAX_NOTES + 1)}
    Path("notes.json").write_text(json.dumps(content))
    result, stderr = invoke(["check", BERT, "--torch-profile", "./notes.json"])
    assert f"'notes' must be a list of at most {MAX_NOTES} texts" in one_line(result, stderr)
    assert "… (" in stderr  # the 101 notes are not printed whole


def test_a_cached_profile_that_is_a_fifo_is_one_line_not_a_hang_nor_ignored():
    import torch

    from mpsimpact.engine.profile_file import ProfileFileError
    from mpsimpact.engine.release import cached_profile_path, installed_profile, parse_version

    cached = cached_profile_path(".".join(map(str, parse_version(torch.__version__))))
    cached.parent.mkdir(parents=True)
    os.mkfifo(cached)
    with pytest.raises(ProfileFileError, match="is a FIFO"):
        installed_profile()


def test_a_dataset_that_is_a_fifo_says_so_not_that_it_does_not_exist():
    from mpsimpact.models.dataset import load_file

    make("fifo", "data.csv")
    with pytest.raises(UsageError) as error:
        load_file("data.csv")
    assert error.value.message == ("Dataset file 'data.csv' is a FIFO (named pipe), not a regular file; pass a "
                                   ".csv, .json or .jsonl file.")


def test_compare_of_a_folder_whose_report_is_a_fifo_is_one_line():
    for side in ("old", "new"):
        Path(side).mkdir()
        os.mkfifo(f"{side}/report.json")
    result, stderr = invoke(["compare", "old", "new"])
    assert "'old/report.json' is a FIFO (named pipe), not a regular file" in one_line(result, stderr)


def test_a_fifo_in_the_reference_cache_is_passed_by_with_one_warning_and_left_alone(capsys):
    import numpy as np

    from mpsimpact.runs import reference

    entry = reference.entry_path("k" * 24)
    entry.parent.mkdir(parents=True)
    os.mkfifo(entry)
    assert reference.cached_reference("k" * 24) is None
    assert not reference.store_reference("k" * 24, np.ones((2, 3), dtype=np.float32))
    assert "is a FIFO (named pipe), not a regular file; computing the reference without the cache" in " ".join(
        messages(capsys.readouterr().err))
    assert stat.S_ISFIFO(os.lstat(entry).st_mode)


MODEL_FOLDERS = {  # what the folder holds -> what the one line says
    "no weights": ({"config.json": json.dumps({"model_type": "bert"})}, "has no weights (model.safetensors or "
                                                                       "pytorch_model.bin)"),
    "empty config": ({"config.json": "", "model.safetensors": "x"}, "has a config.json that is not JSON"),
    "no config": ({"model.safetensors": "x"}, "has no config.json"),
    "not a config": ({"config.json": "[1, 2]", "model.safetensors": "x"},
                     "has a config.json without a model_type"),
    "fifo tokenizer": ({"config.json": json.dumps({"model_type": "bert"}), "model.safetensors": "x",
                        "tokenizer.json": None}, "holds 'tokenizer.json', which is a FIFO (named pipe)"),
}


@pytest.mark.parametrize("case", MODEL_FOLDERS, ids=list(MODEL_FOLDERS))
def test_a_model_folder_that_cannot_load_is_named_before_transformers_reads_it(case, monkeypatch):
    from mpsimpact.errors import ModelLoadError
    from mpsimpact.models.classifier import check_model_folder, embedded_model_path

    entries, words = MODEL_FOLDERS[case]
    Path("model").mkdir()
    for name, content in entries.items():
        os.mkfifo(f"model/{name}") if content is None else Path("model", name).write_text(content)
    with pytest.raises(ModelLoadError) as error:  # was "is not a local path" for a folder without weights
        check_model_folder("model")
    assert error.value.message.startswith(f"Model folder 'model' {words}")
    monkeypatch.setenv("MPSIMPACT_EMBEDDED_MODEL", "model")
    with pytest.raises(EnvironmentVariableError) as error:
        embedded_model_path()
    assert error.value.message.startswith(f"MPSIMPACT_EMBEDDED_MODEL='model' {words}")


# Environment variables: a bad value is one line naming the variable, the value and what is accepted; exit 2.

BAD_VARIABLES = [
    ("MPSIMPACT_ATTENTION_BUDGET", value, "is not a byte count")
    for value in ("banana", "inf", "-1", "nan", "1e400")
] + [
    ("MPSIMPACT_ATTENTION_BUDGET", "0", "is out of range"),
    ("MPSIMPACT_ATTENTION_BUDGET", "9" * 30, "is out of range"),
    ("MPSIMPACT_GUARD", "banana", "is not a guard mode; give one of raise, warn, chunk, off"),
    ("UV_OFFLINE", "banana", "is neither true nor false"),
    ("PIP_NO_INDEX", "maybe", "is neither true nor false"),
    ("MPSIMPACT_EMBEDDED_MODEL", "m" * 300, "has a name of 300 bytes"),
    ("MPSIMPACT_CACHE", "c" * 300, "makes a cache folder that has a name of 300 bytes"),
    ("XDG_CACHE_HOME", "/" + "x" * 300, "makes a cache folder that has a name of 300 bytes"),
]


@pytest.mark.parametrize(("name", "value", "words"), BAD_VARIABLES,
                         ids=[f"{n}={v[:8]}" for n, v, _ in BAD_VARIABLES])
def test_a_bad_environment_variable_is_one_line_naming_it_before_any_work(name, value, words):
    env = {name: value} | ({"MPSIMPACT_CACHE": ""} if name == "XDG_CACHE_HOME" else {})
    result, stderr = invoke(["check", BERT, "--out", "report"], env=env)
    line = one_line(result, stderr)
    assert line.startswith(f"error: {name}='{value[:60]}") and words in line and line.rstrip().endswith(
        ", or unset it."), line
    assert not Path("report").exists()


def test_the_budget_accepts_what_it_says_it_accepts(monkeypatch):
    from mpsimpact.variables import attention_budget

    for value, expected in (("268435456", 268435456), ("256M", 256 << 20), ("1g", 1 << 30), ("1 GiB", 1 << 30),
                            ("1.5K", 1536), ("", None)):
        monkeypatch.setenv("MPSIMPACT_ATTENTION_BUDGET", value)
        assert attention_budget() == expected, value


def test_the_guard_variable_is_checked_where_the_library_reads_it(monkeypatch):
    import mpsimpact

    monkeypatch.setenv("MPSIMPACT_GUARD", "banana")
    with pytest.raises(EnvironmentVariableError, match="MPSIMPACT_GUARD='banana' is not a guard mode"):
        mpsimpact.install_thread_guard()
    monkeypatch.setenv("MPSIMPACT_GUARD", "off")
    assert mpsimpact.install_thread_guard() is None


def test_the_embedded_model_variable_names_a_folder_without_weights_in_one_line(tmp_path):
    Path("copy").mkdir()
    Path("copy/config.json").write_text(json.dumps({"model_type": "bert"}))
    result, stderr = invoke(["plan", "sentiment"], env={"MPSIMPACT_EMBEDDED_MODEL": "copy"})
    assert one_line(result, stderr).startswith("error: MPSIMPACT_EMBEDDED_MODEL='copy' has no weights")
    Path("empty").mkdir()
    Path("empty/config.json").write_text("")
    result, stderr = invoke(["plan", "sentiment"], env={"MPSIMPACT_EMBEDDED_MODEL": "empty"})
    assert "MPSIMPACT_EMBEDDED_MODEL='empty' has a config.json that is not JSON" in one_line(result, stderr)


def test_a_relative_xdg_cache_home_is_ignored_as_the_xdg_specification_says(monkeypatch, tmp_path):
    from mpsimpact.engine.release import cache_root

    monkeypatch.delenv("MPSIMPACT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_root() == Path.home() / ".cache" / "mpsimpact"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an existing folder: nothing is made above the cache
    assert cache_root() == tmp_path / "mpsimpact"


# Integers and numbers: every one range-checked at the boundary, in the words the CLI uses elsewhere.

HUGE = str(10**30)
NUMBERS = [  # (command line, the one line)
    (["run", "sentiment", "--quick", "--seed", "1180591620717411303424"],
     "--seed must be <= 18,446,744,073,709,551,615 (what torch.manual_seed takes), got 1180591620717411303424."),
    (["run", "sentiment", "--quick", "--seed", "-1"],
     "--seed must be >= 0 (what torch.manual_seed takes), got -1."),
    (["run", "sentiment", "--quick", "--batch-size", HUGE], f"--batch-size must be <= 2,147,483,647, got {HUGE}."),
    (["plan", "sentiment", "--batch-size", HUGE], f"--batch-size must be <= 2,147,483,647, got {HUGE}."),
    (["check", BERT, "--batch-size", HUGE], f"--batch-size must be <= 2,147,483,647, got {HUGE}."),
    (["check", BERT, "--seq-len", HUGE], f"--seq-len must be <= 2,147,483,647, got {HUGE}."),
    (["matrix", "sentiment", "--max-length", HUGE], f"--max-length must be <= 2,147,483,647, got {HUGE}."),
    (["run", "sentiment", "--quick", "--run-length", str(10**9)],
     "--run-length 1,000,000,000 is more than the length asked (256, --max-length or the scenario's); give at "
     "most 256: the device passes run at --run-length, the plan at --max-length."),
    (["run", "sentiment", "--quick", "--lr", "inf"],
     "--lr must be a number > 0, written with the digits 0-9 (such as 0.5 or 1e-4), got 'inf'."),
    (["run", "sentiment", "--quick", "--threshold", "nan"],
     "--threshold must be a number in (0, 1), written with the digits 0-9 (such as 0.5 or 1e-4), got 'nan'."),
    (["run", "sentiment", "--quick", "--threshold", "1e400"], "--threshold must be a finite number in (0, 1), got "
                                                              "1e400."),
    (["run", "sentiment", "--quick", "--steps", str(10**6)], "--steps must be <= 1000, got 1000000."),
    (["train-head", "--limit", HUGE, "--out", "head"], f"--limit must be <= 2,147,483,647, got {HUGE}."),
]


@pytest.mark.parametrize(("args", "line"), NUMBERS, ids=[" ".join(a[:1] + a[-2:-1]) for a, _ in NUMBERS])
def test_a_number_out_of_range_is_one_line_naming_the_option(args, line):
    result, stderr = invoke(args)
    assert one_line(result, stderr) == f"error: {line}\n"
    assert os.listdir() == []  # nothing written: no report folder, no head


def test_the_bounds_themselves_are_accepted():
    from mpsimpact.config import MAX_COUNT, MAX_SEED, CheckConfig, RunConfig

    RunConfig(seed=MAX_SEED, batch_size=MAX_COUNT, max_length=512, run_length=512).validate()
    CheckConfig(model="m", batch_size=MAX_COUNT, seq_len=MAX_COUNT).validate()


def test_a_run_length_past_the_scenarios_own_length_is_refused_where_that_length_is_known():
    from mpsimpact.config import check_run_length

    check_run_length(512, 512)
    check_run_length(64, None)  # the scenario's length is not known yet: checked again when it is
    with pytest.raises(UsageError, match="--run-length 1,000 is more than the length asked"):
        check_run_length(1000, 512)  # what runs.device_pass asks with the scenario's --max-length


# No silent defaults: an empty --out is refused everywhere; train-head writes a folder of its own.

@pytest.mark.parametrize("words", [["run", "sentiment", "--quick"], ["plan", "sentiment", "--versions"],
                                   ["check", BERT], ["sweep"], ["compare", "a", "b"], ["matrix", "sentiment"],
                                   ["train-head"]])
def test_an_empty_out_is_refused_by_every_command(words):
    from mpsimpact.runs.head import installed_head_folder

    def head() -> dict:
        return {p.name: p.read_bytes() for p in installed_head_folder().iterdir() if p.name.startswith("sentiment")}

    installed = head()
    result, stderr = invoke([*words, "--out", ""])
    assert one_line(result, stderr) == ("error: --out is given an empty value (''); give a value, or leave --out "
                                        "out.\n")
    assert head() == installed
    assert os.listdir() == []


@pytest.mark.parametrize("out", [".", "sub/..", "./", os.getcwd])
@pytest.mark.parametrize("words", [["run", "sentiment", "--quick"], ["check", BERT]])
def test_the_current_folder_as_out_is_refused_before_any_work_and_creates_nothing(words, out):
    # The report replaces its folder whole at the end (a partial folder beside it first): the folder the shell
    # stands in cannot be replaced, and a partial folder inside it made the finished run fail at the end.
    out = out() if callable(out) else out
    result, stderr = invoke([*words, "--out", out])
    assert one_line(result, stderr) == (f"error: --out '{out}' is the current folder (or holds it), which the report "
                                        "cannot replace while you are in it; pass a new folder's name, e.g. --out "
                                        "report.\n")
    assert os.listdir() == []  # no sub/, no partial folder


def test_a_figure_inside_plans_out_folder_is_refused_before_any_work():
    os.mkdir("pf")
    result, stderr = invoke(["plan", "sentiment", "--sweep", "--figure", "pf/fig.png", "--out", "pf"])
    assert one_line(result, stderr) == ("error: --figure 'pf/fig.png' is inside --out 'pf', which is written whole "
                                        "at the end; put the figure beside it.\n")
    assert os.listdir("pf") == []


def test_train_head_writes_a_new_folder_by_default_and_the_installed_head_only_with_install(monkeypatch):
    import mpsimpact.runs.head as head

    calls = []

    def fake_train(out_dir, *, limit=None, steps=None):  # the routing alone: training is tested in test_commands
        calls.append(out_dir)
        if out_dir is not None:
            (Path(out_dir) / "sentiment_head.npz").write_bytes(b"npz")
        return {"heldout_accuracy": 0.5, "heldout_texts": 3, "train_texts": 3}

    monkeypatch.setattr(head, "train_head", fake_train)
    result, stderr = invoke(["train-head"])
    assert result.exit_code == 0, (result.output, stderr)
    (folder,) = Path("outputs").iterdir()
    assert folder.name.startswith("train-head-") and (folder / "sentiment_head.npz").read_bytes() == b"npz"
    assert "the installed head is unchanged (--install replaces it)" in result.output
    result, stderr = invoke(["train-head", "--install"])
    assert result.exit_code == 0 and calls[-1] is None and "Replaced the installed head in" in result.output
    result, stderr = invoke(["train-head", "--install", "--out", "x"])
    assert "--install replaces the installed head in place; it takes no --out" in one_line(result, stderr)
    assert len(calls) == 2


def test_progress_in_a_log_says_the_time_left_as_an_estimate():
    from mpsimpact.output.progress import log_steps

    said, now = [], [100.0]
    advance = log_steps(lambda line, **_: said.append(line), clock=lambda: now[0])("Embedding 8 texts", 8)
    now[0] += 3
    advance(2)  # a quarter done in 3 s: 3 quarters left, about 9 s
    now[0] += 9
    advance(6)
    assert said == ["Embedding 8 texts: started (8 steps)", "Embedding 8 texts: 2/8 (3 s, about 9 s left)",
                    "Embedding 8 texts: 8/8 (12 s)"]


# `check`: a search that stops at its own bound says "at least"; a search whose extra trace fails leaves the
# asked geometry answered and says which part could not be searched.

def write_config(folder: str, config) -> str:
    Path(folder).mkdir()
    config.to_json_file(f"{folder}/config.json")
    return folder


def check_json(*args) -> dict:
    """check.json as `check --out` writes it (stdout may carry transformers' logging: a handler another
    test's CliRunner left behind)."""
    out = f"report-{len(os.listdir())}"
    result, stderr = invoke(["check", *args, "--out", out])
    assert result.exit_code == 0, (result.output, stderr)
    return json.loads(Path(out, "check.json").read_text())


def test_a_batch_search_that_reaches_its_ceiling_answers_at_least():
    from transformers import BertConfig

    from mpsimpact.config import BATCH_CEILING

    tiny = write_config("tiny", BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                           intermediate_size=32, max_position_embeddings=1, vocab_size=100))
    report = check_json(tiny, "--batch-size", "40000000")
    assert report["prediction"]["outcome"] == "clean"
    # the issue: "predicted: clean" yet "largest safe batch: 16777216", the search's cap (2**24), not an answer
    assert report["largest_safe_batch"] == 40_000_000 and report["largest_safe_batch_search"]["at_least"]
    result, _ = invoke(["check", tiny])
    said = " ".join(result.output.split())
    assert f"largest safe batch: at least {BATCH_CEILING} samples at 1 token" in said
    result, _ = invoke(["check", tiny, "--verbose"])  # the search's basis: --verbose and the files
    said = " ".join(result.output.split())
    assert (f"largest safe batch: at least {BATCH_CEILING} samples at 1 token (every size up to {BATCH_CEILING:,} is "
            "clean;") in said


def test_check_answers_the_asked_geometry_when_only_a_trace_of_a_search_fails():
    from transformers import BigBirdConfig

    # BigBird's block-sparse attention turns full below 704 tokens, whose mask code cannot run on meta: the
    # length search's first trace (64 tokens) fails, the asked 4096 tokens trace.
    sparse = write_config("bigbird", BigBirdConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                                                   intermediate_size=64, vocab_size=100))
    report = check_json(sparse, "--seq-len", "4096")
    assert report["prediction"]["outcome"] == "clean" and report["geometry"]["seq_len"] == 4096
    search = report["longest_safe_length_search"]
    assert report["longest_safe_length"] is None
    assert search["basis"].startswith("not searched: a trace the search needs failed (Cannot trace BigBirdModel")
    assert "length 64" in search["basis"]


def test_a_search_that_fails_is_said_and_other_errors_are_not_swallowed():
    from mpsimpact.errors import ModelLoadError
    from mpsimpact.prediction.check import searched
    from mpsimpact.prediction.safe_size import BoundarySearch

    def failing():
        raise ModelLoadError("Cannot trace X at length 64")

    found = searched(512, failing)
    assert (found.largest_safe, found.high) == (None, 512) and "Cannot trace X at length 64" in found.basis
    assert searched(512, lambda: BoundarySearch(7, 512, "b")).largest_safe == 7
    with pytest.raises(ZeroDivisionError):  # a bug stays a traceback
        searched(512, lambda: 1 // 0)


def test_a_value_holding_a_newline_still_makes_one_line():
    # found by tests/test_fuzz_options.py: `mpsimpact matrix $'\n'` printed its refusal on two lines
    result, stderr = invoke(["run", "senti\nment"])
    assert one_line(result, stderr) == ("error: Unknown scenario 'senti\\nment'. Did you mean 'sentiment'? "
                                        "Available: finetune, retrieval, sentiment.\n")


def test_a_real_device_node_is_neither_written_over_nor_taken_for_a_folder(monkeypatch):
    try:
        os.mknod("null", stat.S_IFCHR | 0o644, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("making a device node needs root (the link to /dev/null cases run everywhere)")
    result, stderr = invoke(["plan", "sentiment", "--sweep", "--figure", "null"])
    assert "--figure 'null' is a character device, not a regular file" in one_line(result, stderr)
    assert stat.S_ISCHR(os.lstat("null").st_mode)
    from mpsimpact.models.classifier import embedded_model_path

    monkeypatch.setenv("MPSIMPACT_EMBEDDED_MODEL", "null")
    with pytest.raises(EnvironmentVariableError, match="MPSIMPACT_EMBEDDED_MODEL='null' is a character device, "
                                                       "not a folder"):
        embedded_model_path()


def test_a_release_named_like_a_folder_here_is_still_a_release_and_a_fifo_named_like_one_is_refused():
    from mpsimpact.engine.profile_file import ProfileFileError
    from mpsimpact.engine.release import resolve_profile

    Path("2.13.0").mkdir()  # an output folder named after the release it ran (test_console_width does so)
    assert resolve_profile("2.13.0").release == "2.13.0"
    os.mkfifo("p")
    with pytest.raises(ProfileFileError, match="is a FIFO"):
        resolve_profile("p")
