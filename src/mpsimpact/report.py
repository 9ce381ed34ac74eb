"""Reports: atomic file writes, and the run's report.json, samples.jsonl, report.md and a
self-contained report.html."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# The conditions table lives with the run kinds; `columns` and `condition_rows` stay importable from here.
from mpsimpact.run_kind import columns, condition_rows, kind_of
from mpsimpact.run_kind import format_cell as _fmt

SCHEMA_VERSION = 1
# The banner of every HTML page, by whether MPS was emulated: amber for emulated, green for real.
BANNER_COLOURS = {True: "#fde2a7", False: "#c7e9c0"}
# The house look of every self-contained HTML page (run, compare, matrix); pages add their own rules.
HTML_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    ".banner{padding:.6em 1em;font-weight:bold;border-radius:6px}img{max-width:100%}figure{margin:1em 0}"
)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file and a rename: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; reports are meant to be shared
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def fresh_out_dir(out: str | None, default_prefix: str) -> Path:
    """The report folder: `out`, or outputs/<prefix>-<timestamp>/; refuses one that already holds
    files (nothing is overwritten)."""
    from mpsimpact.errors import UsageError

    folder = Path(out) if out else Path("outputs") / f"{default_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    if folder.exists() and any(folder.iterdir()):
        raise UsageError(f"Output folder '{folder}' already exists and is not empty; pass another --out.")
    return folder


@contextlib.contextmanager
def folder_written_atomically(out: Path) -> Iterator[Path]:
    """Yields a hidden partial folder to fill; renames it to `out` only when the block completes,
    and removes it otherwise: an interrupted run leaves no complete-looking report."""
    out = Path(out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
        if out.exists():
            out.rmdir()  # fresh_out_dir allowed only an empty folder
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def render_markdown(run: dict) -> str:
    """report.md: the headline, the geometry, the conditions table, collapse and notes."""
    g, p = run["geometry"], run["prediction"]
    lines = [
        f"# mpsimpact run: {run['config']['scenario']}",
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
        from mpsimpact.versions import to_markdown

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
<style>{HTML_STYLE}.banner{{background:{BANNER_COLOURS[bool(g['emulated'])]}}}</style></head><body>
<h1>mpsimpact run: {html.escape(run['config']['scenario'])}</h1>
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
    from mpsimpact.versions import ATTENTIONS, PHASES

    columns = [(a, p) for a in ATTENTIONS for p in PHASES]
    head = "".join(f"<th>{a}, {p}</th>" for a, p in columns)
    body = ""
    for release in dict.fromkeys(r["release"] for r in rows):
        cells = {(r["attention"], r["phase"]): r["message"] for r in rows if r["release"] == release}
        body += f"<tr><th>{html.escape(release)}</th>" + "".join(f"<td>{html.escape(cells[c])}</td>" for c in columns) + "</tr>"
    return f"<h2>On every torch release (predicted from shapes)</h2><table><tr><th>torch</th>{head}</tr>{body}</table>"


def samples_jsonl(report: dict, arrays: dict) -> str:
    """One line per text and completed condition."""
    import json

    names, ref, gold = report["label_names"], arrays["reference"], arrays["gold"]
    ref_pred = ref.argmax(axis=1)
    threshold = report["reference"].get("threshold", report["config"]["threshold"])
    lines = []
    for guard_mode, logits in arrays.get("logits", {}).items():
        err = arrays["errors"][guard_mode]
        for i, text in enumerate(arrays["texts"]):
            lines.append(json.dumps({
                "guard": guard_mode, "position": i, "text": text, "gold": names[gold[i]],
                "reference_pred": names[ref_pred[i]], "device_pred": names[int(logits[i].argmax())],
                "relative_error": float(err[i]), "corrupted": bool(err[i] > threshold),
                "reference_logits": ref[i].round(6).tolist(), "device_logits": logits[i].round(6).tolist(),
            }))
    return "\n".join(lines) + "\n"


def logits_npz(arrays: dict) -> bytes:
    """Full-precision logits: the reference and each completed condition (for comparisons)."""
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, reference=arrays["reference"], gold=arrays["gold"], **{f"guard_{k}": v for k, v in arrays.get("logits", {}).items()})
    return buffer.getvalue()


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
