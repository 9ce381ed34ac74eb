"""`mpsimpact plan` shown: rich tables on the console, plan.json (with --versions versions.md and
versions.png) in a folder, and the sweep figure."""

from __future__ import annotations

from typing import Any

from mpsimpact.output.page import rich_table
from mpsimpact.reports.check import CALL_HEADER, grouped_calls


def write_sweep_figure(table: dict, path: str, model: str) -> None:
    from mpsimpact.runs.figures import sweep_figure
    from mpsimpact.output.files import atomic_write_bytes

    title = f"{model}: predicted corrupted fraction (MPS, eager attention)"
    atomic_write_bytes(path, sweep_figure(table, title))


def print_plan(report: dict[str, Any]) -> None:
    """The plan as rich tables."""
    from rich.console import Console
    console = Console()
    cfg, pred = report["config"], report["prediction"]
    console.print(f"[bold]{report['model']}[/] ({report['heads']} heads, {report['layers']} layers): "
                  f"batch {cfg['batch_size']}, max length {cfg['max_length']}, "
                  f"{report['calls_traced']} bmm/mm/SDPA calls traced on meta (shapes only), "
                  f"decided for MPS on torch {report['profile']['label']}.")
    calls = grouped_calls(report["faulting_calls"])
    console.print(rich_table("calls that hit a rule", CALL_HEADER, calls) if calls
                  else "No call crosses a limit.")
    stop = pred["stops"][0] if pred["stops"] else None
    if stop is not None:
        what = "abort the process" if stop["kind"] == "abort" else "raise"
        console.print(f"MPS would [bold red]{what}[/] at call {stop['index']}: {stop['message']}")
    else:
        console.print(f"Predicted: {pred['describe']}.")
    console.print(rich_table("largest safe batch", ("max length", "texts"),
                             list(report["largest_safe_batch_by_length"].items())))
    console.print(f"Estimated peak memory of a real run: {report['estimated_peak_gib']} GiB.")
    for line in report["guard_advice"]:
        console.print(line, soft_wrap=True)
    if "sweep" in report:
        _print_sweep(console, report["sweep"])
    if "versions" in report:
        _print_versions(console, report["versions"], cfg)
    if "memory" in report:
        _print_memory(console, report["memory"])


def _print_memory(console, memory: dict[str, Any]) -> None:
    rows = [[o["dtype"], o["max_length"], o["batch_size"], o["outcome"], f"{o['estimated_peak_gib']} GiB",
             "yes" if o["fits"] else "no"] for o in memory["options"]]
    console.print(rich_table(f"the smallest clear demo per dtype and length, against {memory['basis']}",
                             ("dtype", "max length", "batch", "predicted", "estimated peak", "fits"), rows))
    rec = memory["recommendation"]
    console.print(f"Run: [bold]{rec['command']}[/]  ({rec['why']})" if rec["command"]
                  else f"[bold red]{rec['why']}[/]", soft_wrap=True)


def _print_versions(console, rows: list[dict[str, Any]], cfg: dict[str, Any]) -> None:
    from mpsimpact.reports.versions import TITLES, by_release

    body = [[release, *(c["message"] for c in cells)] for release, cells in by_release(rows).items()]
    title = (f"on MPS, by torch release: batch {cfg['batch_size']} x {cfg['max_length']} tokens "
             "(from shapes alone)")
    console.print(rich_table(title, ["torch", *TITLES], body, show_lines=True))
    for note in sorted({r["note"] for r in rows if r["note"]}):
        console.print(f"note: {note}", soft_wrap=True)


def write_plan_folder(report: dict[str, Any], folder: Any) -> Any:
    """plan.json, and with --versions versions.md and versions.png, atomically into `folder` (from
    output.files.fresh_out_dir, checked before any work)."""
    import json

    from mpsimpact.output.files import atomic_write_bytes, atomic_write_text, folder_written_atomically

    with folder_written_atomically(folder) as partial:
        atomic_write_text(partial / "plan.json", json.dumps(report, indent=2, default=str) + "\n")
        if "versions" in report:
            from mpsimpact.reports.versions import heatmap, to_markdown

            cfg = report["config"]
            atomic_write_text(partial / "versions.md", to_markdown(report["versions"]))
            title = (f"{report['model']}: {cfg['batch_size']} x {cfg['max_length']} on MPS by torch release "
                     "(predicted from shapes)")
            atomic_write_bytes(partial / "versions.png", heatmap(report["versions"], title))
    return folder


def _print_sweep(console, table: dict) -> None:
    rows = [[row["batch"], *[(c := table[length][i])["stops"] or f"{c['corrupted_fraction']:.1%}"
                             for length in table]] for i, row in enumerate(next(iter(table.values())))]
    header = ["batch", *(f"L={n}" for n in table)]
    console.print(rich_table("predicted corrupted fraction by batch size", header, rows, justify="right"))
