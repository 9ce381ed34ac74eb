"""Training the embedded classifier's linear head, reproducibly: logistic regression (scikit-learn)
on MiniLM sentence embeddings of the embedded corpus's training split."""

from __future__ import annotations

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

EMBED_LENGTH = 128  # covers every embedded tweet; the split and seed below are the whole recipe
SEED = 0
C = 4.0


def embed_texts(model, data: LabelledTexts, advance: Callable[[int], None] | None = None) -> np.ndarray:
    return run_chunked(model.module.embed, model.tokenizer, data.texts, EMBED_LENGTH, advance=advance)


def first_texts(data: LabelledTexts, limit: int) -> LabelledTexts:
    return LabelledTexts(data.texts[:limit], data.labels[:limit], data.label_names, data.source)


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


def train_head(out_dir: Path | None = None, *, limit: int | None = None,
               advance: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Fits the head, writes `sentiment_head.npz` and `.json` (atomically); returns the metadata.

    Args:
        out_dir: where to write; default the installed package's data folder.
        limit: use only the first `limit` texts of each split (for tests), with every label among the
            training texts (see `first_texts_with_every_label`); at least one per label.
        advance: progress callback, called with the number of texts embedded.
    """
    import sklearn
    import torch
    import transformers
    from sklearn.linear_model import LogisticRegression

    if limit is not None and limit < len(LABELS):
        raise UsageError(f"--limit must be >= {len(LABELS)} (one training text per label: {', '.join(LABELS)}), "
                         f"got {limit}.")
    weights_path, metadata_path = head_files(out_dir)
    check_writable_folder(weights_path.parent, "--out")  # before any work
    train, heldout = load_embedded("train"), load_embedded("heldout")
    if limit:
        train, heldout = first_texts_with_every_label(train, limit), first_texts(heldout, limit)
    model = load_embedded_classifier(with_head=False)
    x_train, x_test = embed_texts(model, train, advance), embed_texts(model, heldout, advance)
    fit = LogisticRegression(C=C, max_iter=5000, random_state=SEED).fit(x_train, np.array(train.labels))
    accuracy = float(fit.score(x_test, np.array(heldout.labels)))
    metadata = {
        "split": f"de-duplicated texts; held out iff sha256(text) mod {HELDOUT_MODULUS} == 0",
        "train_texts": len(train), "heldout_texts": len(heldout), "heldout_accuracy": round(accuracy, 4),
        "labels": list(train.label_names), "embed_max_length": EMBED_LENGTH, "C": C, "seed": SEED,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "scikit-learn": sklearn.__version__, "python": platform.python_version()},
    }
    buffer = io.BytesIO()
    np.savez(buffer, weight=fit.coef_.astype(np.float32), bias=fit.intercept_.astype(np.float32))
    atomic_write_bytes(weights_path, buffer.getvalue())
    atomic_write_text(metadata_path, json.dumps(metadata, indent=2) + "\n")
    return metadata
