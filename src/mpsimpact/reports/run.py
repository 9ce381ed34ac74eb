"""The run's report folder: report.json, report.md, a self-contained report.html, the figures and the
run kind's own files, written atomically."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.output.files import atomic_write_bytes, atomic_write_text, folder_written_atomically
from mpsimpact.output.page import (
    BANNER_COLOURS, HTML_STYLE, Footnotes, guard_cell, html_table, markdown_table, release_lines,
)
from mpsimpact.output.page import format_cell as _fmt


def render_markdown(run: dict, kind) -> str:
    """report.md: the headline, the geometry, the conditions table, the kind's lines and the notes;
    `kind`: the run's runs.kind.RunKind."""
    g, p, env = run["geometry"], run["prediction"], run["environment"]
    lines = [
        f"# mpsimpact run: {run['config']['scenario']}", "",
        f"**{kind.headline(run, plain=True)}**", "",
        *[f"{line}  " for line in release_lines(run)], "",
        f"**{g['mode']}** on {env['machine']}, torch {env['torch']}, transformers {env['transformers']}.", "",
        f"Model `{run['model']}`, data: {run['data_source']}. Batch {g['batch_size']}, "
        f"max length {g['max_length']}"
        + (f" (run at {g['run_length']} tokens)" if g["run_length"] != g["max_length"] else "") + ".",
        _predicted(p, g["batch_size"], run.get("release") or {}), "",
        *markdown_table(*conditions_table(run, kind, footnotes := Footnotes())), "",
    ]
    # Under the table what the console prints there, in its words (the guards, the footnotes); then each condition's
    # own lines and its message whole (the call, its rows, the rule: the console's --verbose).
    lines += [f"- {line}" for line in [*kind.guard_lines(run), *footnotes.lines()]]
    for c in run["conditions"]:
        lines += kind.condition_lines(c)
        if c.get("message"):
            lines.append(f"- guard {guard_cell(c)}, the whole message: `{c['message']}`")
    lines += kind.markdown_lines(run)
    lines += ["", *[f"- {note}" for note in run["notes"]]]
    lines += ["", *[f"![{name}]({name})" for name in run["figures"]]]
    if run.get("versions"):
        from mpsimpact.reports.versions import to_markdown

        lines += ["", _versions_title(g), "", to_markdown(run["versions"])]
    return "\n".join(lines) + "\n"


def conditions_table(run: dict, kind, footnotes: Footnotes) -> tuple[tuple[str, ...], list[list[str]]]:
    """The conditions table as the console shows it (its header, its cells, a stop as a footnote of its status, in
    texts): report.md and report.html say what the console says. report.json keeps each field as recorded."""
    return kind.console_header, [kind.console_row(c, footnotes, False) for c in run["conditions"]]


def _predicted(p: dict, batch: int, release: dict) -> str:
    """The forward pass's prediction in one sentence: where it stops (no text comes back), or its first wrong
    text and count; a release nobody measured said as a conservative judgement."""
    stop = p.get("stops")
    if stop:
        call = stop["call"]
        what = {"abort": "the process dies"}.get(stop["kind"], "MPS raises")  # the fault's kind: abort, error
        text = (f"Predicted from shapes alone: no text comes back: {what} at {call['op']} (call {call['index']}, "
                f"{call['phase']}).")
    elif p.get("first_corrupted_text") is None:
        text = f"Predicted from shapes alone: none of the {batch} texts wrong."
    else:  # in the table's words ("wrong", "first wrong"), as plan's "6 of 16 samples silently wrong, from sample 10"
        text = (f"Predicted from shapes alone: {p['corrupted_count']} of {batch} texts wrong, from text "
                f"{_fmt(p['first_corrupted_text'])} (head {_fmt(p['first_corrupted_head'])}).")
    if release.get("measured") is False:
        text += f" Nobody measured torch {release['release']} on MPS: judged conservatively."
    return text


def _versions_title(geometry: dict) -> str:
    """The version table's heading: the geometry it was predicted at (the run's batch and length, before any
    reduction of the run's length), and a narrowed index said as such: its faults are a bigger batch's on MPS."""
    bits = geometry.get("index_bits", MPS_INDEX_BITS)
    narrowed = (f", at an emulated {bits}-bit index (MPS's is {MPS_INDEX_BITS}): what a batch "
                f"2^{MPS_INDEX_BITS - bits} times larger meets on a Mac" if bits != MPS_INDEX_BITS else "")
    return (f"## On every torch release (predicted from shapes at batch {geometry['batch_size']} x "
            f"{geometry['max_length']}{narrowed})")


def _inline(text: str) -> str:
    """Markdown's **bold** and `code` as HTML, in already-escaped text."""
    import re

    return re.sub(r"`([^`]+)`", r"<code>\1</code>", re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text))


def render_html(run: dict, figures: dict[str, bytes], kind) -> str:
    """report.html: self-contained (figures inlined), for talks."""
    import html
    from base64 import b64encode

    esc, g, env = html.escape, run["geometry"], run["environment"]
    lines = render_markdown(run, kind).splitlines()
    notes = "".join(f"<li>{_inline(esc(line[2:]))}</li>" for line in lines if line.startswith("- "))
    images = "".join(f'<figure><img alt="{name}" src="data:image/png;base64,{b64encode(data).decode()}">'
                     f"<figcaption>{name}</figcaption></figure>" for name, data in figures.items())
    table = html_table(*conditions_table(run, kind, Footnotes()))  # its footnotes are the notes' (render_markdown)
    scenario, model, data = esc(run["config"]["scenario"]), esc(run["model"]), esc(run["data_source"])
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>mpsimpact {scenario}</title>
<style>{HTML_STYLE}.banner{{background:{BANNER_COLOURS[bool(g['emulated'])]}}}
.headline{{font-size:1.5em;font-weight:bold}}</style>
</head><body>
<h1>mpsimpact run: {scenario}</h1>
<p class="headline">{esc(kind.headline(run, plain=True))}</p>
{"".join(f"<p>{esc(line)}</p>" for line in release_lines(run))}
<p class="banner">{esc(g['mode'])}</p>
<p>Model <code>{model}</code>; data: {data}; batch {g['batch_size']}, max length {g['max_length']};
torch {esc(env['torch'])} on {esc(env['machine'])}.</p>
{table}<ul>{notes}</ul>{images}{_versions_html(run)}</body></html>
"""


def _versions_html(run: dict) -> str:
    """The version table as an HTML table (empty when the report has none)."""
    from html import escape as esc

    from mpsimpact.reports.versions import TITLES, by_release

    if not run.get("versions"):
        return ""
    head = "".join(f"<th>{title}</th>" for title in ["torch", *TITLES])
    body = "".join(f"<tr><th>{esc(release)}</th>" + "".join(f"<td>{esc(c['message'])}</td>" for c in row)
                   + "</tr>" for release, row in by_release(run["versions"]).items())
    return f"<h2>On every torch release (predicted from shapes)</h2><table><tr>{head}</tr>{body}</table>"


def write_run_folder(out: Path, report: dict, arrays: dict, kind, conclude: Callable[[dict], Any]) -> Any:
    """Writes report.json, report.md, report.html, the figures and the run `kind`'s own files
    (samples.jsonl, gradients.json, ...) into a hidden partial folder, then renames it to `out`: an
    interrupted run leaves no complete-looking report. Returns what the run concluded: `conclude` (the typed
    value's maker, runs.run_report.RunReport.of) of the report with its figures, which writes report.json and
    which compare reads it back as."""
    import json

    with folder_written_atomically(out) as partial:
        figures = kind.figures(report, arrays)
        for name, data in kind.extra_files(report, arrays).items():
            atomic_write_bytes(partial / name, data)
        run = conclude(report | {"figures": sorted(figures)})
        for name, data in figures.items():
            atomic_write_bytes(partial / name, data)
        atomic_write_text(partial / "report.md", render_markdown(run, kind))
        atomic_write_text(partial / "report.html", render_html(run, figures, kind))
        atomic_write_text(partial / "report.json", json.dumps(run.to_json(), indent=2) + "\n")
    return run
