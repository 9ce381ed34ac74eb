"""The house look shared by every page and table: the banner colours, the HTML style, the label an
emulated result carries, and how one table cell is written."""

from __future__ import annotations

from typing import Any

# Said wherever a result was computed by the emulator and not by a real Apple GPU.
EMULATED_LABEL = "EMULATED MPS"
# The banner of every HTML page, by whether MPS was emulated: amber for emulated, green for real.
BANNER_COLOURS = {True: "#fde2a7", False: "#c7e9c0"}
# The house look of every self-contained HTML page (run, compare, matrix); pages add their own rules.
HTML_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    ".banner{padding:.6em 1em;font-weight:bold;border-radius:6px}img{max-width:100%}figure{margin:1em 0}"
)


def format_cell(value: Any) -> str:
    """A table cell: '-' for missing, short floats, scientific below 1e-3."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


def rich_table(title: str, header: list[str] | tuple[str, ...], rows: list[list[str]], *,
                  justify: str = "left", show_lines: bool = False):
    """A rich table whose cells fold rather than cut, so it reads whole at 80 columns and in a log."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_lines=show_lines)
    for column in header:
        table.add_column(column, justify=justify, overflow="fold")
    for row in rows:
        table.add_row(*(escape(str(cell)) for cell in row))
    return table


def markdown_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines; a "|" inside a cell is escaped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]


def html_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    """An HTML table, every header and cell escaped."""
    from html import escape

    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
