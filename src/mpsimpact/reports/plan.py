"""`mpsimpact plan` shown: rich tables on the console, plan.json (with --versions versions.md and
versions.png) in a folder, and the sweep figure."""

from __future__ import annotations

from typing import Any

from mpsimpact.output.page import (Footnotes, after_label, command_lines, fitted_table, narrowed_words,
                                   release_lines, without_rule_names)
from mpsimpact.reports.check import console_calls, stop_line, traced_words, unmeasured_release


def write_sweep_figure(table: dict, path: str, model: str, release: str = "") -> None:
    from mpsimpact.output.plot import sweep_figure
    from mpsimpact.output.files import atomic_write_bytes

    on = f"MPS, torch {release}" if release else "MPS"
    title = f"{model}: predicted corrupted fraction ({on}, eager attention)"
    atomic_write_bytes(path, sweep_figure(table, title))


def print_plan(report: dict[str, Any], verbose: bool = False) -> None:
    """The plan as console tables, fitting the terminal's width (a log's: 80 columns); `verbose`: the
    layouts, the rules' names and every message in full."""
    from mpsimpact.output.console import Console
    console = Console()
    cfg, pred = report["config"], report["prediction"]
    console.print(f"{report['model']} ({report['heads']} heads, {report['layers']} layers) on {cfg['batch_size']} "
                  f"texts of {cfg['max_length']} tokens, {traced_words(report, verbose)}.", markup=False)
    for line in release_lines(report):
        console.print(line, markup=False)
    bits = cfg.get("index_bits", 32)
    if narrowed_words(bits):
        console.print(f"Every size below is{narrowed_words(bits)} (--index-bits), every limit divided by 2^{32 - bits}: "
                      f"on MPS the same faults come at a batch 2^{32 - bits} times larger.", markup=False)
    if report.get("padding"):
        console.print(f"Traced with the model's config as given, but for this: {report['padding']}.", markup=False)
    if report.get("mac"):
        console.print(f"{report['mac']['sentence']} A tensor that reaches the buffer stops the run with MPS's "
                      "'Invalid buffer size'.", markup=False)
    calls = report["faulting_calls"]
    console.print(console_calls(calls, verbose, unit="text") if calls else "No call crosses a limit.")
    if pred["stops"]:
        line = stop_line(pred["stops"], calls, unmeasured_release(report["profile"]))
        console.print(line if verbose else without_rule_names(line), style="bold red", markup=False)
        if report.get("silent_sizes"):
            console.print(report["silent_sizes"]["sentence"], markup=False)
    elif pred["outcome"] == "wrong" and pred["first_wrong_sample"] is not None and not cfg.get("backward"):
        console.print(f"Predicted: {pred['wrong_samples']} of {cfg['batch_size']} texts silently wrong, from text "
                      f"{pred['first_wrong_sample']} (head {pred['first_wrong_head']}).", markup=False)
    else:
        console.print(f"Predicted: {pred['describe']}.", markup=False)
    ceiling = report.get("largest_safe_batch_ceiling")
    rows = [(length, f"at least {safe}" if ceiling is not None and safe >= ceiling else safe)
            for length, safe in report["largest_safe_batch_by_length"].items()]
    console.print(fitted_table(f"largest safe batch{narrowed_words(bits)}", ("max length", "texts"), rows))
    if any(isinstance(safe, str) for _, safe in rows):
        console.print(f"at least: every batch up to {ceiling:,} is clean there; the search stops at {ceiling:,}.",
                      markup=False)
    console.print(f"Estimated peak memory of a real run: {report['estimated_peak_gib']} GiB.")
    for line in report["guard_advice"]:
        console.print(line, markup=False)
    if "sweep" in report:
        _print_sweep(console, report["sweep"])
    if "versions" in report:
        _print_versions(console, report["versions"], cfg, verbose)
    if "memory" in report:
        _print_memory(console, report["memory"])


def _print_memory(console, memory: dict[str, Any]) -> None:
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
    rows = [[o["attention"], short.get(o["dtype"], o["dtype"]), f"{o['batch_size']} x {o['max_length']}",
             f"{o['corrupted_count']} from {o['first_corrupted_text']}",
             f"{o['estimated_peak_gib']} / {o['largest_tensor_gib']}", "yes" if o["fits"] else "no"]
            for o in memory["options"]]
    if rows:  # none where no length shows the silent effect: the recommendation below says why
        rules = f" (torch {memory['judged_on']}'s rules)" if memory.get("judged_on") else ""
        title = (f"the smallest clear demo per dtype and length{rules}, against {memory['basis']}; largest "
                 f"buffer {memory['largest_buffer_gib']} GiB ({memory['buffer_basis']})")
        console.print(fitted_table(title, ("attention", "dtype", "texts x tokens", "texts wrong",
                                           "GiB: peak / largest tensor", "in working set"), rows))
    rec = memory["recommendation"]
    if rec["command"]:  # a command to type stands alone on its line, never wrapped, so it pastes as printed
        console.print("Run:", style="bold", markup=False)
        _print_command(console, rec["command"])
        console.print(rec["why"], markup=False)
        return
    console.print(rec["why"], style="bold red", markup=False)
    if smallest := rec.get("smallest_mac"):
        console.print(f"The smallest Mac that can show it has {smallest['mac_gb']:g} GB ({smallest['outcome']}); "
                      "there, run:", markup=False)
        _print_command(console, smallest["command"])
    if emulated := rec.get("emulated_command"):
        quick = rec["quick_command"]  # the same scenario and model at a narrow index
        console.print("On any machine, emulated on its CPU (every result says EMULATED; at this size it takes "
                      f"minutes on a laptop's CPU, where `{quick}` shows the same effect in seconds):",
                      markup=False)
        _print_command(console, emulated)


def _print_command(console, command: str) -> None:
    """A command to type alone on its lines, broken only before an option with a shell continuation."""
    for line in command_lines(command, min(console.width, 80)):
        console.print(line, soft_wrap=True, markup=False, highlight=False)


def _print_versions(console, rows: list[dict[str, Any]], cfg: dict[str, Any], verbose: bool = False) -> None:
    from mpsimpact.reports.versions import console_table

    footnotes = Footnotes()
    title = (f"on MPS, by torch release: batch {cfg['batch_size']} x {cfg['max_length']} tokens "
             "(from shapes alone)")
    console.print(console_table(rows, title, footnotes, verbose))  # fills the footnotes
    for line in [*footnotes.lines(), *(f"note: {after_label(note)}" for note in sorted({r["note"] for r in rows if r["note"]}))]:
        console.print(line, markup=False)


def write_plan_folder(report: dict[str, Any], folder: Any) -> Any:
    """plan.json, and with --versions versions.md and versions.png, atomically into `folder` (from
    output.files.fresh_out_dir, checked before any work)."""
    import json

    from mpsimpact.output.files import atomic_write_bytes, atomic_write_text, folder_written_atomically

    with folder_written_atomically(folder) as partial:
        atomic_write_text(partial / "plan.json", json.dumps(report.to_json(), indent=2) + "\n")
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
    console.print(fitted_table("predicted corrupted fraction by batch size", header, rows, justify="right"))
