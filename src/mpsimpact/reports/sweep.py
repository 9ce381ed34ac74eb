"""`mpsimpact sweep`: validates its config, runs the grid, prints the summary table and writes
sweep.jsonl, summary.json and the outcome map (atomically, into a fresh folder)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from mpsimpact.output.page import rich_table
from mpsimpact.errors import UsageError
from mpsimpact.config import DEVICE, INDEX_BITS, TORCH_PROFILE, Check, Validated, option
from mpsimpact.runs.sweep import DTYPES, LAYOUTS


@dataclasses.dataclass(frozen=True)
class SweepConfig(Validated):
    """What `mpsimpact sweep` was asked; embedded in summary.json."""

    device: str = option("auto", DEVICE)
    emulate: bool | None = None
    index_bits: int = option(32, INDEX_BITS)
    quick: bool = True
    dtypes: tuple[str, ...] = option(tuple(DTYPES), Check("--dtypes", choices=tuple(DTYPES)))
    layouts: tuple[str, ...] = option(LAYOUTS, Check("--layouts", choices=LAYOUTS))
    out: str | None = None
    expect_fixed: bool = False
    in_process: bool = False
    torch_profile: str | None = option(None, TORCH_PROFILE)


def run_sweep(config: SweepConfig) -> dict[str, Any]:
    """Runs every cell into a folder claimed first; returns the summary (with "disagree" and "not_ok")."""
    from mpsimpact.output.files import claimed_out_dir

    config.validate()
    with claimed_out_dir(config.out, "sweep") as out:
        return _run_sweep(config, out)


def _run_sweep(config: SweepConfig, out: Path) -> dict[str, Any]:
    from rich.console import Console

    from mpsimpact.runs.device import resolve_device, resolve_emulation
    from mpsimpact.engine.release import resolve_profile
    from mpsimpact.output.page import EMULATED_LABEL
    from mpsimpact.runs.figures import outcome_map
    from mpsimpact.output.files import atomic_write_bytes, atomic_write_text, folder_written_atomically
    from mpsimpact.runs.sweep import grid, run_cells, summarize

    device = resolve_device(config.device)
    emulated = resolve_emulation(config.emulate, device)
    cells = grid(config.index_bits, config.dtypes, config.layouts, config.quick)
    if not cells:
        raise UsageError(f"At --index-bits {config.index_bits} no batch size of the sweep's shape families "
                         "sits at a threshold (their matrices have 8192 elements or more); use a larger "
                         "--index-bits, e.g. 20.")
    console = Console()
    profile = resolve_profile(config.torch_profile)
    mode = (f"{EMULATED_LABEL} (torch {profile.label}) on {device}" if emulated
            else f"real {device} (predicted as torch {profile.label})")
    console.print(f"[bold]{mode}[/], index bits {config.index_bits}: {len(cells)} cells")
    rows = []
    with console.status("sweeping") as status:
        for row in run_cells(cells, device, emulated, config.index_bits, config.in_process, profile.release):
            rows.append(row)
            status.update(f"{len(rows)}/{len(cells)} cells")
    summary = summarize(rows) | {
        "mode": mode, "profile": profile.to_json(), "config": dataclasses.asdict(config),
        "not_ok": sum(r["observed"] != "ok" for r in rows)}
    with folder_written_atomically(out) as partial:
        atomic_write_text(partial / "sweep.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        atomic_write_text(partial / "summary.json", json.dumps(summary, indent=2) + "\n")
        atomic_write_bytes(partial / "outcome_map.png",
                           outcome_map(rows, f"{mode}, index bits {config.index_bits}"))
    print_summary(console, summary, out)
    return summary


def print_summary(console, summary: dict[str, Any], out: Path) -> None:
    for key, by in (("by_class", "observed class"), ("by_layout", "layout")):
        rows = [[name, *counts] for name, counts in sorted(summary[key].items())]
        console.print(rich_table(f"agreement with the fault model, by {by}", (by, *summary["columns"]), rows))
    verdict = ("[green]every cell agrees[/]" if not summary["disagree"]
               else f"[red]{summary['disagree']} cells disagree[/]")
    console.print(f"{summary['mode']}: {summary['cells']} cells, {verdict}. Written to {out}/ "
                  "(sweep.jsonl, summary.json, outcome_map.png)")
