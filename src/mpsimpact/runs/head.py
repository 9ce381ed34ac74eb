"""Training the embedded classifier's linear head, reproducibly: logistic regression (scikit-learn)
on MiniLM sentence embeddings of the embedded corpus's training split."""

from __future__ import annotations

import dataclasses
import io
import json
import platform
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mpsimpact.models.classifier import head_files, load_embedded_classifier
from mpsimpact.errors import UsageError
from mpsimpact.models.dataset import HELDOUT_MODULUS, LABELS, LabelledTexts, load_embedded
from mpsimpact.runs.reference import run_chunked
from mpsimpact.output.files import atomic_write_bytes, atomic_write_text, check_writable_folder
from mpsimpact.output.progress import Steps

EMBED_LENGTH = 128  # covers every embedded tweet; the split and seed below are the whole recipe
SEED = 0
C = 4.0


def embed_texts(model, data: LabelledTexts, advance: Callable[[int], None] | None = None) -> np.ndarray:
    return run_chunked(model.module.embed, model.tokenizer, data.texts, EMBED_LENGTH, advance=advance)


def first_texts_with_every_label(data: LabelledTexts, limit: int) -> LabelledTexts:
    """The first `limit` texts, except that a label none of them has gets its first text in place of the
    last text of the most common label: logistic regression needs every class (the first 5 training
    texts in sha256 order are all negative), and the head needs a row per label."""
    picked = list(range(min(limit, len(data))))
    for label in range(len(data.label_names)):
        first = next((i for i, other in enumerate(data.labels) if other == label), None)
        if first is None or any(data.labels[i] == label for i in picked):
            continue
        common = Counter(data.labels[i] for i in picked).most_common(1)[0][0]
        picked.remove(max(i for i in picked if data.labels[i] == common))
        picked.append(first)
    picked.sort()
    return LabelledTexts(tuple(data.texts[i] for i in picked), tuple(data.labels[i] for i in picked), data.label_names,
                         data.source)


def installed_head_folder() -> Path:
    """The installed package's data folder, where the classifier loads its head from."""
    return head_files(None)[0].parent


def train_head(out_dir: Path | None = None, *, limit: int | None = None,
               steps: Steps | None = None) -> dict[str, Any]:
    """Fits the head, writes `sentiment_head.npz` and `.json` (atomically); returns the metadata.

    Args:
        out_dir: where to write; None replaces the installed head (the package's data folder: the CLI does so
            only with --install).
        limit: use only the first `limit` texts of each split (for tests), with every label among the
            training texts (see `first_texts_with_every_label`); at least one per label.
        steps: progress of the long steps (output.progress): loading, embedding every text, fitting.
    """
    if limit is not None and limit < len(LABELS):
        raise UsageError(f"--limit must be >= {len(LABELS)} (one training text per label: {', '.join(LABELS)}), "
                         f"got {limit}.")
    weights_path, metadata_path = head_files(out_dir)
    check_writable_folder(weights_path.parent, "--out")  # before any work
    steps = steps or (lambda description, total: lambda n: None)
    train, heldout = load_embedded("train"), load_embedded("heldout")
    if limit:
        train = first_texts_with_every_label(train, limit)
        heldout = dataclasses.replace(heldout, texts=heldout.texts[:limit], labels=heldout.labels[:limit])
    loaded = steps("Loading all-MiniLM-L6-v2", 1)
    model = load_embedded_classifier(with_head=False)
    loaded(1)
    advance = steps(f"Embedding {len(train):,} training and {len(heldout):,} held-out texts",
                    len(train) + len(heldout))
    x_train, x_test = embed_texts(model, train, advance), embed_texts(model, heldout, advance)
    fitted = steps("Fitting the logistic regression", 1)
    fit, accuracy = fit_head(x_train, train, x_test, heldout)
    fitted(1)
    metadata = head_metadata(train, heldout, accuracy)
    buffer = io.BytesIO()
    np.savez(buffer, weight=fit.coef_.astype(np.float32), bias=fit.intercept_.astype(np.float32))
    atomic_write_bytes(weights_path, buffer.getvalue())
    atomic_write_text(metadata_path, json.dumps(metadata, indent=2) + "\n")
    return metadata


def fit_head(x_train: np.ndarray, train: LabelledTexts, x_test: np.ndarray,
             heldout: LabelledTexts) -> tuple[Any, float]:
    """The logistic regression (C, SEED) on the training embeddings, and its held-out accuracy."""
    from sklearn.linear_model import LogisticRegression

    fit = LogisticRegression(C=C, max_iter=5000, random_state=SEED).fit(x_train, np.array(train.labels))
    return fit, float(fit.score(x_test, np.array(heldout.labels)))


def head_metadata(train: LabelledTexts, heldout: LabelledTexts, accuracy: float) -> dict[str, Any]:
    """sentiment_head.json: the split, the sizes, the accuracy, the recipe and the versions that made it."""
    import sklearn
    import torch
    import transformers

    return {
        "split": f"de-duplicated texts; held out iff sha256(text) mod {HELDOUT_MODULUS} == 0",
        "train_texts": len(train), "heldout_texts": len(heldout), "heldout_accuracy": round(accuracy, 4),
        "labels": list(train.label_names), "embed_max_length": EMBED_LENGTH, "C": C, "seed": SEED,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "scikit-learn": sklearn.__version__, "python": platform.python_version()},
    }
