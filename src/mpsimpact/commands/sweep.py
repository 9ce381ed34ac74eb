"""`mpsimpact sweep`: the bmm fault map and the op-family cells re-measured on a device and checked against
the fault model."""

import typer

from mpsimpact.commands import options
from mpsimpact.config import SweepConfig
from mpsimpact.commands.options import option, shared


CONFIG = SweepConfig  # the options' dataclass: --help shows its defaults


def main(
    device: str | None = shared("--device"),
    emulate: bool | None = shared("--emulate/--no-emulate"),
    index_bits: str | None = shared("--index-bits"),
    quick: bool | None = option("--quick/--full", "quick: fp32 for every family, other dtypes for one; "
                                                  "full: every dtype everywhere."),
    dtypes: str | None = option("--dtypes", "Comma-separated: fp32, fp16, bf16."),
    layouts: str | None = option("--layouts", "Comma-separated layouts."),
    out: str | None = options.out("Write sweep.jsonl, families.jsonl, summary.json, profile.json and "
                                  "outcome_map.png "
                                  "(a sweep stopped early resumes when run again with the same --out)",
                                  "outputs/sweep-<time>/"),
    expect_fixed: bool | None = option("--expect-fixed", "Expect every bmm cell ok (a release that claims "
                                                         "a fix)."),
    in_process: bool | None = option("--in-process", "Run real-device cells in this process (no crash "
                                                     "isolation)."),
    torch_profile: str | None = shared("--torch-profile"),
    max_memory: str | None = option("--max-memory", "Memory one cell may hold: 20 (GiB), 20GiB or 512MiB; a "
                                                    "cell that needs more is not run and stays unmeasured.",
                                      "what the device lends this process: MPS's recommended maximum, "
                                      "else the free memory"),
    memory: str | None = option("--memory", "A Mac's unified memory (e.g. 16GB), or auto on a Mac: a cell "
                                "with a tensor reaching its largest buffer (half of it, scaled to --index-bits) "
                                "is not run ('Invalid buffer size').", "on mps this Mac's; elsewhere none"),
) -> None:
    """Re-measure the bmm fault map and the op families on a device; check them against the fault model."""
    from mpsimpact.reports.sweep import SweepConsole
    from mpsimpact.runs.sweep_run import run_sweep

    sweep_config = options.config_from(
        SweepConfig, device=device, emulate=emulate, index_bits=index_bits, quick=quick,
        dtypes=_items(dtypes, "--dtypes"), layouts=_items(layouts, "--layouts"), out=out, expect_fixed=expect_fixed,
        in_process=in_process, torch_profile=torch_profile, max_memory=max_memory, memory=memory,
    )
    summary = run_sweep(sweep_config, SweepConsole())
    bad = summary["not_ok"] if expect_fixed else summary["disagree"] + summary["families"]["disagree"]
    if bad:
        typer.echo(f"{bad} cells {'are not ok' if expect_fixed else 'disagree with the fault model'}.",
                   err=True)
        raise typer.Exit(1)


def _items(text: str | None, flag: str) -> tuple[str, ...] | None:
    """A comma-separated option's items; an item given twice is refused."""
    from mpsimpact.errors import UsageError

    if text is None:
        return None
    items = tuple(item.strip() for item in text.split(","))
    twice = next((item for i, item in enumerate(items) if item in items[:i]), None)
    if twice is not None:
        raise UsageError(f"{flag}: {twice} given twice.", option=flag)
    return items
