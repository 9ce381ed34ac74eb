"""What a condition's corpus embeddings say against the reference index: corrupted vectors (cosine),
self-retrieval ranks, the queries' top-10 results, hubs and collapse toward a common direction.
Pure numpy; every input is unit-normalised here."""

from __future__ import annotations

from typing import Any

import numpy as np

# fp32: clean vectors of a chunked or emulated-but-unaltered pass stay above 1 - 1e-6 of the CPU
# reference; corrupted ones fall below 0.99 (measured, see README "run retrieval"). 1e-4 sits between.
COSINE_THRESHOLD = 1 - 1e-4
# Two corpus texts are the same document when their reference vectors agree this closely (repeats,
# texts the uncased tokenizer maps to the same tokens): ranks and recall never count one for the other.
TWIN_COSINE = 1 - 1e-6
TOP_K = 10
RANK_BUCKETS = ((1, 1), (2, 10), (11, 100), (101, None))


def unit(vectors: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def cosines(embeddings: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Per document: cosine to its reference vector (NaN where the device vector is not finite)."""
    return np.einsum("ij,ij->i", unit(embeddings), unit(reference))


def twin_ids(reference: np.ndarray) -> np.ndarray:
    """Per document: the first position holding the same document (see TWIN_COSINE)."""
    ref = unit(reference)
    return np.argmax(ref @ ref.T >= TWIN_COSINE, axis=1)


def self_ranks(embeddings: np.ndarray, reference: np.ndarray, twins: np.ndarray) -> np.ndarray:
    """Per document: how many other documents of the device index score above it when it is
    searched with its own reference vector (0: still its own nearest neighbour)."""
    scores = unit(reference) @ unit(embeddings).T  # (B, B)
    own = np.diag(scores)
    others = twins[None, :] != twins[:, None]
    return np.where(np.isfinite(own), ((scores > own[:, None]) & others).sum(axis=1), len(own) - 1)


def top_k(queries: np.ndarray, index: np.ndarray, k: int = TOP_K) -> np.ndarray:
    """Each query's k best documents, best first (non-finite scores rank last)."""
    scores = np.nan_to_num(unit(queries) @ unit(index).T, nan=-np.inf)  # (Q, B)
    best = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, best, axis=1), axis=1, kind="stable")
    return np.take_along_axis(best, order, axis=1)


def mean_pairwise_cosine(vectors: np.ndarray) -> float | None:
    """Mean cosine over all pairs of distinct (finite) vectors; None below two."""
    v = unit(vectors[np.isfinite(vectors).all(axis=1)])
    n = len(v)
    if n < 2:
        return None
    total = v.sum(axis=0)
    return float((total @ total - n) / (n * (n - 1)))


def rank_summary(ranks: np.ndarray) -> dict[str, Any]:
    """Self-retrieval failures and the distribution of their ranks."""
    failed = ranks[ranks > 0]
    buckets = {(f"{lo}" if lo == hi else f"{lo}-{hi}" if hi else f">{lo - 1}"):
               int(((failed >= lo) & (failed <= (hi or ranks.size))).sum()) for lo, hi in RANK_BUCKETS}
    return {
        "failures": int(failed.size), "failure_fraction": float(failed.size / max(ranks.size, 1)),
        "median_failed_rank": float(np.median(failed)) if failed.size else None,
        "max_rank": int(ranks.max()) if ranks.size else 0, "failed_rank_buckets": buckets,
    }


def query_summary(device_top: np.ndarray, reference_top: np.ndarray,
                  twins: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """Recall@k of the device index against the reference index's top k, and top-1 changes."""
    dev, ref = twins[device_top], twins[reference_top]
    recall = np.array([np.isin(d, r).mean() for d, r in zip(dev, ref)])
    changed = dev[:, 0] != ref[:, 0]
    return {
        "queries": len(recall), "recall_at_10": float(recall.mean()), "min_recall_at_10": float(recall.min()),
        "top1_changed": int(changed.sum()), "top1_changed_fraction": float(changed.mean()),
    }, recall


def hub_summary(device_top: np.ndarray, reference_top: np.ndarray,
                corrupted: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """How often the corrupted documents appear in the queries' top-k lists: on the device, in the
    reference, and if every document were equally likely."""
    size = corrupted.size
    appearances = np.bincount(device_top.ravel(), minlength=size)
    before = np.bincount(reference_top.ravel(), minlength=size)
    expected = device_top.size * corrupted.sum() / size
    seen = int(appearances[corrupted].sum())
    return {
        "corrupted_top10_appearances": seen, "reference_top10_appearances": int(before[corrupted].sum()),
        "expected_if_uniform": float(expected),
        "ratio_to_expected": float(seen / expected) if expected else None,
        "max_appearances_corrupted": int(appearances[corrupted].max()) if corrupted.any() else 0,
        "max_appearances_clean": int(appearances[~corrupted].max()) if (~corrupted).any() else 0,
    }, appearances


def summarize_embeddings(embeddings: np.ndarray, reference: np.ndarray, queries: np.ndarray,
                         twins: np.ndarray, threshold: float = COSINE_THRESHOLD
                         ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One completed condition's aggregates, and its per-document and per-query arrays."""
    cos = cosines(embeddings, reference)
    corrupted = ~(cos >= threshold)
    positions = np.flatnonzero(corrupted)
    ranks = self_ranks(embeddings, reference, twins)
    device_top, reference_top = top_k(queries, embeddings), top_k(queries, reference)
    results, recall = query_summary(device_top, reference_top, twins)
    hubs, appearances = hub_summary(device_top, reference_top, corrupted)
    finite_corrupted = np.isfinite(cos[corrupted]).any()
    return {
        "corrupted_count": int(corrupted.sum()), "corrupted_fraction": float(corrupted.mean()),
        "first_corrupted_index": int(positions[0]) if positions.size else None,
        "corrupted_contiguous_to_end": bool(positions.size and corrupted[positions[0]:].all()),
        "non_finite_count": int((~np.isfinite(embeddings)).any(axis=1).sum()),
        "min_cosine": float(np.nanmin(cos)) if np.isfinite(cos).any() else None,
        "min_clean_cosine": float(cos[~corrupted].min()) if (~corrupted).any() else None,
        "max_corrupted_cosine": float(np.nanmax(cos[corrupted])) if finite_corrupted else None,
        "self_retrieval": rank_summary(ranks), "self_retrieval_failures": int((ranks > 0).sum()),
        "query_results": results, "recall_at_10": results["recall_at_10"],
        "top1_changed": results["top1_changed"], "hubs": hubs,
        "direction": {"corrupted_mean_pairwise_cosine": mean_pairwise_cosine(embeddings[corrupted]),
                      "clean_mean_pairwise_cosine": mean_pairwise_cosine(embeddings[~corrupted]),
                      "corrupted_reference_mean_pairwise_cosine": mean_pairwise_cosine(reference[corrupted])},
    }, {"cosine": cos, "rank": ranks, "recall": recall, "appearances": appearances}
