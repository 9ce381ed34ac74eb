"""Values that used to get past every check: a config's label count (a billion labels filled 24 GB), its
model_type and architectures of the wrong type, a --max-memory too large for a float or below one byte, a
COLUMNS rich cannot lay out by, an attention budget of a fraction of a byte. Each is one line, exit 2, before
any work."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.errors import EnvironmentVariableError, ModelLoadError
from mpsimpact.prediction import meta_model
from mpsimpact.prediction.meta_model import MAX_CONFIG_LAYERS, MAX_LABELS, check_config_fields
from said import one_message

runner = CliRunner()
BERT = Path(__file__).parent / "data" / "bert-base"
GIB = 1 << 30


def config_with(tmp_path: Path, **fields) -> Path:
    """A copy of the BERT test config with `fields` set (a field set to None is removed)."""
    folder = tmp_path / "cfg"
    shutil.copytree(BERT, folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(fields)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return folder


def refused(args: list[str], env: dict | None = None) -> str:
    """The one message of a command refused with exit 2 (no traceback), its lines joined."""
    result = runner.invoke(app, args, env=env)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == "" and "Traceback" not in result.output, result.output
    return one_message(result.stderr)


# D1: per-label tables. MAX_LABELS + 1 costs a second if the bound is ever lost (a billion filled 24 GB).

def test_a_label_count_past_the_bound_is_refused_before_transformers_reads_it(tmp_path):
    said = refused(["check", str(config_with(tmp_path, num_labels=MAX_LABELS + 1)), "--out", str(tmp_path / "r")])
    assert "num_labels must be a whole number from 0 to 1,000,000" in said and f"got {MAX_LABELS + 1}" in said
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", ["5", 2.5, -1, True, [3]])
def test_a_label_count_that_is_not_a_whole_number_is_refused(value):
    with pytest.raises(ModelLoadError, match=r"num_labels must be a whole number from 0 to 1,000,000 .*got "):
        check_config_fields({"model_type": "bert", "num_labels": value}, "c.json")


@pytest.mark.parametrize("table", ["id2label", "label2id"])
def test_a_label_table_past_the_bound_or_not_an_object_is_refused(monkeypatch, table):
    monkeypatch.setattr(meta_model, "MAX_LABELS", 3)  # the bound, small: 4 entries are one too many
    with pytest.raises(ModelLoadError, match=f"'c.json': {table} has 4 labels, more than the 3 mpsimpact reads"):
        check_config_fields({"model_type": "bert", table: {str(i): i for i in range(4)}}, "c.json")
    with pytest.raises(ModelLoadError, match=rf"{table} must be an object .*got \[1, 2\]"):
        check_config_fields({"model_type": "bert", table: [1, 2]}, "c.json")
    check_config_fields({"model_type": "bert", table: {str(i): i for i in range(3)}}, "c.json")  # at the bound


def test_a_label_table_is_not_read_as_a_sub_config():
    # Labels named like config fields are names, not sizes: {"hidden_size": 0} in label2id is label 0.
    check_config_fields({"model_type": "bert", "label2id": {"hidden_size": 0, "model_type": 1},
                         "id2label": {"0": "hidden_size", "1": "model_type"}}, "c.json")


@pytest.mark.parametrize("name", ["num_mtp_layers", "num_residual_layers", "num_nextn_predict_layers",
                                  "first_k_dense_replace", "depth"])
def test_every_count_of_layers_is_bounded(name):
    # transformers makes a list entry or a module per layer for each of these (Mimi's residual layers, MTP).
    check_config_fields({"model_type": "bert", name: MAX_CONFIG_LAYERS}, "c.json")
    with pytest.raises(ModelLoadError, match=f"{name} is 100,000,000 layers, more than the 512 mpsimpact builds"):
        check_config_fields({"model_type": "bert", name: 10**8}, "c.json")


# D6: model_type and architectures of the wrong type.

@pytest.mark.parametrize(("fields", "words"), [
    ({"model_type": []}, 'model_type must be a string (a model type such as "bert"), got an empty list'),
    ({"model_type": 5}, "model_type must be a string (a model type such as \"bert\"), got 5"),
    ({"architectures": [5]}, "architectures must be a list of class names (such as [\"BertForMaskedLM\"]), got [5]"),
    ({"architectures": "BertForMaskedLM"}, 'architectures must be a list of class names (such as ["BertForMaskedLM"]), '
                                           'got "BertForMaskedLM"'),
    ({"architectures": {"a": 1}}, "architectures must be a list of class names"),
    ({"text_config": {"model_type": ["bert"]}}, "text_config.model_type must be a string"),
], ids=["model_type-list", "model_type-int", "architectures-int", "architectures-string", "architectures-object",
        "sub-config"])
def test_a_field_of_the_wrong_type_is_one_line_naming_it(tmp_path, fields, words):
    said = refused(["check", str(config_with(tmp_path, **fields)), "--out", str(tmp_path / "r")])
    assert said.startswith(f"error: '{tmp_path / 'cfg' / 'config.json'}': {words}") and said.endswith(
        "; check the config."), said
    assert not (tmp_path / "r").exists()


def test_fields_of_the_right_type_pass():
    check_config_fields({"model_type": "bert", "architectures": ["BertForMaskedLM"], "num_labels": 2,
                         "text_config": {"model_type": "bert", "architectures": None}}, "c.json")


# D4: --max-memory read exactly.

@pytest.mark.parametrize(("value", "words"), [
    ("9" * 400, "'99999999999999999999…99999999 (400 characters)' is more than 1,048,576 GiB (1 PiB), more than "
                "any machine has"),
    ("1048576.000001", "'1048576.000001' is more than 1,048,576 GiB (1 PiB), more than any machine has"),
    ("0.0000001M", "'0.0000001M' is 0.1 bytes, less than one byte"),
    ("0.0000000000001", "'0.0000000000001' is 0.00011 bytes, less than one byte"),
])
def test_a_max_memory_too_large_or_below_one_byte_is_one_line_and_exit_2(tmp_path, value, words):
    said = refused(["sweep", "--device", "cpu", "--emulate", "--max-memory", value, "--out", str(tmp_path / "s")])
    assert said == f"error: --max-memory: {words}; give a size such as 20 (GiB), 20GiB or 512MiB.", said
    assert not list(tmp_path.iterdir())


def test_max_memory_is_read_exactly():
    from mpsimpact.config import memory_bytes

    # A float reads 1048575.99999999999999999 GiB as 2**50 bytes; exactly it is one byte less (rounded down).
    assert memory_bytes("1048575.99999999999999999") == 2**50 - 1
    assert memory_bytes("1048576") == 2**50  # the bound itself
    assert memory_bytes("0.000000000931322574615478515625") == 1  # 2**-30 GiB, every decimal of it
    assert memory_bytes("0.1") == GIB // 10  # 107374182.4 bytes, rounded down
    assert memory_bytes("0" * 30 + "1") == GIB  # leading zeros are no digits of size


# D5: COLUMNS, checked before click reads the command line (rich lays out --help and usage errors by it).

@pytest.mark.parametrize(("value", "problem"), [
    ("²", "is not a whole number of columns"), ("0", "is out of range"), ("19", "is out of range"),
    (" 80", "is not a whole number of columns"), ("80.5", "is not a whole number of columns"),
    ("10001", "is out of range"), ("9" * 5000, "is out of range"),
])
@pytest.mark.parametrize("args", [["plan", "nosuch"], ["plan", "sentiment", "--batch-size", "16"], ["--help"],
                                  ["plan", "--batch-size", "x"]], ids=["error", "work", "help", "usage"])
def test_a_bad_columns_is_one_line_before_anything(value, problem, args):
    result = runner.invoke(app, args, env={"COLUMNS": value})
    assert result.exit_code == 2 and result.stdout == "", result.output
    shown = value if len(value) <= 80 else f"{value[:60]}… (5,000 characters)"
    assert result.stderr == (f"error: COLUMNS={shown!r} {problem}; give a whole number of columns from 20 to "
                             "10,000, e.g. 80, or unset it.\n")


@pytest.mark.parametrize("value", ["20", "80", "10000", "", "  "])
def test_a_good_columns_is_used(value):
    result = runner.invoke(app, ["plan", "nosuch"], env={"COLUMNS": value})
    assert result.exit_code == 2 and one_message(result.stderr).startswith("error: Unknown scenario 'nosuch'.")


def test_the_script_refuses_a_bad_columns_too():
    # The installed entry point (`python -m mpsimpact`, as `mpsimpact` is) goes through the same group.
    done = subprocess.run([sys.executable, "-m", "mpsimpact", "--help"], env={"COLUMNS": "0", "PATH": ""},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.startswith("error: COLUMNS='0' is out of range;"), done.stderr


# m1: an attention budget is a whole number of bytes.

@pytest.mark.parametrize(("value", "problem"), [("1.5", "is 1.5 bytes, not a whole number"),
                                                ("1.3K", "is 1331.2 bytes, not a whole number"),
                                                ("0.5", "is out of range"), ("٣", "is not a byte count")])
def test_an_attention_budget_that_is_not_whole_bytes_is_refused(monkeypatch, value, problem):
    from mpsimpact.variables import attention_budget

    monkeypatch.setenv("MPSIMPACT_ATTENTION_BUDGET", value)
    with pytest.raises(EnvironmentVariableError) as error:
        attention_budget()
    assert error.value.message.startswith(f"MPSIMPACT_ATTENTION_BUDGET={value!r} {problem}; give a whole number")
    said = refused(["plan", "nosuch"], env={"MPSIMPACT_ATTENTION_BUDGET": value})
    assert said.startswith(f"error: MPSIMPACT_ATTENTION_BUDGET={value!r} {problem};"), said


def test_an_attention_budget_in_whole_bytes_is_read_exactly(monkeypatch):
    from mpsimpact.variables import attention_budget

    for value, expected in (("1", 1), ("1.5K", 1536), ("0.5K", 512), (str(2**50), 2**50), ("1024G", 2**40)):
        monkeypatch.setenv("MPSIMPACT_ATTENTION_BUDGET", value)
        assert attention_budget() == expected, value
