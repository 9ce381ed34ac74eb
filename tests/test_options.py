"""Every command validates the options it shares with others in one way: each bad value of each
shared option is one line on stderr, exit code 2, no traceback, and nothing written."""

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.config import INDEX_BITS_RANGE

runner = CliRunner()
COMMANDS = {
    "run": ["run", "sentiment"],
    "plan": ["plan", "sentiment"],
    "sweep": ["sweep", "--device", "cpu"],
}
SHARED = {  # option -> (bad value, the message's start), and which commands take it
    "--index-bits": [("40", "--index-bits must be in 8..32 (32 is MPS), got 40."), ("7", "--index-bits must be in 8..32 (32 is MPS), got 7.")],
    "--batch-size": [("0", "--batch-size must be >= 1, got 0."), ("-3", "--batch-size must be >= 1, got -3.")],
    "--max-length": [("0", "--max-length must be >= 1, got 0.")],
    "--device": [("tpu", "--device must be one of auto, mps, cuda, cpu; got 'tpu'.")],
    "--torch-profile": [("newest", "--torch-profile: 'newest' is not a torch release (expected e.g. 2.12.1); give a release such as 2.12.1 "
                                   "(measured: 2.4.1 .. 2.14.0; others are judged conservatively) or 'conservative'.")],
}
TAKES = {
    "run": set(SHARED),
    "plan": {"--index-bits", "--batch-size", "--max-length", "--torch-profile"},
    "sweep": {"--index-bits", "--device", "--torch-profile"},
}
CASES = [(command, flag, value, message) for command, flags in TAKES.items() for flag in sorted(flags) for value, message in SHARED[flag]]


@pytest.mark.parametrize(("command", "flag", "value", "message"), CASES, ids=[f"{c}{f}={v}" for c, f, v, _ in CASES])
def test_each_bad_shared_option_is_one_line_and_exit_2(tmp_path, command, flag, value, message):
    args = [*COMMANDS[command], flag, value]
    if command != "plan":
        args += ["--out", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"error: {message}"
    assert "Traceback" not in result.output and not list(tmp_path.iterdir())


def test_index_bits_range_is_the_one_the_message_names():
    assert INDEX_BITS_RANGE == (8, 32)


def test_sweep_below_the_smallest_family_says_which_width_works(tmp_path):
    result = runner.invoke(app, ["sweep", "--device", "cpu", "--index-bits", "11", "--out", str(tmp_path / "s")])
    assert result.exit_code == 2
    assert "use a larger --index-bits, e.g. 20" in result.stderr and not (tmp_path / "s").exists()


def test_run_only_options_are_checked_too(tmp_path):
    for flag, value, message in (("--attention", "flash", "--attention must be one of eager, sdpa, both; got 'flash'."),
                                 ("--dtype", "int8", "--dtype must be one of float32, float16, bfloat16; got 'int8'.")):
        result = runner.invoke(app, ["run", "sentiment", flag, value, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}"
    assert not list(tmp_path.iterdir())


def test_plan_out_must_be_a_fresh_folder(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    result = runner.invoke(app, ["plan", "sentiment", "--versions", "--out", str(tmp_path / "taken")])
    assert result.exit_code == 2 and "already exists and is not empty" in result.stderr
    assert (tmp_path / "taken" / "x").read_text() == "keep me"
