"""`mpsimpact check`'s outputs: the console tables, check.md and check.json (written atomically into a
fresh folder). Faulting calls repeated in every layer are shown once, with their count; the JSON keeps
every call."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mpsimpact.engine.call import op_cell
from mpsimpact.engine.mac_memory import MAC_RULES
from mpsimpact.engine.release import torch_words
from mpsimpact.output.page import (
    FAULT_WORDS, after_label, count_words, fitted_table, narrowed_words, format_cell, markdown_table, without_rule_names, release_lines,
)
from mpsimpact.output.files import atomic_write_text, folder_written_atomically

CALL_HEADER = ["calls", "where", "op: a @ b", "layouts (a, b)", "output elements", "kind (rule)",
               "first bad row (sample, head)"]


def _layer_pattern(modules: list[str]) -> str:
    """'model.layers.*.self_attn' for the same module in several layers."""
    patterns = {re.sub(r"\.\d+\.", ".*.", m + ".").rstrip(".") for m in modules}
    return patterns.pop() if len(patterns) == 1 and len(set(modules)) > 1 else modules[0]


def first_bad_cell(row: dict[str, Any], verbose: bool = True) -> str:
    """A faulting call's first wrong sample and head (plain), or its first wrong row with (sample, head) where
    known (`verbose`); plan's table too."""
    sample, head = row["first_bad_sample"], row["first_bad_head"]
    if sample is not None:
        if verbose:
            return f"{row['first_bad_batch']} ({sample}, {format_cell(head)})"
        return f"{sample}" + (f" (head {head})" if head is not None else "")
    if row["kind"] == "wrong_other":
        return "not characterised"
    if row["first_bad_batch"] is not None:
        return str(row["first_bad_batch"]) if verbose else "not known (its rows are not whole samples)"
    return "-"


def grouped_calls(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Faulting calls as table rows, one per distinct call (op, shapes, layouts, outcome, phase)."""
    table = []
    for same in _groups(rows):
        row, n = same[0], len(same)
        calls = str(row["index"]) if n == 1 else f"{n} calls ({row['index']} .. {same[-1]['index']})"
        where = _layer_pattern([r["module"] for r in same]) + (" (bwd)" if row["phase"] == "backward" else "")
        shapes = f"{row['op']}: {'x'.join(map(str, row['a']))} @ {'x'.join(map(str, row['b']))}"
        kind = f"{row['kind']} ({row['rule']}{', inferred' if row['inferred'] else ''})"
        layouts = f"{row['a_layout']}, {row['b_layout']}"
        table.append([calls, where, shapes, layouts, count_words(row["out_numel"]), kind, first_bad_cell(row)])
    return table


def _groups(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["phase"], row["op"], tuple(row["a"]), tuple(row["b"]), row["a_layout"], row["b_layout"],
               row["kind"], row["rule"], row["first_bad_batch"], re.sub(r"\d+", "*", row["module"]))
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def outcome_words(row: dict[str, Any]) -> str:
    """A faulting call's outcome in words: "abort (inferred)", "silent, all wrong"; where nobody measured
    the call (an op's case, or the whole release) "cannot tell (judged as ...)", in the glossary's words."""
    if row["rule"].startswith("unmeasured"):
        return "cannot tell (judged wrong)" if row["kind"] == "wrong_other" else f"cannot tell (judged {row['kind']})"
    if row["rule"] in MAC_RULES:  # the Mac's own refusal: its message (torch's own words) says it all
        return f"error: '{row['message']}'"
    words = FAULT_WORDS.get(row["kind"], row["kind"])
    if row["rule"].startswith("conservative:"):  # a release nobody measured: as the worst measured one
        return f"cannot tell (judged {words})"
    return words + (" (inferred)" if row["inferred"] else "")


def console_calls(rows: list[dict[str, Any]], verbose: bool = False, unit: str = "sample"):
    """The faulting calls as a console table (output.page.FittedTable), one row per distinct call: the op and its
    shapes, the outcome in words, the first wrong `unit` ("text" in `plan`, "sample" in `check`); with `verbose`
    the layouts, the rules' names and the call's rows too (CALL_HEADER)."""
    if verbose:
        return fitted_table("calls that hit a rule", CALL_HEADER, grouped_calls(rows))
    table = []
    for same in _groups(rows):
        row, n = same[0], len(same)
        calls = str(row["index"]) if n == 1 else f"{row['index']} .. {same[-1]['index']} ({n} calls)"
        where = (_layer_pattern([r["module"] for r in same]) or "-") + (" (bwd)" if row["phase"] == "backward" else "")
        table.append([calls, where, op_cell(row["op"], row["a"], row["b"]), count_words(row["out_numel"]),
                      outcome_words(row), first_bad_cell(row, verbose=False)])
    header = ["calls", "where", "op and shapes", "output elements", "outcome", f"first wrong {unit}"]
    return fitted_table("calls that hit a rule", header, table)


def traced_words(report: dict[str, Any], verbose: bool = False) -> str:
    """How the prediction was made, in plain words: from the config alone, with no weights, and how many
    operations; `verbose` (and the files): as traced ("on meta, shapes only")."""
    ops, products = report.get("ops_traced"), report["calls_traced"]
    if verbose or ops is None:
        counted = f"{ops} ops traced ({products} of them matrix products)" if ops is not None else \
            f"{products} matmul calls traced"
        return f"{counted} on meta (shapes only)"
    return f"predicted from the config alone, with no weights: {ops} operations, {products} of them matrix products"


def headline(report: dict[str, Any], every_op: bool = False, verbose: bool = True) -> str:
    """One sentence: the model, what was built, and at which geometry; `every_op`: count every traced op,
    not only the products (the console's; check.md keeps its sentence); `verbose`: how it was traced, in the
    tracer's words (check.md's too), else in plain ones."""
    m, g = report["model"], report["geometry"]
    traced = traced_words(report if every_op else {k: v for k, v in report.items() if k != "ops_traced"},
                          verbose or not every_op)
    target = f" + decoder {g['target_len']}" if g["target_len"] is not None else ""
    return (f"{m['source']} ({m['found_in']}): {m['class']} ({m['model_type']}, {m['heads']} heads, "
            f"{m['parameters']:,} parameters, {m['dtype']}), {m['attention']} attention; "
            f"{g['workload']} on {g['batch_size']} sample{'s' if g['batch_size'] != 1 else ''} of "
            f"{tokens(g['seq_len'])}{target}; {traced}.")


def facts(report: dict[str, Any], verbose: bool = True) -> list[tuple[str, str]]:
    """The summary lines after the tables, as (label, text): a label "" is a sentence of its own (the Mac, the
    advice); `verbose` (and check.md): each search's basis and the memory estimate's parts too."""
    m, p, pred, g = report["model"], report["torch_profile"], report["prediction"], report["geometry"]
    rules = f"torch {p['label']}, {'measured' if p['measured'] else 'not measured'}; from {p['source']}"
    by_batch, by_length = report["largest_safe_batch_search"], report["longest_safe_length_search"]
    mac = report.get("mac")
    on_mac = f" on {mac['label']}" if mac else ""
    on_mac += narrowed_words(g.get("index_bits") or 32)  # a narrowed index: said with every size
    lines = [
        ("task", f"{m['task']} ({m['task_basis']})"),
        ("attention", f"{m['attention']} ({m['attention_basis']})"),
        ("rules", rules),
        *([("", mac["sentence"])] if mac else []),
        ("predicted", pred["describe"] + (f"; {pred['note']}" if pred["note"] else "")),
        ("largest safe batch", _safe_words(by_batch, f"{report['largest_safe_batch']} sample"
                                           f"{'s' if report['largest_safe_batch'] != 1 else ''} at "
                                           f"{tokens(g['seq_len'])}{on_mac}", verbose, f"at {tokens(g['seq_len'])}{on_mac}")),
        ("longest safe length", _safe_words(by_length, f"{tokens(report['longest_safe_length'] or 0)} at batch "
                                            f"{g['batch_size']}{on_mac}", verbose, f"at batch {g['batch_size']}{on_mac}",
                                            f"searched 1..{by_length['high']}")),
        ("peak memory", f"about {report['estimated_peak_gib']} GiB for a real run"
                        + (f" ({report['estimated_peak_basis']})" if verbose else " (a rough estimate)")
                        + _against_mac(report['estimated_peak_gib'], mac)),
    ]
    lines += [("", advice) for advice in report["guard_advice"]]
    lines += [("generation", report["generation"])] if report.get("generation") else []
    lines += [("note", after_label(note)) for note in p["notes"]]
    return lines


def tokens(n: int) -> str:
    return f"{n} token{'s' if n != 1 else ''}"


def _safe_words(search: dict[str, Any], answer: str, verbose: bool, where: str, searched: str = "") -> str:
    """A safe size in words: "none" where not even the smallest is safe (`where`: at which other size, on which
    Mac); its basis only when `verbose`."""
    if search["largest_safe"] is None:  # not searched: the basis says why
        return search["basis"]
    said = f"{at_least(search)}{answer}" if search["largest_safe"] else f"none {where}: not even the smallest is safe"
    if not verbose:
        return said
    return f"{said} ({', '.join(filter(None, (searched, stopped(search) + search['basis'])))})"


def _against_mac(peak_gib: float, mac: dict[str, Any] | None) -> str:
    """The peak against the Mac declared: past its high watermark (MPS stops the run), or past its working set
    (it runs, swapping); "" where it is within both, or no Mac is declared."""
    if not mac:
        return ""
    watermark, working = mac.get("high_watermark_gib"), mac["working_set_gib"]
    if watermark is not None and peak_gib > watermark:
        return (f"; more than the {watermark:.1f} GiB MPS lets a process hold on {mac['label']}, so MPS stops it "
                "('MPS backend out of memory')")
    if peak_gib > working:
        return f"; past the {working:.1f} GiB Metal recommends on {mac['label']}: it runs, swapping"
    return ""


def at_least(search: dict[str, Any]) -> str:
    """"at least " where a search reached its own ceiling (BoundarySearch.at_least): the answer is a bound."""
    return "at least " if search.get("at_least") else ""


def stopped(search: dict[str, Any]) -> str:
    """Where a search that reached its own ceiling stopped, said before its basis."""
    if not search.get("at_least"):
        return ""
    return f"every size up to {search['high']:,} is clean; the search stops there: "


def stop_line(stops: list[dict[str, Any]], calls: list[dict[str, Any]] = (), unmeasured: str | None = None) -> str:
    """The first call where MPS raises or aborts (the run ends there), and how many more would; and, from
    the faulting `calls`, the first one before it that goes silently wrong in a pattern nobody
    characterised: an emulated run stops there instead ("not emulated"), which must not read as a
    disagreement with the plan."""
    first, more = stops[0], len(stops) - 1
    what = "aborts the process" if first["kind"] == "abort" else "raises"
    tail = f" ({more} later calls would too; the run never reaches them)" if more else ""
    where = first["module"] or first["phase"]
    said = f": {first['message']}" if first["kind"] == "abort" else f", {torch_words(first['message'])}"
    line = f"MPS {what} at call {first['index']} ({first['op']} in {where}){said}{tail}."
    earlier = next((c for c in calls if c["index"] < first["index"] and c["kind"] == "wrong_other"), None)
    if earlier is not None:
        line += (f" Before it, call {earlier['index']} ({earlier['op']} in {earlier['module'] or earlier['phase']}) "
                 "returns wrong values in a pattern nobody characterised; an emulated run stops there instead of "
                 "inventing them.")
    if unmeasured is not None:  # a release nobody measured: what the worst measured release does, said as that
        line = (f"Cannot tell what torch {unmeasured} does: nobody measured it on MPS (`mpsimpact sweep` on a Mac "
                f"measures it). Judged as the worst measured release would be: {line}")
    return line


def unmeasured_release(profile: dict[str, Any]) -> str | None:
    """The release of a report's profile (as to_json gives it) where nobody measured it, else None."""
    return profile.get("release") if profile.get("conservative") else None


def print_check(report: dict[str, Any], verbose: bool = False) -> None:
    """The check as console tables, fitting the terminal's width (a log's: 80 columns)."""
    from mpsimpact.output.console import Console
    console = Console()
    console.print(headline(report, every_op=True, verbose=verbose), markup=False)
    for line in release_lines(report):
        console.print(line, markup=False)
    if report["faulting_calls"]:
        console.print(console_calls(report["faulting_calls"], verbose))
    else:
        console.print("[bold green]No call crosses a limit.[/]")
    stops = report["prediction"]["stops"]
    if stops:
        line = stop_line(stops, report["faulting_calls"], unmeasured_release(report["torch_profile"]))
        line = line if verbose else without_rule_names(line)
        console.print(line, style="bold red", markup=False)
    for label, text in facts(report, verbose):
        said = text if verbose else without_rule_names(text)
        console.print(f"{label}: {said}" if label else said, markup=False)


def render_markdown(report: dict[str, Any]) -> str:
    """check.md: the same content as the console."""
    lines = [f"# mpsimpact check: {report['model']['source']}", "", headline(report), "",
             *[f"{line}  " for line in release_lines(report)], ""]
    if report["faulting_calls"]:
        table = markdown_table(CALL_HEADER, grouped_calls(report["faulting_calls"]))
        lines += ["## Calls that hit a rule", "", *table]
    else:
        lines.append("No call crosses a limit.")
    stops = report["prediction"]["stops"]
    if stops:
        lines += ["", "## Where MPS stops the run", "",
                  stop_line(stops, report["faulting_calls"], unmeasured_release(report["torch_profile"]))]
    lines += ["", "## Summary", ""] + [f"- **{label}**: {text}" if label else f"- {text}" for label, text in facts(report)]
    return "\n".join(lines) + "\n"


def write_check_folder(folder: Path, report: dict[str, Any]) -> Path:
    """Writes check.json and check.md into `folder` atomically (all or nothing)."""
    with folder_written_atomically(folder) as partial:
        atomic_write_text(partial / "check.json", json.dumps(report.to_json(), indent=2) + "\n")
        atomic_write_text(partial / "check.md", render_markdown(report))
    return folder
