"""The embedded corpus's fixed split, checked against an independent reading of the CSV with the
standard library, and local CSV files: labels by name, unknown labels and missing columns."""

import csv
import hashlib

import pytest

from mpsimpact.models.dataset import LABELS, embedded_corpus_path, load_embedded, load_file
from mpsimpact.errors import UsageError

CORPUS_SIZE = 37_243  # distinct non-empty texts of the embedded CSV


def sha_key(text):
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


@pytest.fixture(scope="module")
def splits():
    return load_embedded("train"), load_embedded("heldout")


@pytest.fixture(scope="module")
def corpus():
    """text -> label name of its first row, read with the csv module (Latin-1, byte for byte)."""
    first = {}
    with open(embedded_corpus_path(), encoding="latin-1", newline="") as file:
        for row in csv.DictReader(file):
            if row["text"]:
                first.setdefault(row["text"], row["sentiment"])
    return first


def test_a_text_is_held_out_iff_its_sha256_prefix_is_divisible_by_5(splits):
    train, heldout = splits
    assert all(sha_key(text) % 5 == 0 for text in heldout.texts)
    assert all(sha_key(text) % 5 != 0 for text in train.texts)


def test_the_splits_partition_the_deduplicated_corpus(splits, corpus):
    train, heldout = splits
    assert len(corpus) == CORPUS_SIZE
    assert not set(train.texts) & set(heldout.texts)
    assert len(train) + len(heldout) == CORPUS_SIZE
    assert set(train.texts) | set(heldout.texts) == set(corpus)
    assert 0.19 < len(heldout) / CORPUS_SIZE < 0.21  # 7353 / 37243 = 0.197
    for split in (train, heldout):  # duplicates keep their first row's label
        assert [LABELS[label] for label in split.labels] == [corpus[text] for text in split.texts]


def test_both_splits_are_in_sha256_order(splits):
    for split in splits:
        keys = [sha_key(text) for text in split.texts]
        assert keys == sorted(keys)
    assert splits[1].texts[0] != sorted(splits[1].texts)[0]  # not merely alphabetical


def test_an_unknown_split_is_a_usage_error():
    with pytest.raises(UsageError, match="split must be 'train' or 'heldout', got 'bogus'"):
        load_embedded("bogus")


def test_csv_labels_by_name_become_indices(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("text,label\ngreat day,positive\nmeh,neutral\nawful,negative\nfine,positive\n")
    texts = load_file(str(path))
    assert texts.texts == ("great day", "meh", "awful", "fine")
    assert texts.labels == (2, 1, 0, 2)  # indices into ("negative", "neutral", "positive")
    assert texts.label_names == LABELS
    assert load_file(str(path), ("positive", "negative", "neutral")).labels == (0, 2, 1, 0)


def test_csv_with_an_unknown_label_is_refused(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("text,label\ngreat day,positive\nwhat,sarcastic\n")
    with pytest.raises(UsageError, match=r"row 2 \(line 3\), field 'label': 'sarcastic' is not one of the model's labels"):
        load_file(str(path))


def test_csv_without_a_label_column_is_refused(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text("text,sentiment\ngreat day,positive\n")
    with pytest.raises(UsageError, match="has no 'label' column \\(columns: text, sentiment\\)"):
        load_file(str(path))
