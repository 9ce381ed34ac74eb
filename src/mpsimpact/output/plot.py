"""Figures as PNG bytes: matplotlib without a display, imported only when a figure is drawn; the plan's
sweep figure (drawn from its table alone)."""

from __future__ import annotations

import io
from typing import Any


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=130, bbox_inches="tight")
    pyplot().close(fig)
    return buffer.getvalue()


def sweep_figure(table: dict[str, list[dict[str, Any]]], title: str) -> bytes:
    """Predicted corrupted fraction vs batch size, one line per max length; stops marked."""
    fig, ax = pyplot().subplots(figsize=(8, 4))
    for length, rows in table.items():
        ax.plot([r["batch"] for r in rows], [r["corrupted_fraction"] for r in rows], marker="o", markersize=3,
                label=f"max length {length}")
        for r in rows:
            if r["stops"]:
                ax.annotate(r["stops"], (r["batch"], 0), fontsize=6, rotation=90, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size (texts)", ylabel="fraction of texts silently wrong")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return png(fig)
