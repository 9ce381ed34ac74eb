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


# A fault kind (engine.faults) in plain words, for the console; the JSON keeps the kind itself.
FAULT_WORDS = {"wrong_all": "silent, all wrong", "wrong_tail": "silent, the tail wrong",
               "truncated": "silent, truncated", "wrong_other": "silent, wrong (not characterised)",
               "error": "error", "abort": "abort", "ok": "correct"}


# A run condition's status (runs.runner) in plain words, for the console; the JSON keeps the status itself.
STATUS_WORDS = {"completed": "completed", "stopped_by_guard": "stopped by guard", "error": "error",
                "not_emulated": "not emulated (values unknown)", "skipped_predicted_abort": "skipped: would abort"}
# The fault rules' names inside a message ("rule int32-kernel", "rule conservative: int32-kernel"), with
# what replaces each form; see without_rule_names.
_RULE_NAMES = ((r", rule [^;,)]+;", ";"), (r"\(rule [^;,)]+; ", "("), (r" ?\(rule [^;,)]+\)", ""),
               (r"; rule [^;,)]+, inferred\)", "; inferred)"), (r"; rule [^;,)]+\)", ")"))


def release_lines(report: dict[str, Any]) -> list[str]:
    """Which torch release a report judged and why, and what the installed release would do on a Mac
    (with the flag that shows it): the lines under every report's first line (report["release"])."""
    release = report.get("release") or {}
    return [line for line in (release.get("sentence"), release.get("on_a_mac")) if line]


def narrowed_words(index_bits: int, full: int = 32) -> str:
    """" at the 23-bit index" where sizes are judged at a narrowed index (--quick, --index-bits; MPS's is `full`),
    "" at MPS's own: said wherever such a size is given."""
    return f" at the {index_bits}-bit index" if index_bits != full else ""


def after_label(text: str) -> str:
    """A sentence put after a label ("note: ..."): its first word in lower case, unless it is a name or an
    acronym ("MPS", "Llama"), so that a label never reads glued to a second sentence ("note: No ...")."""
    first = text.split(" ", 1)[0]
    if not first[:1].isupper() or first[1:2].isupper() or first.rstrip(",.:;") in PROPER_WORDS:
        return text
    return text[0].lower() + text[1:]


# Capitalised words that stay so after a label: names, not a sentence's first word.
PROPER_WORDS = frozenset({"Apple", "Metal", "Mac", "Python", "PyTorch", "Linux", "Hugging", "Chromium", "Llama"})


def without_rule_names(text: str) -> str:
    """A message without the fault rules' internal names, for the console (the JSON and --verbose keep
    them): "(emulated MPS 2.13.0, rule int32-kernel; ...)" -> "(emulated MPS 2.13.0; ...)"."""
    import re

    for pattern, replacement in _RULE_NAMES:
        text = re.sub(pattern, replacement, text)
    return text


def command_lines(command: str, width: int = 80) -> list[str]:
    """A command to type, alone on its lines and pasteable as printed: broken only before an option (`--flag
    value` kept together), each line but the last ending in " \\", the next indented by two spaces. A quoted word
    (a path with a space) stays one word, quoted as the shell reads it."""
    import shlex

    words = [shlex.quote(word) for word in shlex.split(command)]
    pieces: list[str] = []
    for word in words:
        if pieces and not word.startswith("-") and pieces[-1].startswith("-") and " " not in pieces[-1]:
            pieces[-1] += f" {word}"  # an option's value stays with it
        else:
            pieces.append(word)
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + 1 + len(piece) + 2 > width:
            lines.append("  ")
        lines[-1] += (" " if lines[-1].strip() else "") + piece
    return [line + " \\" for line in lines[:-1]] + lines[-1:]


def count_words(n: int, unit: str = "") -> str:
    """A count as people read it, never a bare G or M: "6.44 billion", "402.7 million", "12,582,912" below a
    million; with `unit`, after it ("6.44 billion elements")."""
    said = (f"{n / 1e9:.2f} billion" if n >= 1e9 else f"{n / 1e6:.1f} million" if n >= 1e6 else f"{n:,}")
    return f"{said} {unit}" if unit else said


def guard_cell(condition: dict[str, Any]) -> str:
    """A run condition's guard as the console, report.md and report.html name it, led by its attention where that
    is not eager ("sdpa, raise")."""
    eager = condition.get("attention", "eager") == "eager"
    return condition["guard"] if eager else f"{condition['attention']}, {condition['guard']}"


def cell_name(cell: dict[str, Any]) -> str:
    """'256x64x256 batch 17 contiguous fp32': a sweep cell as people say it."""
    return f"{cell['m']}x{cell['k']}x{cell['n']} batch {cell['batch']} {cell['layout']} {cell['dtype']}"


def format_cell(value: Any) -> str:
    """A table cell: '-' for missing, short floats, scientific below 1e-3."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


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


class Footnotes:
    """Long texts moved out of a table: a cell carries "[n]" and the text is printed once, below it."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        """The marker "[n]" of `text`, the same number for the same text."""
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        """Each text after its marker, ended as a sentence is."""
        return [f"[{n}] {text}" + ("" if text.endswith((".", "?", "!")) else ".")
                for n, text in enumerate(self.texts, 1)]


def _words(cell: str) -> list[str]:
    """A cell's words as a wrap keeps them whole (a number with its unit is one: errors.unbroken_words)."""
    from mpsimpact.errors import unbroken_words

    return unbroken_words(cell) or [""]


def _column_widths(header: list[str], rows: list[list[str]], width: int) -> list[int] | None:
    """Widths that fit `width` with every word of every cell whole (None if none do): each column gets its
    longest word, then the spare room goes to the columns that need the least more to stop wrapping."""
    columns = list(zip(header, *rows))
    least = [max(len(word) for cell in column for word in _words(cell)) for column in columns]
    spare = width - (3 * len(columns) + 1) - sum(least)  # a box table: "│ " + cell + " " per column, "│"
    if spare < 0:
        return None
    widths = least[:]
    for cells in (lambda column: column[1:], lambda column: column):  # the cells unwrapped first, then titles
        most = [max((len(line) for cell in cells(c) for line in cell.splitlines() or [""]), default=0)
                for c in columns]
        for i in sorted(range(len(columns)), key=lambda i: most[i] - widths[i]):
            more = max(0, min(most[i] - widths[i], spare))
            widths[i], spare = widths[i] + more, spare - more
    return widths


def _wrapped(text: str, width: int) -> list[str]:
    """`text` in lines of `width`, broken at spaces only (a word longer than a line stays whole, and so does a
    number with its unit: errors.kept_together)."""
    import textwrap

    from mpsimpact.errors import KEEP, kept_together

    return [line.replace(KEEP, " ") for paragraph in text.splitlines() or [""]
            for line in textwrap.wrap(kept_together(paragraph), width, break_long_words=False,
                                      break_on_hyphens=False) or [""]]


class FittedTable:
    """A console table that fits the width it is printed at without cutting or breaking a word: columns
    when every column's longest word fits, else one block per row ("title: value" lines), so that it
    reads whole at 80 columns and in a log. `title` may be changed before it is printed."""

    def __init__(self, title: str, header: list[str] | tuple[str, ...], rows: list[list[str]], *,
                 justify: str = "left", show_lines: bool = False) -> None:
        self.title, self.header, self.justify, self.show_lines = title, list(header), justify, show_lines
        self.rows = [[str(cell) for cell in row] for row in rows]

    def __rich_console__(self, console: Any, options: Any):
        widths = _column_widths(self.header, self.rows, options.max_width)
        if widths is not None:
            yield self._table(widths)
        else:
            yield from self._blocks(options.max_width)

    def _table(self, widths: list[int]):
        from rich.table import Table
        from rich.text import Text

        table = Table(title=self.title, show_lines=self.show_lines)
        for title, width in zip(self.header, widths):  # each cell wrapped here, so rich breaks none again
            table.add_column(Text("\n".join(_wrapped(title, width))), justify=self.justify, width=width,
                             overflow="fold")
        for row in self.rows:
            table.add_row(*(Text("\n".join(_wrapped(cell, width))) for cell, width in zip(row, widths)))
        return table

    def _blocks(self, width: int):
        from rich.text import Text

        keys = max(len(title) for title in self.header[1:])
        lines = [*(Text(line, style="italic") for line in _wrapped(self.title, width))]
        for row in self.rows:
            lines += [Text(line, style="bold") for line in _wrapped(f"{self.header[0]} {row[0]}", width)]
            for title, cell in zip(self.header[1:], row[1:]):
                if keys + 4 + max(map(len, _words(cell))) <= width:
                    text = _wrapped(cell, width - keys - 4)
                    lines += [Text(f"  {title:<{keys}}  {text[0]}"), *(Text(" " * (keys + 4) + t) for t in text[1:])]
                else:  # too wide beside its title: on the lines below it
                    lines += [Text(f"  {title}"), *(Text("    " + t) for t in _wrapped(cell, width - 4))]
        yield from lines


fitted_table = FittedTable  # the name the reports make their console tables by
