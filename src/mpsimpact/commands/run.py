"""`mpsimpact run`: a scenario under each guard condition against a CPU reference, and its reports."""

from typing import Any

import typer

from mpsimpact.commands import options
from mpsimpact.config import QUICK_SIZES, RunConfig
from mpsimpact.commands.options import option, shared


# --quick: 16 texts of 256 tokens at a 23-bit index (LIMIT 2**23 = 8,388,608), where P (16*12, 256, 256)
# = 12,582,912 elements wraps from text 10: the same fault as 4096 x 512 at 32 bits, in seconds. For a model
# where that shows no silent effect (another call stops first), the run chooses the sizes not given
# (RunConfig.quick_sizes, runs.runner.quick_config) and says so.
QUICK = (16, 256, 23)
QUICK_TEXT = "--batch-size 16 --max-length 256 --index-bits 23"


CONFIG = RunConfig  # the options' dataclass: --help shows its defaults


def main(
    scenario: str = options.scenario(),
    batch_size: str | None = shared("--batch-size"),
    max_length: str | None = shared("--max-length"),
    device: str | None = shared("--device"),
    emulate: bool | None = shared("--emulate/--no-emulate"),
    guard: str | None = option("--guard", "off, raise, chunk, or all (three conditions side by side)."),
    out: str | None = options.out("Write the reports", "outputs/<scenario>-<time>/"),
    seed: str | None = options.number("--seed", "Seeds torch before the run."),
    expect: str | None = option("--expect", "clean or corrupted: exit 1 if the guard-off condition differs."),
    model: str | None = shared("--model"),
    dataset: str | None = option("--dataset", "tweet_eval or a local CSV/JSON with text and label columns.",
                                 options.THE_SCENARIOS),
    threshold: str | None = options.number("--threshold", "A text is corrupted above this relative logit error.",
                                           whole=False),
    reference_device: str | None = option("--reference-device", "cpu (fp32, cached), or device: chunked on "
                                          "the device itself, spot-checked on the CPU (big GPUs)."),
    run_length: str | None = options.number("--run-length", "Force the length the device passes run at (the plan "
                                    "stays at --max-length).", "--max-length"),
    index_bits: str | None = shared("--index-bits"),
    steps: str | None = options.number("--steps", "Training scenarios: optimiser steps on the oversized batch."),
    lr: str | None = options.number("--lr", "Training scenarios: Adam learning rate.", whole=False),
    torch_profile: str | None = shared("--torch-profile"),
    attention: str | None = option("--attention", "eager, sdpa, both (side by side), or blocked_eager: eager's "
                                   "P V call, the rest in blocks of texts (fits a smaller Mac)."),
    dtype: str | None = option("--dtype", "float32 (as published), float16 or bfloat16: the device passes' "
                                          "dtype; half precision is judged against a same-dtype reference."),
    memory: str | None = shared("--memory"),
    quick: bool = typer.Option(False, "--quick", help=f"The 20-second demo: {QUICK_TEXT} unless given "
                               "(emulated at a narrow index width, and said so); for a model where that is not "
                               "silent, the sizes not given that are (said so)."),
    verbose: bool = options.verbose(),
) -> None:
    """Run a scenario under each guard condition against a CPU reference, and write the reports."""
    quick_sizes = None
    if quick:
        asked = (batch_size, max_length, index_bits)  # QUICK_SIZES: QUICK's fields, in its order
        quick_sizes = tuple(name for name, value in zip(QUICK_SIZES, asked) if value is None)
        batch_size, max_length, index_bits = (value if value is not None else default
                                              for value, default in zip(asked, QUICK))
    given = dict(scenario=scenario, batch_size=batch_size, max_length=max_length, device=device, emulate=emulate,
                 guard=guard, out=out, seed=seed, expect=expect, model=model, dataset=dataset, threshold=threshold,
                 reference_device=reference_device, run_length=run_length, index_bits=index_bits, steps=steps,
                 lr=lr, torch_profile=torch_profile, attention=attention, dtype=dtype, memory=memory)
    run_config = options.config_from(RunConfig, **given, quick_sizes=quick_sizes)  # before heavy imports
    from mpsimpact.output.files import claimed_out_dir
    from mpsimpact.output.progress import progress_steps
    from mpsimpact.reports.run import write_run_folder
    from mpsimpact.runs.kinds import kind_of
    from mpsimpact.runs.run_report import RunReport
    from mpsimpact.runs.runner import check_run, run_scenario

    check_run(run_config, {name for name, value in given.items() if value is not None})  # before any work
    with claimed_out_dir(run_config.out, run_config.scenario, needed=run_config.written_bytes()) as folder:
        with progress_steps() as steps:
            report, arrays = run_scenario(run_config, steps)
        kind = kind_of(report)
        report = write_run_folder(folder, report, arrays, kind, RunReport.of)
    _print_summary(report, folder, kind, verbose)
    _check_expectation(report, expect, kind)


def _print_summary(report: dict, folder: Any, kind: Any, verbose: bool = False) -> None:
    from mpsimpact.output.console import Console

    from mpsimpact.output.page import Footnotes, after_label, release_lines

    footnotes = Footnotes()
    console = Console()
    geometry = report["geometry"]
    console.print(kind.headline(report, plain=not verbose), style="bold", markup=False)
    for line in release_lines(report):
        console.print(line, markup=False)
    console.print(f"{geometry['mode']}.", style="bold yellow" if geometry["emulated"] else "bold green", markup=False)
    console.print(kind.console_table(report, footnotes, verbose))  # fills the footnotes
    notes = [f"note: {after_label(note)}" for note in report["notes"][1:]]
    for line in [*kind.guard_lines(report), *footnotes.lines(), *kind.console_lines(report, verbose), *notes]:
        console.print(line, markup=False)
    console.print(f"Reports written to {folder}/ ({', '.join(kind.files)}).", markup=False)


def _check_expectation(report: dict, expect: str | None, kind: Any) -> None:
    if expect is None:
        return
    off = next(c for c in report["conditions"] if c["guard"] == "off")  # RunConfig.validate: --expect needs it
    corrupted = off["status"] != "completed" or kind.is_corrupted(off)
    if corrupted != (expect == "corrupted"):
        found = "corrupted" if corrupted else "clean"
        typer.echo(f"expectation failed: --expect {expect}, but guard off was {found}.", err=True)
        raise typer.Exit(1)
    typer.echo(f"expectation met: guard off is {expect}.")
