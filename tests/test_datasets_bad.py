"""Dataset files validated at the boundary: malformed and odd files made here, each clearly bad one
refused with one UsageError line naming the file, the row (and line) and the field, and the problem;
the odd but sound ones load. Nothing is written anywhere (the standard library reads local files;
`datasets` keeps tweet_eval under $MPSIMPACT_CACHE)."""

import json
import sys

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.errors import UsageError
from mpsimpact.models import dataset
from mpsimpact.models.dataset import load_file
from said import one_message

runner = CliRunner()
NAMES = "one of the model's labels (negative, neutral, positive) or an index in 0..2"

# name -> (bytes, what the one line must say after "Dataset file '<path>'")
BAD = {
    "empty.csv": (b"", " is empty; it needs a 'text' and a 'label' for each text."),
    "blank.jsonl": (b"\n  \n", " is empty; it needs a 'text' and a 'label' for each text."),
    "header-only.csv": (b"text,label\n", " has no texts (a header alone, or an empty list)."),
    "empty-list.json": (b"[]", " has no texts (a header alone, or an empty list)."),
    "binary.csv": (bytes(range(256)), " is not a text file (a NUL byte at byte 0); pass a UTF-8 CSV, JSON or JSON Lines file."),
    "latin-1.csv": ("text,label\ncafé,positive\n".encode("latin-1"), " is not UTF-8 (byte 0xe9 at line 2); save it as UTF-8."),
    "utf-16.csv": ("text,label\nhi,positive\n".encode("utf-16"), " is UTF-16 or UTF-32; save it as UTF-8."),
    "label-minus-1.csv": (b"text,label\nfine,0\nhi,-1\n", f", row 2 (line 3), field 'label': '-1' is not {NAMES}."),
    "label-half.csv": (b"text,label\nhi,0.5\n", f", row 1 (line 2), field 'label': '0.5' is not {NAMES}."),
    "label-7.csv": (b"text,label\nhi,7\n", f", row 1 (line 2), field 'label': 7 is not {NAMES}."),
    "label-empty.csv": (b"text,label\nhi,\n", f", row 1 (line 2), field 'label' is empty; give {NAMES}."),
    "label-unknown.csv": (b"text,label\nhi,sarcastic\n", f", row 1 (line 2), field 'label': 'sarcastic' is not {NAMES}."),
    "label-minus-1.jsonl": (b'{"text": "a", "label": -1}\n', f", row 1 (line 1), field 'label': -1 is not {NAMES}."),
    "label-float.json": (b'[{"text": "a", "label": 1.0}]', f", row 1, field 'label': 1.0 is not {NAMES}."),
    "label-true.json": (b'[{"text": "a", "label": true}]', f", row 1, field 'label': true is not {NAMES}."),
    "label-null.jsonl": (b'{"text": "a", "label": null}\n', f", row 1 (line 1), field 'label': null is not {NAMES}."),
    "text-empty.csv": (b"text,label\n,positive\n", ", row 1 (line 2), field 'text': empty; every text must be a non-empty string."),
    "text-blank.csv": (b'text,label\n"   ",positive\n', ", row 1 (line 2), field 'text': empty; every text must be a non-empty string."),
    "text-null.jsonl": (b'{"text": null, "label": 0}\n', ", row 1 (line 1), field 'text': null; every text must be a non-empty string."),
    "text-number.json": (b'[{"text": 5, "label": 0}]',
                         ", row 1, field 'text': a number (5), not a string; every text must be a non-empty string."),
    "truncated.json": (b'[{"text": "a", "label": 0}, {"text": "b", "la',
                       " is not valid JSON (Unterminated string starting at, line 1 column 43); the file may be truncated."),
    "truncated.jsonl": (b'{"text": "a", "label": 0}\n{"text": "b", "la',
                        ", row 2 (line 2): not valid JSON (Unterminated string starting at, column 15); each line must be "
                        "one complete object (or the file a list of objects)."),
    "truncated-quote.csv": (b'text,label\nok,0\n"cut off,positive\n',
                            ", line 3: not valid CSV (unexpected end of data); the file may be truncated."),
    "short-row.csv": (b"text,label\nhello\n", ", row 1 (line 2): 1 fields where the header has 2 (a comma inside a text needs quotes)."),
    "long-row.csv": (b"text,label\nhello, world,positive\n",
                     ", row 1 (line 2): 3 fields where the header has 2 (a comma inside a text needs quotes)."),
    "no-label-column.csv": (b"text,sentiment\nhi,positive\n",
                            " has no 'label' column (columns: text, sentiment); rename the columns to 'text' and 'label'."),
    "semicolons.csv": (b"text;label\nhi;positive\n", " has no 'text' column (columns: text;label); the file must be comma-separated."),
    "twice.csv": (b"text,label,text\nhi,positive,again\n", " has the column 'text' twice."),
    "not-objects.json": (b"[[1, 2]]", ", row 1: a list, not an object with 'text' and 'label'."),
    "no-text-field.jsonl": (b'{"sentence": "hi", "label": 0}\n', ", row 1 (line 1): no 'text' field (fields: sentence, label)."),
    "object.json": (b'{\n  "data": [{"text": "a", "label": 0}]\n}\n',
                    ", row 1 (line 1): not valid JSON (Expecting property name enclosed in double quotes, column 2); "
                    "each line must be one complete object (or the file a list of objects)."),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_file_is_one_line_naming_the_file_and_the_problem(tmp_path, name):
    data, says = BAD[name]
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(UsageError) as error:
        load_file(str(path))
    assert error.value.message == f"Dataset file '{path}'{says}"
    assert "\n" not in error.value.message


def test_missing_folder_and_suffix_are_named(tmp_path):
    (tmp_path / "folder.csv").mkdir()
    (tmp_path / "data.txt").write_text("text,label\nhi,0\n")
    for path, says in ((tmp_path / "nope.csv", "does not exist."), (tmp_path / "folder.csv", "is a folder; pass a .csv, "
                       ".json or .jsonl file."), (tmp_path / "data.txt", "must end in .csv, .json or .jsonl.")):
        with pytest.raises(UsageError, match=None) as error:
            load_file(str(path))
        assert error.value.message == f"Dataset file '{path}' {says}"


ODD_BUT_SOUND = {
    "bom-crlf.csv": ("\ufefftext,label\r\nhi,positive\r\n".encode(), ("hi",), (2,)),
    "quoted.csv": (b'id,text,label\n1,"a, quoted\ntext",neutral\n2,"""quotes""",1\n\n', ('a, quoted\ntext', '"quotes"'), (1, 1)),
    "names-and-indices.csv": (b"label,text\n 2 ,ok\nnegative ,bad\n", ("ok", "bad"), (2, 0)),
    "extra-fields.json": (b'[{"text": "a", "label": "positive", "id": 1}, {"text": "b", "label": 0}]', ("a", "b"), (2, 0)),
    "blank-lines.jsonl": (b'\n{"text": "a", "label": 1}\n\n{"text": "b", "label": "2"}\n', ("a", "b"), (1, 2)),
    "one-object-per-line.json": (b'{"text": "a", "label": 0}\n{"text": "b", "label": 2}\n', ("a", "b"), (0, 2)),
    "unicode.csv": ("text,label\nnaïve 😀,positive\n".encode(), ("naïve 😀",), (2,)),
}


@pytest.mark.parametrize("name", ODD_BUT_SOUND)
def test_odd_but_sound_files_load(tmp_path, name):
    data, texts, labels = ODD_BUT_SOUND[name]
    (tmp_path / name).write_bytes(data)
    loaded = load_file(str(tmp_path / name))
    assert (loaded.texts, loaded.labels) == (texts, labels)


def test_labels_by_index_follow_the_models_labels(tmp_path):
    path = tmp_path / "two.csv"
    path.write_text("text,label\na,1\nb,NEG\n")
    assert load_file(str(path), ("NEG", "POS")).labels == (1, 0)
    path.write_text("text,label\na,2\n")
    with pytest.raises(UsageError, match=r"field 'label': 2 is not one of the model's labels \(NEG, POS\) or an index in 0\.\.1\."):
        load_file(str(path), ("NEG", "POS"))


def test_local_files_and_the_embedded_corpus_never_touch_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # any `import datasets` now fails
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"text": "a", "label": "neutral"}) + "\n")
    assert load_file(str(path)).labels == (1,)
    assert len(dataset.load_embedded("heldout")) > 7000


def test_tweet_eval_keeps_its_files_under_the_mpsimpact_cache(tmp_path, monkeypatch):
    import datasets

    seen = {}

    def fake_load_dataset(*args, **kwargs):
        seen.update(kwargs)
        raise ConnectionError("offline")

    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(Exception, match="is not in the local cache"):
        dataset.load_tweet_eval()
    assert seen["cache_dir"] == str(tmp_path / "cache" / "datasets")


@pytest.mark.parametrize("name", ["label-minus-1.csv", "binary.csv", "truncated.json", "text-null.jsonl"])
def test_run_with_a_bad_dataset_exits_2_with_one_line_and_writes_nothing(tmp_path, name, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    data, says = BAD[name]
    path = tmp_path / name
    path.write_bytes(data)
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", "sentiment", "--dataset", str(path), "--batch-size", "16", "--max-length", "64",
                                 "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert one_message(result.stderr) == f"error: Dataset file '{path}'{says}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no report, no partial, no cache entry
