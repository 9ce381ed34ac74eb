"""`mpsimpact sweep`: validates its config, runs the grid cell by cell into a resumable folder (a killed
sweep picks up where it stopped), prints progress with the time left, the summary table and the derived
profile, and writes sweep.jsonl, summary.json, profile.json and the outcome map."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from mpsimpact.output.page import rich_table
from mpsimpact.errors import UsageError
from mpsimpact.config import GIB, SweepConfig, memory_bytes
from mpsimpact.runs.sweep import NOT_RUN, is_measured

PROGRESS_EVERY_S = 5.0  # a progress line at least this far apart (and for every cell that disagrees)
FILES = ("sweep.jsonl", "families.jsonl", "summary.json", "profile.json", "outcome_map.png")


def _cell_key(cell: dict[str, Any]) -> tuple:
    if "test" in cell:  # a family cell
        return (cell["test"],)
    return tuple(cell[key] for key in ("m", "k", "n", "batch", "layout", "dtype"))


def run_sweep(config: SweepConfig) -> dict[str, Any]:
    """Runs every cell not finished by an earlier run of the same sweep into `--out`; returns the summary
    (with "disagree" and "not_ok" counts)."""
    from rich.console import Console

    from mpsimpact.engine.release import resolve_profile
    from mpsimpact.output.files import fresh_out_dir
    from mpsimpact.output.resumable import ResumableFolder, resumable_folder
    from mpsimpact.output.page import EMULATED_LABEL
    from mpsimpact.runs.device import device_memory, resolve_device, resolve_emulation
    from mpsimpact.runs.family_cells import family_grid
    from mpsimpact.runs.row_check import resumed_rows
    from mpsimpact.runs.sweep import grid

    config.validate()
    device = resolve_device(config.device)
    emulated = resolve_emulation(config.emulate, device)
    out = fresh_out_dir(config.out, "sweep")  # claimed, and resumed, by resumable_folder below
    cells = grid(config.index_bits, config.dtypes, config.layouts, config.quick)
    family_cells = family_grid(config.index_bits)
    if not cells:
        raise UsageError(
            f"At --index-bits {config.index_bits} no batch size of the sweep's shape families sits at a "
            "threshold (their matrices have 8192 elements or more); use a larger --index-bits, e.g. 20."
        )
    profile = resolve_profile(config.torch_profile)
    budget = memory_bytes(config.max_memory) if config.max_memory else device_memory(device)
    console = Console(highlight=False)
    mode = (f"{EMULATED_LABEL} (torch {profile.label}) on {device}" if emulated
            else f"real {device} (predicted as torch {profile.label})")
    identity = {"device": device, "emulated": emulated, "index_bits": config.index_bits,
                "quick": config.quick, "dtypes": list(config.dtypes), "layouts": list(config.layouts),
                "profile": profile.ref, "profile_digest": _digest(profile.to_json()), "cells": len(cells),
                "family_cells": len(family_cells)}
    started = time.perf_counter()
    with resumable_folder(out, identity, "sweep.jsonl") as folder:
        families = ResumableFolder(folder.path, "families.jsonl")  # the same claimed folder, a second log
        kept = resumed_rows((folder, families), (cells, family_cells), device, emulated, config.index_bits,
                            profile.ref)
        done = {_cell_key(row["cell"]): row for row in kept if is_measured(row)}
        todo = [cell for cell in cells + family_cells if _cell_key(dataclasses.asdict(cell)) not in done]
        print_plan(console, mode, config, (cells + family_cells, todo), budget, device, folder.path)
        rows = dict(done)
        try:
            for row in sweep_cells(console, todo, device, emulated, config, profile.ref, budget):
                (families if "test" in row["cell"] else folder).append(row)
                rows[_cell_key(row["cell"])] = row
        except KeyboardInterrupt:
            if rows:
                console.print(f"Interrupted: {len(rows)} of {len(cells) + len(family_cells)} cells are kept in "
                              f"{folder.path}/; "
                              f"{_resume_hint(config, out)}.")
            raise
        ordered = [rows[_cell_key(dataclasses.asdict(cell))] for cell in cells]
        family_rows = [rows[_cell_key(dataclasses.asdict(cell))] for cell in family_cells]
        summary = write_results(folder.path, (ordered, family_rows), config, mode, profile, device, emulated,
                                budget)
        summary["resumed_cells"], summary["wall_s"] = len(done), round(time.perf_counter() - started, 1)
        _write_json(folder.path / "summary.json", summary)
    print_summary(console, summary, out)
    return summary


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_json(path: Path, data: Any) -> None:
    from mpsimpact.output.files import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def _resume_hint(config: SweepConfig, out: Path) -> str:
    again = "run the same command again" + ("" if config.out else f" with --out {out}")
    return f"{again} to finish the sweep"


def print_plan(console, mode: str, config: SweepConfig, grid_and_todo, budget: int, device: str,
               partial: Path) -> None:
    """What the sweep will cost, before it starts: cells, memory, the time estimate, and how to resume."""
    from mpsimpact.runs.sweep import CellClock

    cells, todo = grid_and_todo

    fits = [cell for cell in todo if cell.bytes_needed() <= budget]
    largest = max((cell.bytes_needed() for cell in fits), default=0)
    estimate = CellClock(fits, device).total_estimate
    resumed = f", {len(cells) - len(todo)} done by an earlier run (resumed)" if len(todo) < len(cells) else ""
    console.print(f"[bold]{mode}[/], index bits {config.index_bits}: {len(cells)} cells{resumed}")
    console.print(f"To run: {len(fits)} cells, the largest holding {largest / GIB:.3g} GiB, about "
                  f"{_duration(estimate)} (a rough estimate, refined as cells finish); "
                  f"{len(todo) - len(fits)} cells need more than the {budget / GIB:.3g} GiB budget "
                  "(--max-memory) and are not run (unmeasured).")
    console.print(f"Killed or interrupted? Finished cells are kept in {partial}/: "
                  f"{_resume_hint(config, partial.parent / partial.name[1:].removesuffix('.partial'))}.")


def sweep_cells(console, todo, device: str, emulated: bool, config: SweepConfig, profile: str, budget: int):
    """Yields each cell's row as it finishes, printing a progress line with the time left every few
    seconds, for every cell that disagrees, and for the last."""
    import itertools

    from mpsimpact.runs.family_cells import FamilyCell, run_family_cells
    from mpsimpact.runs.sweep import CellClock, cell_name, run_cells

    clock = CellClock(todo, device)
    started = last_line = tick = time.perf_counter()
    products = [cell for cell in todo if not isinstance(cell, FamilyCell)]
    others = [cell for cell in todo if isinstance(cell, FamilyCell)]
    rows = itertools.chain(
        run_cells(products, device, emulated, config.index_bits, config.in_process, profile, budget),
        run_family_cells(others, device, emulated, config.in_process, profile, budget))
    for number, row in enumerate(rows, 1):
        now = time.perf_counter()
        clock.finished(now - tick if is_measured(row) else 0.0)
        tick = now
        if now - last_line >= PROGRESS_EVERY_S or row["agree"] is False or number == len(todo):
            verdicts = {True: "agrees", False: "DISAGREES", None: row.get("message") or "not run"}
            verdict = verdicts[row["agree"]]
            console.print(f"[{number}/{len(todo)}] {row.get('name') or cell_name(row['cell'])}: {row['observed']}, "
                          f"{verdict}; "
                          f"{_duration(now - started)} elapsed, about {_duration(clock.seconds_left())} left")
            last_line = now
        yield row


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def write_results(folder: Path, rows_and_families, config: SweepConfig, mode: str, profile, device: str,
                  emulated: bool, budget: int) -> dict[str, Any]:
    """sweep.jsonl and families.jsonl (in grid order), profile.json and outcome_map.png into the partial
    folder; returns the summary (written by the caller): the bmm cells' counts as before, the family cells'
    under "families"."""
    import torch

    from importlib.metadata import version
    from mpsimpact.output.files import atomic_write_bytes, atomic_write_text
    from mpsimpact.runs.device import machine_name
    from mpsimpact.runs.figures import outcome_map
    from mpsimpact.runs.profile_fit import derive_profile, family_table
    from mpsimpact.runs.sweep import summarize

    rows, family_rows = rows_and_families
    for name, items in (("sweep.jsonl", rows), ("families.jsonl", family_rows)):
        atomic_write_text(folder / name, "".join(json.dumps(r) + "\n" for r in items))
    derived = derive_profile(rows, device=device, emulated=emulated, emulated_release=profile.release,
                             torch_version=torch.__version__, machine=machine_name(),
                             index_bits=config.index_bits, max_memory=budget,
                             mpsimpact_version=version("mpsimpact"), family_rows=family_rows)
    _write_json(folder / "profile.json", derived)
    title = f"{mode}, index bits {config.index_bits}"
    atomic_write_bytes(folder / "outcome_map.png", outcome_map(rows, title))
    families = {"cells": len(family_rows), "disagree": sum(r["agree"] is False for r in family_rows),
                "not_run": sum(not is_measured(r) for r in family_rows), "table": family_table(family_rows),
                "agree": [r["agree"] for r in family_rows]}
    return summarize(rows) | {
        "mode": mode, "profile": profile.to_json(), "config": dataclasses.asdict(config),
        "not_ok": sum(r["observed"] not in ("ok", NOT_RUN) for r in rows),
        "not_run": sum(not is_measured(r) for r in rows), "max_memory_bytes": budget,
        "families": families,
        "derived_profile": {key: derived[key] for key in ("release", "measured_on", "unmeasured", "cells")},
    }


def print_summary(console, summary: dict[str, Any], out: Path) -> None:
    for key, by in (("by_class", "observed class"), ("by_layout", "layout")):
        rows = [[name, *counts] for name, counts in sorted(summary[key].items())]
        columns = (by, "agree", "disagree", "skipped")
        console.print(rich_table(f"agreement with the fault model, by {by}", columns, rows))
    disagree = summary["disagree"]
    verdict = "[green]every cell agrees[/]" if not disagree else f"[red]{disagree} cells disagree[/]"
    not_run = f", {summary['not_run']} not run (over --max-memory: unmeasured)" if summary["not_run"] else ""
    console.print(f"{summary['mode']}: {summary['cells']} bmm cells, {verdict}{not_run}.")
    print_families(console, summary["families"])
    console.print(f"Written to {out}/ ({', '.join(FILES)})")
    print_profile(console, summary["derived_profile"], out)


def print_families(console, families: dict[str, Any]) -> None:
    """The family cells: what each ran, what it decides, what it showed and the code it gives."""
    verdicts = {True: "agrees", False: "DISAGREES", None: "not run (unmeasured)"}
    rows = [[t["test"], t["decides"], t["observed"], t["code"] or "-", verdicts[agree]]
            for t, agree in zip(families["table"], families["agree"])]
    console.print(rich_table("op-family cells (the study's first-pass tests, scaled)",
                             ("cell", "decides", "observed", "code", "fault model"), rows))
    disagree, not_run = families["disagree"], families["not_run"]
    verdict = "[green]every one agrees[/]" if not disagree else f"[red]{disagree} disagree[/]"
    console.print(f"{families['cells']} family cells, {verdict}"
                  + (f", {not_run} not run (over --max-memory: unmeasured)" if not_run else "") + ".")


def print_profile(console, derived: dict[str, Any], out: Path) -> None:
    """What profile.json says, and how to use and share it."""
    from mpsimpact.engine.release import cached_profile_path

    cells, release = derived["cells"], derived["release"]
    settings = cells["settings_agreeing"]
    decided = ("the bmm rules decided" if settings == 1 else
               f"{settings} settings of the bmm rules agree (calls they differ on are judged by the worst)"
               if settings else "no setting of the bmm rules agrees: bmm judged conservatively")
    families = (f" and {cells['family_cells'] - cells['family_cells_not_run']} family cells"
                if cells.get("family_cells") else "")
    console.print(f"profile.json (torch {release}): {decided}, from {cells['measured']} measured bmm cells{families}; "
                  f"judged conservatively: {', '.join(derived['unmeasured']) or 'nothing'}.")
    if derived["measured_on"]["emulated"]:
        console.print(f"Use it with --torch-profile {out}/profile.json (emulated: it reproduces the rules it "
                      "emulated; it measured no Mac).")
        return
    console.print(f"Use it with --torch-profile {out}/profile.json; for every command under torch {release} "
                  f"on this machine, copy it to {cached_profile_path(release)}; to share it, send the file.")
