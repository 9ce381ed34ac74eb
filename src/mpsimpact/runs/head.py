"""Training the embedded classifier's linear head, reproducibly: logistic regression (scikit-learn)
on MiniLM sentence embeddings of the embedded corpus's training split."""

from __future__ import annotations

import io
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mpsimpact.models.classifier import head_files, load_embedded_classifier
from mpsimpact.models.dataset import HELDOUT_MODULUS, LabelledTexts, load_embedded
from mpsimpact.runs.reference import run_chunked
from mpsimpact.output.files import atomic_write_bytes, atomic_write_text

EMBED_LENGTH = 128  # covers every embedded tweet; the split and seed below are the whole recipe
SEED = 0
C = 4.0


def embed_texts(model, data: LabelledTexts, advance: Callable[[int], None] | None = None) -> np.ndarray:
    return run_chunked(model.module.embed, model.tokenizer, data.texts, EMBED_LENGTH, advance=advance)


def train_head(out_dir: Path | None = None, *, limit: int | None = None, advance: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Fits the head, writes `sentiment_head.npz` and `.json` (atomically); returns the metadata.

    Args:
        out_dir: where to write; default the installed package's data folder.
        limit: use only the first `limit` texts of each split (for tests).
        advance: progress callback, called with the number of texts embedded.
    """
    import sklearn
    import torch
    import transformers
    from sklearn.linear_model import LogisticRegression

    model = load_embedded_classifier(with_head=False)
    train, heldout = load_embedded("train"), load_embedded("heldout")
    if limit:
        train, heldout = (LabelledTexts(d.texts[:limit], d.labels[:limit], d.label_names, d.source) for d in (train, heldout))
    x_train, x_test = embed_texts(model, train, advance), embed_texts(model, heldout, advance)
    fit = LogisticRegression(C=C, max_iter=5000, random_state=SEED).fit(x_train, np.array(train.labels))
    accuracy = float(fit.score(x_test, np.array(heldout.labels)))
    metadata = {
        "split": f"de-duplicated texts; held out iff sha256(text) mod {HELDOUT_MODULUS} == 0",
        "train_texts": len(train), "heldout_texts": len(heldout), "heldout_accuracy": round(accuracy, 4),
        "labels": list(train.label_names), "embed_max_length": EMBED_LENGTH, "C": C, "seed": SEED,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "scikit-learn": sklearn.__version__, "python": platform.python_version()},
    }
    weights_path, metadata_path = head_files(out_dir)
    buffer = io.BytesIO()
    np.savez(buffer, weight=fit.coef_.astype(np.float32), bias=fit.intercept_.astype(np.float32))
    atomic_write_bytes(weights_path, buffer.getvalue())
    atomic_write_text(metadata_path, json.dumps(metadata, indent=2) + "\n")
    return metadata
