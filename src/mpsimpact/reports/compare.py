"""`mpsimpact compare`'s outputs: the console tables and verdicts, compare.md, a self-contained
compare.html and compare.json, written atomically into a fresh folder, from the `comparison` it is
given (an upgrade.compare.Comparison: computed there, only shown here)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from mpsimpact.output.files import atomic_write_text, folder_written_atomically
from mpsimpact.config import DEFAULT_ATTENTION
from mpsimpact.output.page import BANNER_COLOURS, HTML_STYLE, cell_name, fitted_table, html_table, markdown_table
from mpsimpact.output.page import format_cell as _show


def _old_new(old: Any, new: Any) -> str:
    """'x' when unchanged, 'old -> new' otherwise."""
    return _show(new) if old == new else f"{_show(old)} -> {_show(new)}"


def tables(comparison: Any) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every table of a comparison as (title, header, rows), shared by the console, Markdown and HTML."""
    environment = [[r["field"], _show(r["old"]), _show(r["new"])] for r in comparison.environment]
    result = [("Environment", ["", "old", "new"], environment)]
    if comparison.kind == "run":
        return result + [_condition_table(comparison)]
    cells = [[cell_name(c["cell"]), c["old"], c["new"]] for c in comparison.cells]
    if cells:
        result.append((f"Cells whose outcome changed ({len(cells)})", ["cell", "old", "new"], cells))
    keys = ("agree", "disagree", "skipped")
    counts = [[side, *(_show(counts.get(k)) for k in keys)] for side, counts in comparison.agreement.items()]
    return result + [("Agreement with the fault model", ["", *keys], counts)]


def _condition_table(comparison: Any) -> tuple[str, list[str], list[list[str]]]:
    """One row per condition, each value 'old -> new' (or one value when unchanged)."""
    with_attention = any(c["attention"] != DEFAULT_ATTENTION for c in comparison.conditions)
    header = ["guard", *(["attention"] if with_attention else []), *comparison.columns]
    rows = [
        [c["guard"], *([c["attention"]] * with_attention), *(_old_new(*c["values"][t]) for t in comparison.columns)]
        for c in comparison.conditions
    ]
    return "Conditions (old -> new)", header, rows


def _tag(verdict: Any) -> str:
    return "changed" if verdict.changed else "cannot-tell" if verdict.undecided else "info"


def result_line(comparison: Any) -> str:
    """The one-line summary that ends every output."""
    count = sum(v.changed for v in comparison.verdicts)
    if count:
        return f"{count} {'change that matters' if count == 1 else 'changes that matter'}: exit code {comparison.exit_code}."
    if comparison.undecided:
        return f"Cannot tell: a side did not run (see the verdicts): exit code {comparison.exit_code}."
    return f"Nothing that matters changed: exit code {comparison.exit_code}."


def _side(comparison: Any, index: int) -> str:
    """'old: /path: EMULATED MPS (torch 2.13.0) on cpu ...' (the mode says emulated or real)."""
    return f"{('old', 'new')[index]}: {(comparison.old, comparison.new)[index]}: {comparison.modes[index]}"


def render_markdown(comparison: Any) -> str:
    """compare.md: both sides, the verdicts, then every table."""
    lines = [f"# mpsimpact compare: {comparison.kind}s", "", *(f"- **{_side(comparison, i)}**" for i in (0, 1)), ""]
    lines += ["## Verdicts", "", *(f"- **{_tag(v)}**: {v.text}" for v in comparison.verdicts)]
    lines += ["", result_line(comparison), ""]
    for title, header, rows in tables(comparison):
        lines += [f"## {title}", "", *markdown_table(header, rows), ""]
    return "\n".join(lines)


def render_html(comparison: Any) -> str:
    """compare.html: self-contained (inline CSS), with an emulated/real banner for each side."""
    esc = html.escape
    banners = "".join(f'<p class="banner" style="background:{BANNER_COLOURS[comparison.emulated[i]]}">'
                      f"{esc(_side(comparison, i))}</p>" for i in (0, 1))
    verdicts = "".join(f'<li><span class="{_tag(v)}">{_tag(v)}</span> {esc(v.text)}</li>' for v in comparison.verdicts)
    sections = "".join(f"<h2>{esc(title)}</h2>{html_table(header, rows)}"
                       for title, header, rows in tables(comparison))
    title = f"mpsimpact compare: {esc(comparison.kind)}s"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>{HTML_STYLE}
.changed{{color:#fff;background:#c0392b;padding:0 .4em;border-radius:4px}}.info{{color:#555}}
.cannot-tell{{background:#f6d365;padding:0 .4em;border-radius:4px}}
</style></head><body>
<h1>{title}</h1>
{banners}<h2>Verdicts</h2><ul>{verdicts}</ul><p><strong>{esc(result_line(comparison))}</strong></p>
{sections}</body></html>
"""


def write_comparison_folder(out: Path, comparison: Any) -> Path:
    """Writes compare.md, compare.html and compare.json into a hidden partial folder, then renames
    it to `out`: an interrupted write leaves no complete-looking folder."""
    with folder_written_atomically(out) as partial:
        atomic_write_text(partial / "compare.json", json.dumps(comparison.to_json(), indent=2, default=str) + "\n")
        atomic_write_text(partial / "compare.md", render_markdown(comparison))
        atomic_write_text(partial / "compare.html", render_html(comparison))
    return Path(out)


def print_comparison(comparison: Any, folder: Path | None = None) -> None:
    """The console view: both sides, the environment and condition (or cell) tables, the verdicts."""
    from mpsimpact.output.console import Console
    from rich.text import Text
    console = Console()
    for index in (0, 1):
        style = "bold yellow" if comparison.emulated[index] else "bold green"
        console.print(_side(comparison, index), style=style, markup=False)
    for title, header, rows in tables(comparison):  # each side's mode is said above it: not again in a cell
        rows = [row for row in rows if not (title == "Environment" and row[0] == "mode")]
        console.print(fitted_table(title, header, rows, justify="right"))
    styles = {"changed": ("changed", "bold red"), "cannot-tell": ("cannot tell", "bold yellow")}
    for verdict in comparison.verdicts:
        tag, style = styles.get(_tag(verdict), ("info", "dim"))
        console.print(Text.assemble((tag, style), f"  {verdict.text}"))
    console.print(result_line(comparison), markup=False)
    if folder is not None:
        console.print(f"Written to {folder}/ (compare.md, compare.html, compare.json).", markup=False)
