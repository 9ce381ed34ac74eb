"""The version table shown: Markdown (versions.md, report.md) and a heatmap PNG (versions.png)."""

from __future__ import annotations

from typing import Any

from mpsimpact.engine.faults import STOP_KINDS
from mpsimpact.output.page import Footnotes, fitted_table, markdown_table, without_rule_names
from mpsimpact.config import ATTENTIONS, WORKLOADS

COLORS = {"clean": "#4daf4a", "wrong": "#e41a1c", "wrong_other": "#ff7f00", "unmeasured": "#999999",
          "error": "#984ea3", "abort": "#222222"}
# The table's columns, (attention, workload), and their titles.
COLUMNS = [(a, w) for a in ATTENTIONS for w in WORKLOADS]
TITLES = [f"{a}, {p}" for a, p in COLUMNS]


def by_release(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The table's rows as {release range: its cells in COLUMNS order}."""
    cells = {(r["release"], r["attention"], r.get("workload") or r["phase"]): r for r in rows}  # "phase": older reports
    return {release: [cells[(release, *c)] for c in COLUMNS] for release, *_ in cells}


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """The table as Markdown: one row per release range, one column per attention x workload."""
    table = [[release, *(c["message"].replace("|", "/") for c in cells)]
             for release, cells in by_release(rows).items()]
    notes = [f"- {note}" for note in sorted({r["note"] for r in rows if r["note"]})]
    return "\n".join([*markdown_table(["torch", *TITLES], table), "", *notes]) + "\n"


def console_cell(row: dict[str, Any], footnotes: Footnotes, verbose: bool = False) -> str:
    """One cell of the console's version table: the outcome in a few words, and the prediction's whole
    sentence as a footnote when it says more (without the rules' names unless `verbose`)."""
    first, message = row["first_corrupted_text"], row["message"]
    inferred = ", inferred)" in message and not verbose
    words = {"clean": "clean", "wrong": f"wrong from text {first}" if first is not None else "wrong",
             "wrong_other": "wrong (not characterised)", "unmeasured": "cannot tell",
             "error": "error", "abort": "abort"}.get(row["outcome"], row["outcome"])
    if row["outcome"] in STOP_KINDS and first is not None:
        words = f"wrong from text {first}, then {row['outcome']}"
    if row.get("cannot_tell"):  # nobody measured it: no outcome, inferred or not, stands in the cell
        return f"cannot tell {footnotes.mark(message if verbose else without_rule_names(message))}"
    words += " (inferred)" if inferred else ""
    if message in ("clean", f"{row['corrupted_count']} texts wrong from text {first}"):
        return words
    return f"{words} {footnotes.mark(message if verbose else without_rule_names(message))}"


def console_table(rows: list[dict[str, Any]], title: str, footnotes: Footnotes, verbose: bool = False):
    """The version table for the console (output.page.FittedTable): short cells, long texts in footnotes."""
    body = [[release, *(console_cell(c, footnotes, verbose) for c in cells)]
            for release, cells in by_release(rows).items()]
    return fitted_table(title, ["torch", *TITLES], body, show_lines=True)


def _short(row: dict[str, Any]) -> str:
    first = row["first_corrupted_text"]
    if row.get("cannot_tell"):
        return "cannot tell\n(unmeasured)"
    if row["outcome"] in STOP_KINDS and first is not None:
        return f"wrong from {first},\nthen {row['outcome']} in bwd"
    labels = {"wrong": f"wrong from {first}" if first is not None else "wrong",
              "wrong_other": "wrong\n(not characterised)", "unmeasured": "unmeasured\n(conservative)"}
    return labels.get(row["outcome"], row["outcome"])


def heatmap(rows: list[dict[str, Any]], title: str) -> bytes:
    """PNG: rows are release ranges, columns attention x workload, colours the outcome."""
    from matplotlib.patches import Patch

    from mpsimpact.output.plot import png, pyplot

    plt = pyplot()
    releases = by_release(rows)
    fig, ax = plt.subplots(figsize=(2.3 * len(COLUMNS) + 1.5, 0.55 * len(releases) + 1.6))
    for y, cells in enumerate(releases.values()):
        for x, r in enumerate(cells):
            ax.add_patch(plt.Rectangle((x, y), 1, 1, color=COLORS["unmeasured" if r.get("cannot_tell") else
                                                                   r["outcome"]], alpha=0.85))
            ax.text(x + 0.5, y + 0.5, _short(r), ha="center", va="center", fontsize=8,
                    color="white" if r["outcome"] != "clean" else "black")
    ax.set_xlim(0, len(COLUMNS))
    ax.set_ylim(len(releases), 0)
    ax.set_xticks([x + 0.5 for x in range(len(COLUMNS))], [f"{a}\n{p}" for a, p in COLUMNS])
    ax.set_yticks([y + 0.5 for y in range(len(releases))], list(releases))
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper left",
              bbox_to_anchor=(1.01, 1), fontsize=8)
    return png(fig)
