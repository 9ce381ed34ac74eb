"""The `mpsimpact` command line: parses and validates at the boundary, then calls library code.

Heavy imports (torch, transformers, datasets, matplotlib) happen inside commands so that
`mpsimpact --help` is instant.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer

app = typer.Typer(
    name="mpsimpact",
    help="Show, measure and prevent PyTorch MPS's silent large-tensor bmm faults in NLP models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def reports_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turns an MpsImpactError into one line on stderr and exit code 2; anything else keeps its
    traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from mpsimpact.errors import MpsImpactError

        try:
            return command(*args, **kwargs)
        except MpsImpactError as error:
            typer.echo(f"error: {error.message}", err=True)
            raise typer.Exit(2) from None

    return wrapper


@app.command()
@reports_errors
def doctor() -> None:
    """Print versions, devices, memory and which MPS fault profile applies here."""
    from rich.console import Console
    from rich.table import Table

    from mpsimpact.runs.environment import collect_environment

    env = collect_environment()
    table = Table(title="mpsimpact doctor", show_header=False)
    for key, value in env.items():
        table.add_row(key, str(value))
    console = Console()
    console.print(table)
    if not env["mps_available"]:
        console.print("No MPS here: mpsimpact will [bold]emulate[/] MPS's faults (said in every result).")
    fallback = env["mps_fallback_env"]
    console.print(
        f"PYTORCH_ENABLE_MPS_FALLBACK={fallback!r}: it only reroutes ops MPS does not implement; "
        "bmm is implemented, so it does not help against this bug."
    )


@app.command("list")
@reports_errors
def list_scenarios() -> None:
    """List the registered scenarios."""
    from mpsimpact.runs.scenario import available

    for name, cls in available().items():
        typer.echo(f"{name:<12} {cls.description}")


def _rich_progress(progress):
    def make(description: str, total: int):
        task = progress.add_task(description, total=total)
        return lambda n: progress.advance(task, n)

    return make


@app.command()
@reports_errors
def run(
    scenario: str = typer.Argument(..., help="Scenario name (see `mpsimpact list`)."),
    batch_size: int = typer.Option(None, "--batch-size", help="Texts in the one batch [default: the scenario's, 2048]."),
    max_length: int = typer.Option(None, "--max-length", help="Padding/truncation length [default: the scenario's, 512]."),
    device: str = typer.Option("auto", "--device", help="auto (mps, else cuda, else cpu), mps, cuda or cpu."),
    emulate: bool = typer.Option(None, "--emulate/--no-emulate", help="Emulate MPS's faults [default: on unless the device is mps]."),
    guard: str = typer.Option("all", "--guard", help="off, raise, chunk, or all (three conditions side by side)."),
    out: str = typer.Option(None, "--out", help="Report folder [default: outputs/<scenario>-<timestamp>/]."),
    seed: int = typer.Option(0, "--seed"),
    expect: str = typer.Option(None, "--expect", help="clean or corrupted: exit 1 if the guard-off condition differs."),
    model: str = typer.Option(None, "--model", help="A sequence-classification model id or local path [default: embedded MiniLM]."),
    dataset: str = typer.Option(None, "--dataset", help="tweet_eval or a local CSV/JSON with text and label columns."),
    threshold: float = typer.Option(1e-3, "--threshold", help="A text is corrupted above this relative logit error."),
    reference_device: str = typer.Option("cpu", "--reference-device", help="cpu (fp32, cached), or device: chunked on the device itself, spot-checked on the CPU (big GPUs)."),
    run_length: int = typer.Option(None, "--run-length", help="Force the length the device passes run at (the plan stays at --max-length)."),
    index_bits: int = typer.Option(32, "--index-bits", help="Index width of the emulated rules; 32 is MPS. Smaller widths show the fault on small batches."),
    steps: int = typer.Option(1, "--steps", help="Training scenarios: optimiser steps on the oversized batch."),
    lr: float = typer.Option(1e-4, "--lr", help="Training scenarios: Adam learning rate."),
    torch_profile: str = typer.Option(None, "--torch-profile", help="The torch release whose MPS faults are emulated (on a Mac: guarded and planned), e.g. 2.12.1 [default: the installed one]."),
    attention: str = typer.Option("eager", "--attention", help="eager, sdpa, or both (side by side)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 (as published), float16 or bfloat16: the device passes' dtype; half precision is judged against a same-dtype reference."),
) -> None:
    """Run a scenario under each guard condition against a CPU reference, and write the reports."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from mpsimpact.reports.run import write_run_folder
    from mpsimpact.runs.runner import RunConfig, prepare_out_dir, run_scenario

    config = RunConfig(
        scenario=scenario, batch_size=batch_size, max_length=max_length, device=device, emulate=emulate,
        guard=guard, out=out, seed=seed, expect=expect, model=model, dataset=dataset, threshold=threshold,
        reference_device=reference_device, run_length=run_length, index_bits=index_bits, steps=steps, lr=lr,
        torch_profile=torch_profile, attention=attention, dtype=dtype,
    )
    config.validate()
    folder = prepare_out_dir(config)
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        report, arrays = run_scenario(config, _rich_progress(progress))
    write_run_folder(folder, report, arrays)
    _print_summary(report, folder)
    _check_expectation(report, expect)


def _print_summary(report: dict, folder) -> None:
    from rich.console import Console

    from mpsimpact.runs.kind import kind_of

    kind = kind_of(report)
    console = Console()
    geometry = report["geometry"]
    style = "bold yellow" if geometry["emulated"] else "bold green"
    console.print(f"[{style}]{geometry['mode']}[/]")
    console.print(kind.console_table(report))
    for line in kind.console_lines(report):
        console.print(line, soft_wrap=True)
    for note in report["notes"][1:]:
        console.print(f"note: {note}", soft_wrap=True)
    console.print(f"Reports written to {folder}/ ({', '.join(kind.files)})")


def _check_expectation(report: dict, expect: str | None) -> None:
    if expect is None:
        return
    off = next((c for c in report["conditions"] if c["guard"] == "off"), None)
    if off is None:
        typer.echo("error: --expect needs the guard-off condition (--guard off or all).", err=True)
        raise typer.Exit(2)
    corrupted = off["status"] != "completed" or off.get("corrupted_count", 0) > 0 or off.get("corrupted_gradient_tensors", 0) > 0
    if corrupted != (expect == "corrupted"):
        typer.echo(f"expectation failed: --expect {expect}, but guard off was {'corrupted' if corrupted else 'clean'}.", err=True)
        raise typer.Exit(1)
    typer.echo(f"expectation met: guard off is {expect}.")


@app.command("train-head")
@reports_errors
def train_head_command(
    out: str = typer.Option(None, "--out", help="Folder for sentiment_head.npz/.json [default: the installed package's data folder]."),
    limit: int = typer.Option(None, "--limit", help="Use only the first N texts of each split (quick checks)."),
) -> None:
    """Retrain the embedded classifier's head reproducibly (logistic regression on MiniLM embeddings)."""
    from pathlib import Path

    from mpsimpact.errors import UsageError
    from mpsimpact.runs.head import train_head

    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}.")
    metadata = train_head(Path(out) if out else None, limit=limit)
    typer.echo(f"held-out accuracy {metadata['heldout_accuracy']:.4f} on {metadata['heldout_texts']} texts (trained on {metadata['train_texts']})")


@app.command()
@reports_errors
def plan(
    scenario: str = typer.Argument(..., help="Scenario name (see `mpsimpact list`)."),
    batch_size: int = typer.Option(None, "--batch-size", help="Texts in the batch [default: the scenario's]."),
    max_length: int = typer.Option(None, "--max-length", help="Sequence length [default: the scenario's]."),
    model: str = typer.Option(None, "--model", help="Model id or local path; only its config is read."),
    backward: bool = typer.Option(False, "--backward", help="Plan one training step: forward and gradient products."),
    index_bits: int = typer.Option(32, "--index-bits", help="Index width of the rules; 32 is MPS."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    sweep: bool = typer.Option(False, "--sweep", help="Also tabulate the corrupted fraction over batch sizes for lengths 128..512."),
    figure: str = typer.Option(None, "--figure", help="With --sweep: write the sweep as a PNG figure to this path."),
    torch_profile: str = typer.Option(None, "--torch-profile", help="The torch release whose MPS faults decide, e.g. 2.12.1 [default: the installed one]."),
    versions: bool = typer.Option(False, "--versions", help="Also the outcome on every torch release, per attention (eager, sdpa) and phase; written as versions.md/.png."),
    out: str = typer.Option(None, "--out", help="Write plan.json (and versions.md/.png) here [default with --versions: outputs/plan-<timestamp>/]."),
    memory: str = typer.Option(None, "--memory", help="A Mac's unified memory (e.g. 32GB), or auto on a Mac: the smallest demo per dtype that shows the effect and fits, and the command to type."),
) -> None:
    """Predict from shapes alone (no weights, nothing big allocated) which calls fault and which outputs go wrong."""
    from mpsimpact.output.files import fresh_out_dir
    from mpsimpact.prediction.plan import PlanConfig, build_plan_report
    from mpsimpact.reports.plan import print_plan, write_plan_folder, write_sweep_figure
    from mpsimpact.runs.scenario import get_scenario

    config = PlanConfig(scenario, batch_size, max_length, model, backward, index_bits, sweep, figure, torch_profile, versions, out, memory)
    config.validate()
    folder = fresh_out_dir(out, "plan") if out or versions else None
    report = build_plan_report(config, get_scenario(scenario)(model=model))
    if figure and "sweep" in report:
        write_sweep_figure(report["sweep"], figure, report["model"])
    if as_json:
        import json

        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        print_plan(report)
    if folder is not None:
        write_plan_folder(report, folder)
        typer.echo(f"Written to {folder}/", err=as_json)


@app.command()
@reports_errors
def sweep(
    device: str = typer.Option("auto", "--device", help="auto, mps, cuda or cpu."),
    emulate: bool = typer.Option(None, "--emulate/--no-emulate", help="Emulate MPS's rules [default: on unless the device is mps]."),
    index_bits: int = typer.Option(32, "--index-bits", help="Index width (the emulator's, and where cells are placed); 32 is MPS."),
    quick: bool = typer.Option(True, "--quick/--full", help="quick: fp32 for every family, other dtypes for one; full: every dtype everywhere."),
    dtypes: str = typer.Option("fp32,fp16,bf16", "--dtypes", help="Comma-separated: fp32, fp16, bf16."),
    layouts: str = typer.Option(",".join(("contiguous", "a_transposed", "b_transposed", "both_sliced")), "--layouts", help="Comma-separated layouts."),
    out: str = typer.Option(None, "--out", help="Folder for sweep.jsonl, summary.json, outcome_map.png [default: outputs/sweep-<timestamp>/]."),
    expect_fixed: bool = typer.Option(False, "--expect-fixed", help="Expect every cell ok (a release that claims a fix)."),
    in_process: bool = typer.Option(False, "--in-process", help="Run real-device cells in this process (no crash isolation)."),
    torch_profile: str = typer.Option(None, "--torch-profile", help="The torch release whose rules predict (and, emulated, produce) each cell [default: the installed one]."),
) -> None:
    """Re-measure the bmm fault map on a device and check it against the fault model."""
    from mpsimpact.reports.sweep import SweepConfig, run_sweep

    config = SweepConfig(device, emulate, index_bits, quick, tuple(dtypes.split(",")), tuple(layouts.split(",")), out, expect_fixed,
                         in_process, torch_profile)
    summary = run_sweep(config)
    bad = summary["not_ok"] if expect_fixed else summary["disagree"]
    if bad:
        typer.echo(f"{bad} cells {'are not ok' if expect_fixed else 'disagree with the fault model'}.", err=True)
        raise typer.Exit(1)


@app.command()
@reports_errors
def compare(
    old: str = typer.Argument(..., help="Run (or sweep) folder from before the upgrade."),
    new: str = typer.Argument(..., help="The same kind of folder from after it."),
    out: str = typer.Option(None, "--out", help="Also write compare.md, compare.html and compare.json here (must not exist or be empty)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Compare two run (or sweep) folders across an upgrade; exit 1 when something that matters changed."""
    import json

    from mpsimpact.upgrade.compare import compare_folders
    from mpsimpact.reports.compare import print_comparison, write_comparison_folder
    from mpsimpact.output.files import fresh_out_dir

    folder = fresh_out_dir(out, "compare") if out else None
    comparison = compare_folders(old, new)
    if folder is not None:
        write_comparison_folder(folder, comparison)
    if as_json:
        typer.echo(json.dumps(comparison.to_json(), indent=2, default=str))
    else:
        print_comparison(comparison, folder)
    if comparison.exit_code:
        raise typer.Exit(comparison.exit_code)


@app.command()
@reports_errors
def check(
    model: str = typer.Argument(..., help="A hub id (offline Hugging Face cache only), a local model folder or a config.json."),
    batch_size: int = typer.Option(1, "--batch-size", help="Samples in the batch."),
    seq_len: int = typer.Option(None, "--seq-len", help="Tokens per sample (the prompt, for causal LMs) [default: the model's maximum]."),
    target_len: int = typer.Option(None, "--target-len", help="Encoder-decoders: decoder tokens [default: --seq-len]."),
    task: str = typer.Option("auto", "--task", help="auto (from the config's architectures), base, sequence-classification, token-classification, causal-lm or seq2seq."),
    attention: str = typer.Option("default", "--attention", help="eager, sdpa, or default (what this transformers picks for the model)."),
    phase: str = typer.Option("inference", "--phase", help="inference (one forward pass) or training (one step: forward and backward)."),
    torch_profile: str = typer.Option(None, "--torch-profile", help="The torch release whose MPS rules decide, e.g. 2.12.1 [default: the installed one]."),
    index_bits: int = typer.Option(32, "--index-bits", help="Index width of the rules; 32 is MPS."),
    as_json: bool = typer.Option(False, "--json", help="Print the check as one JSON object."),
    out: str = typer.Option(None, "--out", help="Also write check.json and check.md here (must not exist or be empty)."),
) -> None:
    """Is my model affected? Any Hugging Face architecture, from its config alone (meta tensors, no weights)."""
    from mpsimpact.prediction.check import CheckConfig, build_check_report
    from mpsimpact.reports.check import print_check, write_check_folder
    from mpsimpact.output.files import fresh_out_dir

    config = CheckConfig(model, batch_size, seq_len, target_len, task, attention, phase, torch_profile, index_bits, out)
    config.validate()
    folder = fresh_out_dir(out, "check") if out else None
    report = build_check_report(config)
    if as_json:
        import json

        typer.echo(json.dumps(report, indent=2, default=str))
    else:
        print_check(report)
    if folder is not None:
        write_check_folder(folder, report)
        typer.echo(f"Written to {folder}/ (check.json, check.md)", err=as_json)


@app.command()
@reports_errors
def matrix(
    scenario: str = typer.Argument(..., help="Scenario name (see `mpsimpact list`); its model and default geometry."),
    transformers: str = typer.Option(None, "--transformers", help="Comma-separated transformers releases, each probed in an environment of its own over the installed torch [default: 4.44.2,4.57.6,5.24.0]."),
    model: str = typer.Option(None, "--model", help="Model id or local path; only its config is read [default: the scenario's]."),
    batch_size: int = typer.Option(None, "--batch-size", help="Texts in the batch [default: the scenario's]."),
    max_length: int = typer.Option(None, "--max-length", help="Sequence length [default: the scenario's]."),
    out: str = typer.Option(None, "--out", help="Report folder [default: outputs/matrix-<timestamp>/]; must not exist or be empty."),
    offline: bool = typer.Option(False, "--offline", help="Use only cached environments and say which are missing (automatic when UV_OFFLINE or PIP_NO_INDEX is set)."),
) -> None:
    """Which attention each transformers release runs, what reaches MPS, and whether the guard still holds; exit 1 if not."""
    from mpsimpact.upgrade.matrix import MatrixConfig, build_matrix, split_versions
    from mpsimpact.reports.matrix import print_matrix, progress_bars, write_matrix_folder
    from mpsimpact.output.files import fresh_out_dir

    versions = {} if transformers is None else {"transformers": split_versions(transformers)}
    config = MatrixConfig(scenario, model=model, batch_size=batch_size, max_length=max_length, out=out, offline=offline, **versions)
    config.validate()
    folder = fresh_out_dir(out, "matrix")
    with progress_bars() as progress:
        report = build_matrix(config, progress=progress)
    write_matrix_folder(folder, report)
    print_matrix(report, folder)
    if not report["all_ok"]:
        raise typer.Exit(1)
