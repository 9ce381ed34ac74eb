"""The version table: what one geometry does on every torch release, per attention implementation and
phase (inference, one training step), from shapes alone. The slide for "what changes if I upgrade?"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpsimpact.planner import Prediction, predict, trace_classifier
from mpsimpact.release import CONSERVATIVE, MEASURED_RELEASES, profile_for

ATTENTIONS = ("eager", "sdpa")
PHASES = ("inference", "training")
NEWER = "unmeasured newer"
COLORS = {"clean": "#4daf4a", "wrong": "#e41a1c", "wrong_other": "#ff7f00", "error": "#984ea3", "abort": "#222222"}


def cell(forward: Prediction, whole: Prediction | None) -> dict[str, Any]:
    """One cell: the forward pass's outcome, and for a training step what the backward adds."""
    stop = (whole or forward).stop
    outcome = stop.fault.kind if stop is not None else forward.outcome
    message = forward.describe()
    if whole is not None and stop is not None and stop.phase == "backward" and forward.outcome != "clean":
        message = f"{forward.describe()} (logits), then {'process abort' if stop.fault.kind == 'abort' else 'error'} in backward: {stop.fault.message}"
    elif whole is not None and stop is not None:
        message = whole.describe()
    elif whole is not None and (wrong := [c for c in whole.silent if c.phase == "backward"]):
        outcome = "wrong" if outcome == "clean" else outcome
        message = f"{message} (logits); {len(wrong)} gradient products silently wrong in backward"
    return {
        "outcome": outcome, "first_corrupted_text": forward.first_corrupted_text,
        "corrupted_count": forward.corrupted_count if forward.first_corrupted_text is not None else None, "message": message,
    }


def version_table(meta_for: Callable[[str], torch.nn.Module], batch: int, length: int, heads: int, index_bits: int = 32) -> list[dict[str, Any]]:
    """Rows {release, attention, phase, outcome, first_corrupted_text, corrupted_count, message, note}:
    one per release range whose cells agree, and one for unmeasured newer releases.

    Args:
        meta_for: builds the model on meta with an attention implementation ("eager", "sdpa").
    """
    traces = {
        (attention, phase): trace_classifier(meta_for(attention), batch, length, backward=phase == "training", index_bits=index_bits)
        for attention in ATTENTIONS for phase in PHASES
    }
    per_release = {}
    for release in (*MEASURED_RELEASES, CONSERVATIVE):
        cells = {}
        for (attention, phase), plan in traces.items():
            decided = plan.under(release)
            forward = predict(decided, batch, heads, "forward")
            cells[(attention, phase)] = cell(forward, predict(decided, batch, heads, "all") if phase == "training" else None)
        per_release[release] = cells
    return _merge(per_release)


def _merge(per_release: dict[str, dict]) -> list[dict[str, Any]]:
    """Consecutive measured releases with equal cells become one row ("2.10.0-2.12.1")."""
    groups: list[list[str]] = []
    for release in MEASURED_RELEASES:
        if groups and per_release[groups[-1][-1]] == per_release[release]:
            groups[-1].append(release)
        else:
            groups.append([release])
    groups.append([CONSERVATIVE])
    rows = []
    for group in groups:
        label = NEWER if group == [CONSERVATIVE] else group[0] if len(group) == 1 else f"{group[0]}-{group[-1]}"
        notes = sorted({note for release in group for note in profile_for(release).notes})
        for (attention, phase), value in per_release[group[0]].items():
            rows.append({"release": label, "attention": attention, "phase": phase, **value, "note": " ".join(notes)})
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown: one row per release range, one column per attention x phase."""
    columns = [(a, p) for a in ATTENTIONS for p in PHASES]
    lines = ["| torch | " + " | ".join(f"{a}, {p}" for a, p in columns) + " |", "|---|" + "---|" * len(columns)]
    for release in dict.fromkeys(r["release"] for r in rows):
        cells = {(r["attention"], r["phase"]): r for r in rows if r["release"] == release}
        lines.append(f"| {release} | " + " | ".join(cells[c]["message"].replace("|", "/") for c in columns) + " |")
    notes = sorted({r["note"] for r in rows if r["note"]})
    return "\n".join(lines + [""] + [f"- {note}" for note in notes]) + "\n"


def _short(row: dict[str, Any]) -> str:
    first = row["first_corrupted_text"]
    if row["outcome"] in ("error", "abort") and first is not None:
        return f"wrong from {first},\nthen {row['outcome']} in bwd"
    return {"wrong": f"wrong from {first}" if first is not None else "wrong", "wrong_other": "wrong\n(not characterised)"}.get(row["outcome"], row["outcome"])


def heatmap(rows: list[dict[str, Any]], title: str) -> bytes:
    """PNG: rows are release ranges, columns attention x phase, colours the outcome."""
    from matplotlib.patches import Patch

    from mpsimpact.figures import png, pyplot

    plt = pyplot()
    releases = list(dict.fromkeys(r["release"] for r in rows))
    columns = [(a, p) for a in ATTENTIONS for p in PHASES]
    fig, ax = plt.subplots(figsize=(2.3 * len(columns) + 1.5, 0.55 * len(releases) + 1.6))
    for y, release in enumerate(releases):
        for x, column in enumerate(columns):
            r = next(r for r in rows if r["release"] == release and (r["attention"], r["phase"]) == column)
            ax.add_patch(plt.Rectangle((x, y), 1, 1, color=COLORS[r["outcome"]], alpha=0.85))
            label = _short(r)
            ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=8, color="white" if r["outcome"] != "clean" else "black")
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(releases), 0)
    ax.set_xticks([x + 0.5 for x in range(len(columns))], [f"{a}\n{p}" for a, p in columns])
    ax.set_yticks([y + 0.5 for y in range(len(releases))], releases)
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return png(fig)
