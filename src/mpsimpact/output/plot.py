"""Figures as PNG bytes: matplotlib without a display, imported only when a figure is drawn."""

from __future__ import annotations

import io


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
