"""Every input bounded and checked at the door, never a traceback: JSON nesting depth and NaN, one text-length
limit for every dataset format (said in the message), texts that are not Unicode, config sizes and dtypes for
`check` (refused before anything is built), and a full disk while writing (one line, nothing half-written)."""

import errno
import json
import os
import time

import pytest
from typer.testing import CliRunner

from mpsimpact.bounds import MAX_JSON_DEPTH, MAX_TEXT_CHARS, json_depth, parse_json
from mpsimpact.cli import app
from mpsimpact.errors import UsageError
from mpsimpact.models.dataset import load_file
from said import flat, messages, one_message

runner = CliRunner()
LONG = "x" * (MAX_TEXT_CHARS + 1)
LIMIT_WORDS = f"the text is {MAX_TEXT_CHARS + 1:,} characters long, more than the {MAX_TEXT_CHARS:,} a text may have"


def test_json_depth_counts_brackets_outside_strings_and_stops_early():
    assert json_depth('[{"a": "]]]\\"[[[", "b": [[1]]}]') == 4  # list, object, list, list
    assert json_depth("[" * 10**6, stop_above=5) == 6
    with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
        parse_json("[" * 100_000 + "]" * 100_000)
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(ValueError, match="is not a number JSON allows"):
            parse_json(f'{{"x": {constant}}}')
    assert parse_json('{"x": [1.5, "NaN"]}') == {"x": [1.5, "NaN"]}


# name -> (content, what the one line must say); each format meets the same text limit in the same words.
BAD = {
    "deep.json": ("[" * 100_000 + "]" * 100_000, f"nests lists or objects more than {MAX_JSON_DEPTH} levels deep"),
    "deep-field.jsonl": ('{"text": "a", "label": 0, "meta": ' + "[" * 5000 + "]" * 5000 + "}\n",
                         f"more than {MAX_JSON_DEPTH} levels deep"),
    "long.csv": (f"text,label\n{LONG},0\n", LIMIT_WORDS),
    "long.json": (json.dumps([{"text": LONG, "label": 0}]), LIMIT_WORDS),
    "long.jsonl": (json.dumps({"text": "fine", "label": 0}) + "\n" + json.dumps({"text": LONG, "label": 1}) + "\n",
                   LIMIT_WORDS),
    "surrogate.json": ('[{"text": "ok \\ud83d then", "label": 0}]',
                       "the text is not valid Unicode (a lone surrogate \\ud83d at character 4)"),
    "surrogate.jsonl": ('{"text": "\\udc00", "label": 0}\n', "a lone surrogate \\udc00 at character 1"),
    "nan-label.json": ('[{"text": "a", "label": NaN}]', "not valid JSON (NaN is not a number JSON allows)"),
}


@pytest.mark.parametrize("name", BAD, ids=list(BAD))
def test_a_dataset_past_a_bound_is_one_line_and_exit_2(tmp_path, name):
    content, words = BAD[name]
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UsageError) as error:
        load_file(str(path))
    assert words in error.value.message and "\n" not in error.value.message
    if name.startswith("long"):
        assert f"(every format has the same limit, {MAX_TEXT_CHARS:,} characters)" in error.value.message


def test_a_20_mb_text_is_refused_in_a_second_in_every_format(tmp_path):
    text = "y" * 20_000_000
    files = {"big.csv": f"text,label\n{text},0\n", "big.json": json.dumps([{"text": text, "label": 0}]),
             "big.jsonl": json.dumps({"text": text, "label": 0}) + "\n"}
    messages = []
    for name, content in files.items():
        (tmp_path / name).write_text(content)
        started = time.perf_counter()
        with pytest.raises(UsageError) as error:
            load_file(str(tmp_path / name))
        assert time.perf_counter() - started < 10, name  # about 0.3 s each here
        messages.append(error.value.message.split("field 'text': ")[1])
    assert len(set(messages)) == 1 and "20,000,000 characters long" in messages[0]  # one limit, one sentence


def test_the_cli_refuses_a_long_text_before_loading_any_model(tmp_path):
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": LONG, "label": 0}) + "\n")
    result = runner.invoke(app, ["run", "sentiment", "--quick", "--dataset", str(tmp_path / "long.jsonl"),
                                 "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert LIMIT_WORDS in one_message(result.stderr) and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_text_at_the_limit_is_fine(tmp_path):
    (tmp_path / "ok.csv").write_text(f"text,label\n{'z' * MAX_TEXT_CHARS},positive\n")
    assert len(load_file(str(tmp_path / "ok.csv")).texts[0]) == MAX_TEXT_CHARS


# `check` of a config past a bound: one line, exit 2, before anything is built (each in a second or two).
BERT = json.loads(open(os.path.join(os.path.dirname(__file__), "data", "bert-base", "config.json")).read())
CONFIGS = {
    "hidden 1e12": ({"hidden_size": 12 * 10**11}, "hidden_size is 1,200,000,000,000, more than any size a model has"),
    "1e9 layers": ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1,000,000,000 layers, more than the 512"),
    "513 layers": ({"num_hidden_layers": 513}, "num_hidden_layers is 513 layers"),
    "huge vocabulary": ({"vocab_size": 2**31 - 1, "hidden_size": 12288, "num_attention_heads": 96},
                        "its sizes imply about 5.3e+13 parameters, more than any model (1e+13)"),
    "nested": ({"text_config": {"intermediate_size": 2**40}}, "text_config.intermediate_size is 1,099,511,627,776"),
    "dtype banana": ({"torch_dtype": "banana"}, 'torch_dtype is "banana", not a dtype models are built in here'),
    "dtype float8": ({"dtype": "float8_e4m3fn"}, 'dtype is "float8_e4m3fn", not a dtype models are built in here'),
    "dtype Tensor": ({"dtype": "Tensor"}, 'dtype is "Tensor"'),
    "dtype int": ({"dtype": "int64"}, 'dtype is "int64"'),
    "deep": ({"extra": json.loads("[" * 60 + "]" * 60), "more": json.loads("[" * 10 + "]" * 10)}, None),
}


@pytest.mark.parametrize("name", CONFIGS, ids=list(CONFIGS))
def test_check_refuses_a_config_past_a_bound_before_building(tmp_path, name, monkeypatch):
    change, words = CONFIGS[name]
    if name == "deep":  # 70 levels of lists in one field: past MAX_JSON_DEPTH
        (tmp_path / "config.json").write_text(json.dumps(BERT)[:-1] + ', "deep": ' + "[" * 70 + "]" * 70 + "}")
        words = f"nested more than {MAX_JSON_DEPTH} levels deep"
    else:
        (tmp_path / "config.json").write_text(json.dumps(BERT | change))
    import mpsimpact.prediction.check as check  # imported before the patch, so it keeps its own name unpatched after
    import mpsimpact.prediction.meta_model as meta_model

    for module in (meta_model, check):  # check.py calls the name it imported
        monkeypatch.setattr(module, "build_meta_model", lambda *a: pytest.fail("built a model"))
    started = time.perf_counter()
    result = runner.invoke(app, ["check", str(tmp_path), "--batch-size", "2"])
    assert result.exit_code == 2, result.output
    assert words in one_message(result.stderr), result.stderr
    assert "Traceback" not in result.output and time.perf_counter() - started < 30


def test_the_bounds_leave_real_configs_alone(tmp_path):
    from mpsimpact.prediction.meta_model import check_config_fields

    for name in ("bert-base", "llama-style-32k", "t5-base", "twitter-roberta-base-sentiment-latest"):
        path = os.path.join(os.path.dirname(__file__), "data", name, "config.json")
        check_config_fields(json.loads(open(path).read()), path)
    # Llama-3.1-405B's sizes: 126 layers of 16384, 53248 inner, 128256 tokens: about 4.6e11 parameters.
    check_config_fields({"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                         "vocab_size": 128256, "dtype": "bfloat16"}, "405b")


# A full disk (ENOSPC) while writing: the write goes to /dev/full, which fails every write with ENOSPC.
def fill_disk_for(monkeypatch, suffix):
    import tempfile

    import mpsimpact.output.files as files

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        if name.split(".partial")[0].endswith(suffix) or f"{suffix}." in os.path.basename(name):
            os.close(fd)
            fd = os.open("/dev/full", os.O_WRONLY)
        return fd, name

    monkeypatch.setattr(files.tempfile, "mkstemp", mkstemp)


def test_a_full_disk_while_writing_a_figure_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    fill_disk_for(monkeypatch, ".png")
    figure = tmp_path / "fig.png"
    result = runner.invoke(app, ["plan", "sentiment", "--sweep", "--figure", str(figure)])
    assert result.exit_code == 2, result.output
    assert one_message(result.stderr) and "Traceback" not in result.output
    assert f"No space left to write '{figure}'" in flat(result.stderr) and "Nothing was left half-written" in flat(result.stderr)
    assert os.listdir(tmp_path) == []  # no figure, no temporary file


def test_a_full_disk_while_writing_a_run_folder_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    fill_disk_for(monkeypatch, "error_by_position.png")
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", "sentiment", "--quick", "--guard", "off", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert messages(result.stderr)[-1].startswith("error: No space left to write ")
    assert "error_by_position.png" in flat(result.stderr) and "Traceback" not in result.output
    assert sorted(os.listdir(tmp_path)) == ["cache"]  # no report folder, no partial folder, no claim


def test_a_disk_without_room_for_the_report_is_refused_before_any_work(tmp_path, monkeypatch):
    import mpsimpact.output.files as files

    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: type("U", (), {"free": 20 << 20})())
    result = runner.invoke(app, ["run", "sentiment", "--batch-size", "8192", "--guard", "all",
                                 "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and one_message(result.stderr), result.output
    # 4 MiB of pages and figures + 8192 texts x 3 conditions x 1 KiB of samples and logits = 28 MiB
    assert "is on a disk with 20 MiB free, and this command writes up to 28 MiB there" in flat(result.stderr)
    assert not (tmp_path / "out").exists()
