"""What a condition's logits say against the reference: per-text relative error, corruption,
flips, accuracy, the collapse of corrupted texts onto one class, and its significance."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpsimpact.config import CORRUPTION_THRESHOLD


def relative_error(logits: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per text: max |logit - reference| / max |reference| (the published demo's measure)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.abs(logits - reference).max(axis=1) / np.abs(reference).max(axis=1)
    return np.where(np.isfinite(logits).all(axis=1), err, np.inf)


def summarize(logits: np.ndarray, reference: np.ndarray, gold: np.ndarray, label_names: tuple[str, ...],
              threshold: float = CORRUPTION_THRESHOLD) -> dict[str, Any]:
    """The aggregate metrics of one completed condition."""
    err = relative_error(logits, reference)
    corrupted = err > threshold
    pred, ref_pred = logits.argmax(axis=1), reference.argmax(axis=1)
    positions = np.flatnonzero(corrupted)
    device_counts, reference_counts = (np.bincount(preds[corrupted], minlength=len(label_names)).tolist()
                                       for preds in (pred, ref_pred))
    return {
        "corrupted_count": int(corrupted.sum()),
        "corrupted_fraction": float(corrupted.mean()),
        "first_corrupted_index": int(positions[0]) if positions.size else None,
        "corrupted_contiguous_to_end": bool(positions.size and corrupted[positions[0]:].all()),
        "flips": int((pred != ref_pred).sum()),
        "accuracy": float((pred == gold).mean()),
        "reference_accuracy": float((ref_pred == gold).mean()),
        "non_finite_count": int((~np.isfinite(logits)).any(axis=1).sum()),
        "max_relative_error": float(err.max()) if err.size else 0.0,
        "corrupted_class_counts": {"device": dict(zip(label_names, device_counts)),
                                   "reference": dict(zip(label_names, reference_counts))},
        "collapse": collapse(device_counts, reference_counts, label_names),
        "significance": significance(pred, ref_pred, gold, device_counts, reference_counts),
    }


def collapse(device_counts: list[int], reference_counts: list[int], label_names) -> dict[str, Any]:
    """The class the corrupted texts go to on the device, its share there and in the reference."""
    total = sum(device_counts)
    if total == 0:
        return {"class": None, "device_share": None, "reference_share": None}
    top = int(np.argmax(device_counts))
    return {"class": label_names[top], "device_share": device_counts[top] / total,
            "reference_share": reference_counts[top] / total}


def significance(pred, ref_pred, gold, device_counts, reference_counts) -> dict[str, Any]:
    """Chi-square on the corrupted texts' class counts (device vs reference), and McNemar's
    exact test on per-text correctness (device vs reference)."""
    from scipy.stats import binomtest, chi2_contingency

    out: dict[str, Any] = {"chi2_collapse_p": None, "mcnemar_p": None}
    table = np.array([device_counts, reference_counts])
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] >= 2 and table.sum() > 0:
        out["chi2_collapse_p"] = float(chi2_contingency(table).pvalue)
    right, ref_right = pred == gold, ref_pred == gold
    b, c = int((right & ~ref_right).sum()), int((~right & ref_right).sum())
    if b + c:
        out["mcnemar_p"] = float(binomtest(b, b + c, 0.5).pvalue)
    out["mcnemar_discordant"] = {"device_only_right": b, "reference_only_right": c}
    return out
