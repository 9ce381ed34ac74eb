"""The run's report folder: report.json, report.md, a self-contained report.html, the figures and the
run kind's own files, written atomically."""

from __future__ import annotations

from pathlib import Path

from mpsimpact.output.files import atomic_write_bytes, atomic_write_text, folder_written_atomically
from mpsimpact.output.page import BANNER_COLOURS, HTML_STYLE
from mpsimpact.output.page import format_cell as _fmt
from mpsimpact.runs import classify_kind, embed_kind, train_kind  # noqa: F401  (they register their kinds)
from mpsimpact.runs.kind import columns, condition_rows, kind_of


def render_markdown(run: dict) -> str:
    """report.md: the headline, the geometry, the conditions table, collapse and notes."""
    g, p = run["geometry"], run["prediction"]
    lines = [
        f"# mpsimpact run: {run['config']['scenario']}",
        "",
        f"**{kind_of(run).headline(run)}**",
        "",
        f"**{g['mode']}** on {run['environment']['machine']}, torch {run['environment']['torch']}, "
        f"transformers {run['environment']['transformers']}.",
        "",
        f"Model `{run['model']}`, data: {run['data_source']}. Batch {g['batch_size']}, max length {g['max_length']}"
        + (f" (run at {g['run_length']} tokens)" if g["run_length"] != g["max_length"] else "") + ".",
        f"Predicted from shapes alone: first corrupted text {_fmt(p['first_corrupted_text'])} (head {_fmt(p['first_corrupted_head'])}), "
        f"{p['corrupted_count']} of {g['batch_size']} texts.",
        "",
        "| " + " | ".join(title for _, title in columns(run)) + " |",
        "|" + "---|" * len(columns(run)),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in condition_rows(run)]
    lines.append("")
    for c in run["conditions"]:
        for op in c.get("faulted_ops", []):
            lines.append(f"- guard {c['guard']}: {op['op']} {op['a']} @ {op['b']} was {op['kind']} in {' and '.join(op['phases'])}.")
        if c.get("collapse", {}).get("class"):
            col = c["collapse"]
            lines.append(
                f"- guard {c['guard']}: corrupted texts collapse onto **{col['class']}**: {col['device_share']:.1%} on the device "
                f"vs {col['reference_share']:.1%} in the reference (chi-square p = {_fmt(c['significance']['chi2_collapse_p'])})."
            )
        if c.get("message"):
            lines.append(f"- guard {c['guard']}: {c['status']}: `{c['message']}`")
    lines += kind_of(run).markdown_lines(run)
    lines += ["", *[f"- {note}" for note in run["notes"]], "", *[f"![{name}]({name})" for name in run["figures"]]]
    if run.get("versions"):
        from mpsimpact.reports.versions import to_markdown

        lines += ["", "## On every torch release (predicted from shapes, full-scale geometry)", "", to_markdown(run["versions"])]
    return "\n".join(lines) + "\n"


def _inline(text: str) -> str:
    """Markdown's **bold** and `code` as HTML, in already-escaped text."""
    import re

    return re.sub(r"`([^`]+)`", r"<code>\1</code>", re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text))


def render_html(run: dict, figures: dict[str, bytes]) -> str:
    """report.html: self-contained (figures inlined), for talks."""
    import base64
    import html

    body = render_markdown(run)
    head_row = "".join(f"<th>{html.escape(t)}</th>" for _, t in columns(run))
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in condition_rows(run))
    notes = "".join(f"<li>{_inline(html.escape(line[2:]))}</li>" for line in body.splitlines() if line.startswith("- "))
    images = "".join(
        f'<figure><img alt="{name}" src="data:image/png;base64,{base64.b64encode(data).decode()}"><figcaption>{name}</figcaption></figure>'
        for name, data in figures.items()
    )
    g = run["geometry"]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>mpsimpact {html.escape(run['config']['scenario'])}</title>
<style>{HTML_STYLE}.banner{{background:{BANNER_COLOURS[bool(g['emulated'])]}}}.headline{{font-size:1.5em;font-weight:bold}}</style></head><body>
<h1>mpsimpact run: {html.escape(run['config']['scenario'])}</h1>
<p class="headline">{html.escape(kind_of(run).headline(run))}</p>
<p class="banner">{html.escape(g['mode'])}</p>
<p>Model <code>{html.escape(run['model'])}</code>; data: {html.escape(run['data_source'])}; batch {g['batch_size']}, max length {g['max_length']};
torch {html.escape(run['environment']['torch'])} on {html.escape(run['environment']['machine'])}.</p>
<table><tr>{head_row}</tr>{rows}</table><ul>{notes}</ul>{images}{_versions_html(run)}</body></html>
"""


def _versions_html(run: dict) -> str:
    """The version table as an HTML table (empty when the report has none)."""
    import html

    rows = run.get("versions")
    if not rows:
        return ""
    from mpsimpact.prediction.version_table import ATTENTIONS, PHASES

    columns = [(a, p) for a in ATTENTIONS for p in PHASES]
    head = "".join(f"<th>{a}, {p}</th>" for a, p in columns)
    body = ""
    for release in dict.fromkeys(r["release"] for r in rows):
        cells = {(r["attention"], r["phase"]): r["message"] for r in rows if r["release"] == release}
        body += f"<tr><th>{html.escape(release)}</th>" + "".join(f"<td>{html.escape(cells[c])}</td>" for c in columns) + "</tr>"
    return f"<h2>On every torch release (predicted from shapes)</h2><table><tr><th>torch</th>{head}</tr>{body}</table>"


def write_run_folder(out: Path, report: dict, arrays: dict) -> Path:
    """Writes report.json, report.md, report.html, the figures and the run kind's own files
    (samples.jsonl, gradients.json, ...) into a hidden partial folder, then renames it to `out`: an interrupted run leaves no complete-looking report."""
    import json

    kind = kind_of(report)
    with folder_written_atomically(out) as partial:
        figures = kind.figures(report, arrays)
        for name, data in kind.extra_files(report, arrays).items():
            atomic_write_bytes(partial / name, data)
        report = report | {"figures": sorted(figures)}
        for name, data in figures.items():
            atomic_write_bytes(partial / name, data)
        atomic_write_text(partial / "report.md", render_markdown(report))
        atomic_write_text(partial / "report.html", render_html(report, figures))
        atomic_write_text(partial / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    return Path(out)
