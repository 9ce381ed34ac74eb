"""The sweep run: the grid of bmm and op-family cells run cell by cell into a resumable folder (a killed
sweep picks up where it stopped), then the summary and the derived profile computed; what it shows and
writes on the way it hands to a `show` object (reports.sweep.SweepConsole)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

from mpsimpact.config import GIB, SweepConfig, memory_bytes
from mpsimpact.engine.mac_memory import MacMemory
from mpsimpact.engine.release import cache_root, cached_profile_path, judge_release
from mpsimpact.runs.sweep_summary import SweepSummary
from mpsimpact.errors import UsageError
from mpsimpact.runs.cell import NOT_RUN, is_measured, not_run_counts


def run_sweep(config: SweepConfig, show: Any) -> SweepSummary:
    """Runs every cell not finished by an earlier run of the same sweep into `--out`; returns the summary
    (with "disagree" and "not_ok" counts), each cell predicted by the release judged as every command judges it
    (engine.release.judge_release: --torch-profile's; else on a Mac the installed torch's, elsewhere 2.14.0),
    once here: a cell's process gets none (it observes, it predicts nothing)."""
    from mpsimpact.output.files import fresh_out_dir
    from mpsimpact.output.page import EMULATED_LABEL
    from mpsimpact.output.resumable import ResumableFolder, resumable_folder
    from mpsimpact.runs.device import device_memory, resolve_device, resolve_emulation
    from mpsimpact.runs.family_cells import family_grid
    from mpsimpact.runs.cell import not_run, reaches_buffer
    from mpsimpact.runs.row_check import cell_key, resumed_rows
    from mpsimpact.runs.sweep import grid

    config.validate()
    judged = judge_release(config.torch_profile)
    profile = judged.profile
    device = resolve_device(config.device)
    emulated = resolve_emulation(config.emulate, device)
    if config.in_process and emulated:
        raise UsageError("--in-process runs a real device's cells in this process instead of a worker that may "
                         f"crash; this sweep is emulated on {device}, and every emulated cell runs in this process "
                         "already: drop --in-process (or add --no-emulate).", option="--in-process")
    mac, buffer = mac_buffer(config, device)  # refuses --memory auto off a Mac before the folder is claimed
    out = fresh_out_dir(config.out, "sweep")  # claimed, and resumed, by resumable_folder below
    cells, family_cells = grid(config.index_bits, config.dtypes, config.layouts, config.quick), \
        family_grid(config.index_bits)
    if not cells:
        raise UsageError(
            f"At --index-bits {config.index_bits} no batch size of the sweep's shape families sits at a "
            "threshold (their matrices have 8192 elements or more); use a larger --index-bits, e.g. 20."
        )
    budget = memory_bytes(config.max_memory) if config.max_memory else device_memory(device)
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
                            profile)
        done = {cell_key(row["cell"]): row for row in kept if is_measured(row)}
        todo = [cell for cell in cells + family_cells if cell_key(cell.to_json()) not in done]
        fits = [cell for cell in todo if not_run(cell, budget, buffer) is None]
        largest = max((cell.bytes_needed() for cell in fits), default=0)
        over_buffer = sum(cell.bytes_needed() <= budget and reaches_buffer(cell, buffer) for cell in todo)
        show.plan(mode, judged.sentence(), config, (len(cells + family_cells), len(todo), len(fits), largest),
                  budget, folder.path, buffer=(over_buffer, buffer_words(mac, buffer)) if mac else None)
        rows = dict(done)
        try:
            for row in sweep_cells(show, todo, device, emulated, config, profile, (budget, buffer)):
                (families if "test" in row["cell"] else folder).append(row)
                rows[cell_key(row["cell"])] = row
        except KeyboardInterrupt:
            if rows:
                show.interrupted(len(rows), len(cells) + len(family_cells), folder.path, config, out)
            raise
        ordered, family_rows = ([rows[cell_key(cell.to_json())] for cell in kind]
                                for kind in (cells, family_cells))
        summary, derived, figure = results(ordered, family_rows, config, mode, profile, device, emulated, budget)
        summary["largest_buffer"] = {"bytes": buffer, "words": buffer_words(mac, buffer)} if mac else None
        summary["resumed_cells"], summary["wall_s"] = len(done), round(time.perf_counter() - started, 1)
        summary = SweepSummary.of(summary)  # what the sweep concludes: the typed value compare reads back
        show.write(folder.path, (ordered, family_rows), derived, figure, summary)
    show.summary(summary, out, cached_profile_path(derived["release"]))
    return summary


def mac_buffer(config: SweepConfig, device: str) -> tuple[MacMemory | None, int | None]:
    """The Mac whose largest buffer no tensor of a cell may reach (MPS refuses it: "Invalid buffer size"),
    and that buffer in bytes: --memory's Mac (scaled to --index-bits, as every limit is, so a small sweep
    skips the cells a full-size one on that Mac would) or, on MPS, this Mac's own (measured by `doctor`, else
    assumed; the bytes MPS refuses, whatever the width); (None, None) elsewhere: no Mac, nothing changes."""
    from mpsimpact.engine.mac_memory import this_mac

    mac = config.mac
    if mac is not None:
        return mac, mac.buffer_at(config.index_bits)
    if device == "mps":
        mac = this_mac(cache_root())
        return mac, mac.largest_buffer
    return None, None


def buffer_words(mac: MacMemory, buffer: int) -> str:
    """"a 16 GB Mac's largest buffer 8.0 GiB (assumed: half of 16 GB unified memory)", with the bytes judged
    where the index width scales them."""
    scaled = f", {buffer / GIB:.3g} GiB at this index width" if buffer != mac.largest_buffer else ""
    return f"{mac.label}'s {mac.buffer_words()}{scaled}"


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sweep_cells(show: Any, todo, device: str, emulated: bool, config: SweepConfig, profile: Any,
                limits: tuple[int, int | None]):
    """Yields each cell's row as it finishes, with the time spent and an estimate of the time left for
    `show.cell`; `limits`: the memory budget and the Mac's largest buffer (None: no Mac), in bytes."""
    import itertools

    from mpsimpact.runs.cell import CellClock, run_cells

    clock = CellClock(todo, device)
    started = tick = time.perf_counter()
    rows = itertools.chain.from_iterable(  # a run of cells of one kind at a time: the bmm cells, then the others
        run_cells(list(cells), device, emulated, config.index_bits, config.in_process, profile, *limits)
        for _, cells in itertools.groupby(todo, type))
    for number, (cell, row) in enumerate(zip(todo, rows), 1):
        now = time.perf_counter()
        clock.finished(now - tick if is_measured(row) else 0.0)
        tick = now
        if number == 1 and len(todo) > 1:  # the first estimate: the plan's cells and this measured one
            show.estimate(cell.name, now - started, now - started + clock.seconds_left())
        show.cell((number, len(todo)), cell.name, row, now - started, clock.seconds_left())
        yield row


def results(rows: list[dict[str, Any]], family_rows: list[dict[str, Any]], config: SweepConfig, mode: str, profile,
            device: str, emulated: bool, budget: int) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """(the summary: the bmm cells' counts as before, the family cells' under "families"; the derived
    profile; the outcome map as PNG)."""
    import torch

    from importlib.metadata import version
    from mpsimpact.runs.device import machine_name
    from mpsimpact.runs.figures import outcome_map
    from mpsimpact.runs.profile_fit import derive_profile, family_table
    from mpsimpact.runs.sweep import summarize

    derived = derive_profile(rows, device=device, emulated=emulated, emulated_release=profile.release,
                             torch_version=torch.__version__, machine=machine_name(),
                             index_bits=config.index_bits, max_memory=budget,
                             mpsimpact_version=version("mpsimpact"), family_rows=family_rows)
    figure = outcome_map(rows, f"{mode}, index bits {config.index_bits}")
    families = {"cells": len(family_rows), "disagree": sum(r["agree"] is False for r in family_rows),
                "not_run": sum(not is_measured(r) for r in family_rows),
                "not_run_why": not_run_counts(family_rows), "table": family_table(family_rows),
                "agree": [r["agree"] for r in family_rows]}
    return summarize(rows) | {
        "mode": mode, "profile": profile.to_json(), "config": dataclasses.asdict(config),
        "not_ok": sum(r["observed"] not in ("ok", NOT_RUN) for r in rows),
        "not_run": sum(not is_measured(r) for r in rows), "not_run_why": not_run_counts(rows),
        "max_memory_bytes": budget,
        "families": families,
        "derived_profile": {key: derived[key] for key in ("release", "measured_on", "unmeasured", "cells")},
    }, derived, figure
