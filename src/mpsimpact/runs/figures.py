"""The run's PNG figures: relative error by batch position with the predicted boundary, the class
distribution of corrupted texts (device vs reference), and the device-vs-reference confusion."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpsimpact.config import GRADIENT_THRESHOLD
from mpsimpact.output.page import EMULATED_LABEL
from mpsimpact.output.plot import png, pyplot
from mpsimpact.runs.kind import condition_key


GUARD_STYLES = {"off": ("tab:red", 3), "chunk": ("tab:green", 2), "raise": ("tab:blue", 2)}  # color, dot size


def by_position(series: dict[str, np.ndarray], predicted: int | None, line: float, line_label: str,
                axes: tuple[str, str], title: str) -> bytes:
    """One series per completed guard condition over batch positions (log scale, floored at 1e-9), the
    threshold line and the boundary predicted from shapes; `axes` is (x label, y label)."""
    fig, ax = pyplot().subplots(figsize=(9, 4))
    for guard_mode, values in series.items():
        color, size = GUARD_STYLES.get(guard_mode, ("gray", 2))
        size = min(30, size * max(1, 400 // max(values.size, 1)))  # a few texts: dots a room can see
        ax.scatter(np.arange(values.size), np.clip(values, 1e-9, None), s=size, color=color,
                   label=f"guard {guard_mode}", alpha=0.7, linewidths=0)
    ax.axhline(line, color="black", linestyle=":", linewidth=1, label=line_label)
    if predicted is not None:
        ax.axvline(predicted, color="tab:orange", linestyle="--", linewidth=1.5,
                   label=f"predicted from shapes: text {predicted}")
    ax.set(yscale="log", xlabel=axes[0], title=title, ylabel=f"{axes[1]}  (floored at 1e-9)")
    ax.legend(loc="upper left", fontsize=8, markerscale=4)
    return png(fig)


def corrupted_classes(counts: dict[str, dict[str, int]], title: str) -> bytes:
    """Bars: the corrupted texts' predicted classes on the device vs in the reference."""
    labels = list(counts["device"])
    x = np.arange(len(labels))
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for offset, key, label, color in ((-0.2, "reference", "reference (CPU fp32)", "tab:gray"),
                                      (0.2, "device", "device", "tab:red")):
        ax.bar(x + offset, [counts[key][k] for k in labels], width=0.4, label=label, color=color)
        for i, k in enumerate(labels):
            ax.text(i + offset, counts[key][k], str(counts[key][k]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set(ylabel="corrupted texts", title=title)
    ax.legend(fontsize=8)
    return png(fig)


def confusion(device_pred: np.ndarray, reference_pred: np.ndarray, label_names: tuple[str, ...],
              title: str) -> bytes:
    """Confusion matrix: rows reference prediction, columns device prediction."""
    n = len(label_names)
    matrix = np.zeros((n, n), dtype=int)
    np.add.at(matrix, (reference_pred, device_pred), 1)
    fig, ax = pyplot().subplots(figsize=(5, 4.2))
    ax.imshow(matrix, cmap="Blues")
    for i in range(n):
        for j in range(n):
            colour = "white" if matrix[i, j] > matrix.max() / 2 else "black"
            ax.text(j, i, str(matrix[i, j]), ha="center", va="center", color=colour)
    ax.set_xticks(range(n), label_names)
    ax.set_yticks(range(n), label_names)
    ax.set(xlabel="device prediction", ylabel="reference prediction", title=title)
    return png(fig)


def render_all(run: dict[str, Any], errors: dict[str, np.ndarray], preds: dict[str, np.ndarray],
               reference_pred: np.ndarray, verdict: str) -> dict[str, bytes]:
    """Every figure of a run, by file name; `verdict`: the kind's figure line for the run."""
    tag = run_tag(run)
    g, threshold = run["geometry"], run["config"]["threshold"]
    title = f"{tag}: batch {g['batch_size']}, max length {g['max_length']}\n{verdict}"
    figures = {"error_by_position.png": by_position(  # relative logit error per batch position
        errors, run["prediction"]["first_corrupted_text"], threshold, f"corrupted above {threshold:g}",
        ("position in batch", "max |logit - ref| / max |ref|"), title)}
    off = next((c for c in run["conditions"] if c["guard"] == "off" and c["status"] == "completed"), None)
    if off is not None:
        classes_title = f"{tag}, guard off: classes of the {off['corrupted_count']} corrupted texts"
        figures["corrupted_classes.png"] = corrupted_classes(off["corrupted_class_counts"], classes_title)
        key = condition_key(off.get("attention", "eager"), "off")
        figures["confusion.png"] = confusion(preds[key], reference_pred, tuple(run["label_names"]),
                                             f"{tag}, guard off")
    return figures


OUTCOME_COLORS = {"ok": "#4daf4a", "wrong_tail": "#ff7f00", "wrong_all": "#e41a1c", "wrong_other": "#984ea3",
                  "error": "#377eb8", "crash": "#000000", "skipped_memory": "#dddddd"}


def outcome_map(rows: list[dict[str, Any]], title: str) -> bytes:
    """One panel per shape family: batch size (x) by layout and dtype (y), coloured by outcome;
    a black cross marks a cell that disagrees with the fault model."""
    plt = pyplot()
    families = sorted({(r["cell"]["m"], r["cell"]["k"], r["cell"]["n"]) for r in rows})
    fig, axes = plt.subplots(len(families), 1, figsize=(10, 2.2 * len(families)), squeeze=False)
    for ax, family in zip(axes[:, 0], families):
        cells = [r for r in rows if (r["cell"]["m"], r["cell"]["k"], r["cell"]["n"]) == family]
        ys = sorted({f"{r['cell']['layout']} {r['cell']['dtype']}" for r in cells})
        xs = sorted({r["cell"]["batch"] for r in cells})
        column = {x: i for i, x in enumerate(xs)}
        line = {y: i for i, y in enumerate(ys)}
        x = [column[r["cell"]["batch"]] for r in cells]
        y = [line[f"{r['cell']['layout']} {r['cell']['dtype']}"] for r in cells]
        # One collection per panel (a scatter call per cell drew 268 collections for a quick sweep).
        ax.scatter(x, y, s=90, marker="s", c=[OUTCOME_COLORS.get(r["observed"], "gray") for r in cells])
        crossed = [i for i, r in enumerate(cells) if r["agree"] is False]
        if crossed:
            ax.scatter([x[i] for i in crossed], [y[i] for i in crossed], s=60, marker="x", color="black")
        ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=60, fontsize=6)
        ax.set_yticks(range(len(ys)), ys, fontsize=6)
        ax.set_title(f"M={family[0]} K={family[1]} N={family[2]}", fontsize=8)
    marks = [("s", c, k) for k, c in OUTCOME_COLORS.items()] + [("x", "black", "disagrees with model")]
    handles = [plt.Line2D([], [], marker=m, linestyle="", color=c, label=k) for m, c, k in marks]
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=7, bbox_to_anchor=(0.5, 1.02))
    fig.suptitle(title, y=1.06, fontsize=9)
    fig.tight_layout()
    return png(fig)


def gradient_error_by_layer(errors: dict[str, dict[str, float]], title: str) -> bytes:
    """Relative gradient error of every parameter tensor, in model order, per guard condition."""
    names = list(next(iter(errors.values())))
    fig, ax = pyplot().subplots(figsize=(11, 4.5))
    for guard_mode, per_tensor in errors.items():
        ax.plot(range(len(names)), [max(per_tensor[n], 1e-9) for n in names], marker="o", markersize=3,
                linewidth=1, label=f"guard {guard_mode}")
    ax.axhline(GRADIENT_THRESHOLD, color="black", linestyle=":", linewidth=1,
               label=f"wrong above {GRADIENT_THRESHOLD:g}")
    ticks = [i for i, n in enumerate(names)
             if n.endswith("query.weight") or "embeddings.word" in n or n.startswith("head")]
    short = [names[i].replace("encoder.encoder.", "").replace(".attention.self.query.weight", " attn")
             for i in ticks]
    ax.set_xticks(ticks, short, rotation=45, ha="right", fontsize=7)
    ax.set(yscale="log", ylabel="max |g - g_ref| / max |g_ref|  (floored at 1e-9)", title=title)
    ax.legend(fontsize=8)
    return png(fig)


def eval_changes(changes: dict[str, np.ndarray], title: str) -> bytes:
    """Which evaluation texts the device-trained model predicts differently from the reference-trained one."""
    fig, ax = pyplot().subplots(figsize=(9, 1.2 + 0.5 * len(changes)))
    for row, (guard_mode, changed) in enumerate(changes.items()):
        xs = np.flatnonzero(changed)
        ax.scatter(xs, np.full(xs.size, row), marker="|", s=120, color="tab:red")
        ax.text(len(changed) + 2, row, f"{xs.size} changed", va="center", fontsize=8)
    ax.set_yticks(range(len(changes)), [f"guard {g}" for g in changes])
    ax.set_xlim(-1, len(next(iter(changes.values()))) + 60)
    ax.set(xlabel="evaluation text", title=title)
    return png(fig)


def render_training(run: dict[str, Any], arrays: dict[str, Any]) -> dict[str, bytes]:
    """The figures of a training run, by file name."""
    tag = run_tag(run)
    figures = {}
    if arrays["gradient_errors"]:
        figures["gradient_error_by_layer.png"] = gradient_error_by_layer(
            arrays["gradient_errors"], f"{tag}: gradient error per parameter tensor, step 1")
    if arrays["eval_changes"]:
        figures["eval_changes.png"] = eval_changes(
            arrays["eval_changes"], f"{tag}: evaluation predictions after training, device vs reference")
    return figures


def run_tag(run: dict[str, Any]) -> str:
    """How a figure title names where it ran, and which torch release it judged."""
    release = (run.get("release") or {}).get("release") or run["geometry"].get("profile")
    where = EMULATED_LABEL if run["geometry"]["emulated"] else run["geometry"]["device"]
    return f"{where} (torch {release})" if release else where


def recall_per_query(recalls: dict[str, np.ndarray], title: str) -> bytes:
    """Recall@10 of the device index against the reference index, per query and condition."""
    fig, ax = pyplot().subplots(figsize=(9, 3.5))
    for row, (key, recall) in enumerate(recalls.items()):
        label = f"guard {key} (mean {recall.mean():.3f})"
        ax.scatter(np.arange(recall.size), recall + 0.01 * row, s=6, label=label)
    ax.set(ylim=(-0.05, 1.1), xlabel="query", ylabel="recall@10 vs reference top 10", title=title)
    ax.legend(fontsize=8, markerscale=2)
    return png(fig)


def top10_appearances(appearances: np.ndarray, corrupted: np.ndarray, title: str) -> bytes:
    """How many queries' top-10 lists each document is in: corrupted vs clean documents."""
    fig, ax = pyplot().subplots(figsize=(7, 4))
    bins = np.arange(0, max(int(appearances.max()), 1) + 2) - 0.5
    for mask, label, color in ((~corrupted, "clean", "tab:gray"), (corrupted, "corrupted", "tab:red")):
        if mask.any():
            # One filled outline per group, not a bar artist per bin (a hub document makes hundreds of bins).
            ax.hist(appearances[mask], bins=bins, alpha=0.6, color=color, density=True, histtype="stepfilled",
                    label=f"{label} ({mask.sum()} docs, {appearances[mask].sum()} appearances)")
    ax.set(xlabel="top-10 appearances over all queries", ylabel="share of documents", title=title)
    ax.legend(fontsize=8)
    return png(fig)


def render_retrieval(run: dict[str, Any], per_text: dict[str, dict[str, np.ndarray]],
                     verdict: str) -> dict[str, bytes]:
    """The figures of a retrieval run, by file name; `verdict`: the kind's figure line for the run."""
    tag, g = run_tag(run), run["geometry"]
    threshold, first = run["reference"]["threshold"], run["prediction"]["first_corrupted_text"]
    figures = {}
    if per_text:
        title = (f"{tag}: corpus of {g['batch_size']}, max length {g['max_length']}: cosine to reference\n"
                 f"{verdict}")
        distances = {k: np.nan_to_num(1.0 - v["cosine"], nan=2.0) for k, v in per_text.items()}  # 1 - cosine
        figures["cosine_by_position.png"] = by_position(distances, first, 1 - threshold,
                                                        f"corrupted below cosine {threshold:g}",
                                                        ("position in batch (corpus document)",
                                                         "1 - cosine to reference"), title)
        figures["recall_per_query.png"] = recall_per_query(
            {k: v["recall"] for k, v in per_text.items()}, f"{tag}: recall@10 per query")
    off_key = next((condition_key(c.get("attention", "eager"), "off") for c in run["conditions"]
                    if c["guard"] == "off"), None)
    if off_key in per_text:
        off = per_text[off_key]
        title = f"{tag}, guard off: top-10 appearances, corrupted vs clean"
        corrupted = ~(off["cosine"] >= threshold)
        figures["top10_appearances.png"] = top10_appearances(off["appearances"], corrupted, title)
    return figures
