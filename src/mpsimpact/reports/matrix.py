"""`mpsimpact matrix`'s outputs: the console tables, matrix.md, a self-contained matrix.html, the
heatmap matrix.png and matrix.json, written atomically into a fresh folder; and the progress bars."""

from __future__ import annotations

import base64
import contextlib
import html
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mpsimpact.engine.release import CONSERVATIVE
from mpsimpact.config import ATTENTIONS
from mpsimpact.output.files import atomic_write_bytes, atomic_write_text, folder_written_atomically
from mpsimpact.output.page import (BANNER_COLOURS, EMULATED_LABEL, HTML_STYLE, STATUS_WORDS, after_label, fitted_table,
                                   html_table, markdown_table, release_lines)

FILES = ("matrix.json", "matrix.md", "matrix.html", "matrix.png")
UNPROBED_COLOUR = "#dddddd"
RELEASE_RANGE = re.compile(r"^\d+\.\d+\.\d+(-\d+\.\d+\.\d+)?$")  # a measured group: "2.9.1", "2.10.0-2.12.1"


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per release: environment, time, default attention, what output_attentions runs, where eager
    goes wrong, and whether the guard held."""
    rows = []
    for row in report["rows"]:
        time_cell = " + ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in row["timing"].items()) or "-"
        if row["status"] != "probed":
            rows.append([row["transformers"], f"{row['status']}: {row['reason']}", time_cell] + ["-"] * 4)
            continue
        f, first = row["findings"], row["findings"]["eager_first_corrupted_text"]
        eager = f"text {first}, wherever it is silent" if first is not None else "differs by release"
        differ = len(row["overlay"]["installed"])
        env = f"{'cached' if row['cached'] else 'built'} ({differ} package{'s' if differ != 1 else ''} differ" \
              f"{'s' if differ == 1 else ''})"
        guard = "stops and splits" if f["guard_ok"] else "FAILED"
        rows.append([row["transformers"], env, time_cell, f["default_attention"],
                     str(f["output_attentions_runs"]), eager, guard])
    return rows


def guard_rows(report: dict[str, Any]) -> list[list[str]]:
    """Per release and attention: what guard off, raise and chunk did on the tiny emulated run."""
    rows = []
    for row in (r for r in report["rows"] if r["status"] == "probed"):
        for label, run in row["probe"]["emulated"]["runs"].items():
            off, chunk = run["off"], run["chunk"]
            first = off.get("first_corrupted_text")
            wrong = f", {off['corrupted_count']} texts from {first}" if first is not None else ""
            attention = run["attention"] + (" (default)" if label == "default" else "")
            count = len(off["faulted_calls"])
            calls = f"{STATUS_WORDS.get(off['status'], off['status'])}{wrong} ({count} call{'s' * (count != 1)})"
            rows.append([row["transformers"], attention, calls, STATUS_WORDS.get(run["raise"]["status"], run["raise"]["status"]),
                         f"{chunk['status']} ({chunk['chunked_calls']} calls split)"])
    return rows


def short_outcome(cell: dict[str, Any], sep: str = " ", profile: str = "") -> str:
    """A cell's outcome in a few words: "wrong from 1365", "wrong (not char.)" (uncharacterised), "clean"; in the
    column of the releases nobody measured (`profile` CONSERVATIVE), "cannot tell", as `plan --versions` says it
    (the cell's outcome is the worst measured release's, a judgement, not a prediction)."""
    if profile == CONSERVATIVE:
        return f"cannot{sep}tell"
    if cell["outcome"] == "wrong" and cell["first_corrupted_text"] is not None:
        return f"wrong{sep}from {cell['first_corrupted_text']}"
    labels = {"wrong_other": f"wrong{sep}(not char.)", "unmeasured": f"cannot{sep}tell"}
    return labels.get(cell["outcome"], cell["outcome"])


def merged_columns(report: dict[str, Any]) -> list[dict[str, str]]:
    """The torch release group columns, neighbouring measured groups merged where every row and attention has
    the same outcome ("2.9.1" and "2.10.0-2.12.1" -> "2.9.1-2.12.1"), as `plan --versions` merges releases;
    the merged column keeps the first group's profile. Unmeasured newer releases and files stay apart."""
    def outcomes(column: dict[str, str]) -> list[Any]:
        return [row.get("cells", {}).get(a, {}).get(column["profile"]) for row in report["rows"] for a in ATTENTIONS]

    merged: list[dict[str, str]] = []
    for column in report["columns"]:
        last = merged[-1] if merged else None
        if (last and RELEASE_RANGE.match(last["group"]) and RELEASE_RANGE.match(column["group"])
                and outcomes(last) == outcomes(column)):
            merged[-1] = {**last, "group": f"{last['group'].split('-')[0]}-{column['group'].split('-')[-1]}"}
        else:
            merged.append(dict(column))
    return merged


def column_title(report: dict[str, Any], column: dict[str, str]) -> str:
    """A release group's column title, saying which holds the release judged and the installed one."""
    release = report.get("release") or {}
    which = [word for word, ref in (("judged", release.get("judged")), ("installed", release.get("installed")))
             if ref and column_holds(column, ref)]
    return column["group"] + (f" ({', '.join(which)})" if which else "")


def column_holds(column: dict[str, str], ref: str) -> bool:
    """Whether a (merged) release group column stands for this release (or profile.json)."""
    if column["profile"] == ref or column["group"] == ref:
        return True
    ends = column["group"].split("-")
    if len(ends) != 2 or not RELEASE_RANGE.match(column["group"]) or not RELEASE_RANGE.match(ref):
        return False
    key = lambda version: tuple(int(part) for part in version.split("."))  # noqa: E731
    return key(ends[0]) <= key(ref) <= key(ends[1])


def release_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per release and attention, one cell per torch release group: the outcome in short."""
    rows = []
    for row in report["rows"]:
        probed = row["status"] == "probed"
        for attention in ATTENTIONS:
            cells = row.get("cells", {}).get(attention) or {}
            reason = row["probe"]["implementations"][attention].get("error", "-") if probed else "not probed"
            label = attention + " (default)" * (probed and row["findings"]["default_attention"] == attention)
            outcomes = [short_outcome(cells[c["profile"]], profile=c["profile"]) if cells else reason
                        for c in merged_columns(report)]
            rows.append([row["transformers"], label, *outcomes])
    return rows


def tables(report: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every table, as (title, header, rows), shared by the console, Markdown and HTML."""
    emu, cfg, lead = report["emulated"], report["config"], ["transformers", "attention"]
    ops = [[r["transformers"], name, "; ".join(lines) or "-"] for r in report["rows"]
           if r["status"] == "probed" for name, lines in r["findings"]["attention_ops"].items()]
    summary = ["transformers", "environment", "time", "default attention", "output_attentions=True runs",
               "eager: first wrong text", "guard"]
    outcome_title = (f"Outcome on MPS at {cfg['batch_size']} x {cfg['max_length']}, by torch release group "
                     "(predicted from shapes)")
    guard_title = (f"Guard check: tiny random BERT, {emu['batch']} x {emu['length']}, "
                   f"{EMULATED_LABEL} {emu['profile']}, {emu['index_bits']}-bit index")
    return [
        ("By transformers release", summary, summary_rows(report)),
        (outcome_title, [*lead, *[column_title(report, c) for c in merged_columns(report)]], release_rows(report)),
        (guard_title, [*lead, "guard off", "guard raise", "guard chunk"], guard_rows(report)),
        ("Attention calls that reach MPS (bmm and SDPA, per layer)", [*lead, "calls: a @ b (layouts)"], ops),
    ]


def notes(report: dict[str, Any]) -> list[str]:
    """Plain-language differences between the releases."""
    probed = [r for r in report["rows"] if r["status"] == "probed"]
    lines = []
    by_runs: dict[str, list[str]] = {}
    for row in probed:
        by_runs.setdefault(str(row["findings"]["output_attentions_runs"]), []).append(row["transformers"])
    if len(by_runs) > 1:
        runs = "; ".join(f"{k} in {', '.join(v)}" for k, v in by_runs.items())
        lines.append(f"With output_attentions=True the default model runs {runs}.")
    for name in ATTENTIONS:
        differ = [r["transformers"] for r in probed if r["findings"].get("same_ops_as", {}).get(name) is None]
        if probed and not differ:
            lines.append(f"{name}: the same attention calls, with the same layouts, in every probed release.")
        elif differ:
            lines.append(f"{name}: the attention calls differ from {probed[0]['transformers']}'s in "
                         f"{', '.join(differ)}.")
    return lines + [f"transformers {r['transformers']}: {r['status']}: {r['reason']}"
                    for r in report["rows"] if "reason" in r]


def headline(report: dict[str, Any]) -> str:
    cfg, env = report["config"], report["environment"]
    return (f"Model {report['model']} on {cfg['batch_size']} texts of {cfg['max_length']} tokens, "
            f"torch {env['torch']} (the running one, in every environment). Outcomes predicted from the config "
            f"alone, with no weights; guard checked on a tiny random BERT under {EMULATED_LABEL} "
            f"{report['emulated']['profile']} at a {report['emulated']['index_bits']}-bit index.")


def result_line(report: dict[str, Any]) -> str:
    if report["all_ok"]:
        return "Every environment was probed and the guard stops and splits in each: exit code 0."
    return "Some environment could not be probed, or the guard did not hold in it: exit code 1."


def render_markdown(report: dict[str, Any]) -> str:
    """matrix.md: the headline, every table, the notes and the heatmap."""
    lines = [f"# mpsimpact matrix: {report['config']['scenario']}", "", headline(report), "",
             *[f"{line}  " for line in release_lines(report)], ""]
    for title, header, rows in tables(report):
        lines += [f"## {title}", "", *markdown_table(header, rows), ""]
    lines += [f"- {note}" for note in notes(report)]
    lines += ["", result_line(report), "", "![matrix](matrix.png)", ""]
    return "\n".join(lines)


def render_html(report: dict[str, Any], figure: bytes) -> str:
    """matrix.html: self-contained (inline CSS and figure), in report.html's look."""
    esc = html.escape
    sections = "".join(f"<h2>{esc(title)}</h2>{html_table(header, rows)}"
                       for title, header, rows in tables(report))
    items = "".join(f"<li>{esc(note)}</li>" for note in notes(report))
    image = base64.b64encode(figure).decode()
    title = f"mpsimpact matrix: {esc(report['config']['scenario'])}"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>{HTML_STYLE}.banner{{background:{BANNER_COLOURS[True]}}}</style></head><body>
<h1>{title}</h1><p class="banner">{esc(headline(report))}</p>
{"".join(f"<p>{esc(line)}</p>" for line in release_lines(report))}
<figure><img alt="matrix" src="data:image/png;base64,{image}"><figcaption>matrix.png</figcaption></figure>
{sections}<ul>{items}</ul><p><strong>{esc(result_line(report))}</strong></p></body></html>
"""


def heatmap(report: dict[str, Any]) -> bytes:
    """PNG: rows are transformers releases, columns attention x torch release group, colours the outcome
    (grey: not probed); the row label names the release's default attention."""
    from matplotlib.patches import Patch

    from mpsimpact.output.plot import png, pyplot
    from mpsimpact.reports.versions import COLORS

    plt = pyplot()
    groups, rows = merged_columns(report), report["rows"]
    columns = [(a, c) for a in ATTENTIONS for c in groups]
    fig, ax = plt.subplots(figsize=(0.95 * len(columns) + 3, 0.7 * len(rows) + 1.8))
    for y, row in enumerate(rows):
        for x, (attention, column) in enumerate(columns):
            cell = row.get("cells", {}).get(attention, {}).get(column["profile"])
            colour = COLORS[cell["outcome"]] if cell else UNPROBED_COLOUR
            ax.add_patch(plt.Rectangle((x, y), 1, 1, facecolor=colour, edgecolor="white", linewidth=1.5))
            text = short_outcome(cell, "\n", column["profile"]) if cell else (row["status"] if x == 0 else "")
            ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,
                    color="black" if not cell or cell["outcome"] == "clean" else "white")
    # The group labels sit a fixed distance above the axes, in points, and the title above them, so neither
    # moves with the number of rows (in data units they did, and a one-row figure put them on the title).
    for index, attention in enumerate(ATTENTIONS):
        ax.annotate(f"{attention} attention", (len(groups) * (index + 0.5), 1), xycoords=("data", "axes fraction"),
                    xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=9, weight="bold")
    ax.axvline(len(groups), color="black", linewidth=2)
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(rows), 0)
    ticks = [c["group"].replace("-", "-\n").replace(" newer", "\nnewer") for _, c in columns]
    ax.set_xticks([x + 0.5 for x in range(len(columns))], ticks, fontsize=7)
    labels = [f"transformers {r['transformers']}"
              + (f"\n(default: {r['findings']['default_attention']})" if r["status"] == "probed" else "")
              for r in rows]
    ax.set_yticks([y + 0.5 for y in range(len(rows))], labels, fontsize=8)
    cfg = report["config"]
    ax.set_title(f"{report['model']}: {cfg['batch_size']} x {cfg['max_length']} on MPS by transformers "
                 "release and torch release (predicted from shapes)", fontsize=9, pad=24)
    handles = [Patch(color=c, label=k) for k, c in (*COLORS.items(), ("not probed", UNPROBED_COLOUR))]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return png(fig)


def write_matrix_folder(out: Path, report: Any) -> Path:
    """matrix.json, matrix.md, matrix.html and matrix.png into a hidden partial folder, then renamed to
    `out` (from output.files.fresh_out_dir): an interrupted write leaves no complete-looking folder."""
    figure = heatmap(report)
    with folder_written_atomically(out) as partial:
        atomic_write_bytes(partial / "matrix.png", figure)
        atomic_write_text(partial / "matrix.md", render_markdown(report))
        atomic_write_text(partial / "matrix.html", render_html(report, figure))
        atomic_write_text(partial / "matrix.json", json.dumps(report.to_json(), indent=2) + "\n")  # MatrixReport
    return Path(out)


def print_matrix(report: dict[str, Any], folder: Path | None = None) -> None:
    """The console view: the headline, every table, the notes and the exit line."""
    from mpsimpact.output.console import Console
    console = Console()
    console.print(headline(report), style="bold yellow", markup=False)
    for line in release_lines(report):
        console.print(line, markup=False)
    for title, header, rows in tables(report):
        console.print(fitted_table(title, header, rows, show_lines=True))
    for line in [*(f"note: {after_label(note)}" for note in notes(report)), result_line(report)]:
        console.print(line, markup=False)
    if folder is not None:
        console.print(f"Written to {folder}/ ({', '.join(FILES)}).", markup=False)


@contextlib.contextmanager
def progress_bars() -> Iterator[Callable[[str, str], None]]:
    """A rich progress bar per environment (building, probing), on stderr when it is a terminal: yields the
    matrix's progress callback, (transformers version, stage)."""
    from mpsimpact.output.console import Console
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bars

    console = Console(stderr=True)
    steps = {"building": 0, "probing": 1, "done": 2, "failed": 2}
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Bars(*columns, console=console, disable=not console.is_terminal) as bars:
        tasks: dict[str, Any] = {}

        def advance(version: str, stage: str) -> None:
            if version not in tasks:
                tasks[version] = bars.add_task(f"transformers {version}", total=2)
            bars.update(tasks[version], description=f"transformers {version}: {stage}",
                        completed=steps[stage])

        yield advance
