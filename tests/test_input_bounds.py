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
    assert result.stderr.count("\n") == 1 and LIMIT_WORDS in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_text_at_the_limit_is_fine(tmp_path):
    (tmp_path / "ok.csv").write_text(f"text,label\n{'z' * MAX_TEXT_CHARS},positive\n")
    assert len(load_file(str(tmp_path / "ok.csv")).texts[0]) == MAX_TEXT_CHARS
