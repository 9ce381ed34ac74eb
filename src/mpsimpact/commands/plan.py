"""`mpsimpact plan`: a scenario's outcome predicted from shapes alone, printed and optionally written."""

import typer

from mpsimpact.commands import options
from mpsimpact.config import PlanConfig
from mpsimpact.commands.options import option, shared


CONFIG = PlanConfig  # the options' dataclass: --help shows its defaults


def main(
    scenario: str = options.scenario(),
    batch_size: str | None = shared("--batch-size"),
    max_length: str | None = shared("--max-length"),
    model: str | None = shared("--model"),
    backward: bool | None = option("--backward", "Plan one training step: forward and gradient products."),
    index_bits: str | None = shared("--index-bits"),
    as_json: bool = options.as_json(),
    verbose: bool = options.verbose(),
    sweep: bool | None = option("--sweep", "Also tabulate the corrupted fraction over batch sizes for "
                                           "lengths 128..512."),
    figure: str | None = option("--figure", "With --sweep: write the sweep as a PNG figure to this path."),
    torch_profile: str | None = shared("--torch-profile"),
    versions: bool | None = option("--versions", "Also the outcome on every torch release, per attention "
                                                 "(eager, sdpa) and workload; written as versions.md/.png."),
    out: str | None = options.out("Also write plan.json (and versions.md/.png)",
                                  "outputs/plan-<time>/ with --versions, else none"),
    memory: str | None = option("--memory", "A Mac's unified memory (e.g. 32GB), or auto on a Mac: the "
                                "smallest demo per dtype that shows the effect and fits, and the command "
                                "to type."),
) -> None:
    """From shapes alone (no weights, nothing big allocated): which calls fault and which outputs go wrong."""
    from mpsimpact.errors import UsageError
    from mpsimpact.output.files import check_out_file, claimed_out_dir, is_inside

    options.check_output(as_json, verbose)
    plan_config = options.config_from(  # validated before anything heavy is imported
        PlanConfig, scenario=scenario, batch_size=batch_size, max_length=max_length, model=model,
        backward=backward, index_bits=index_bits, sweep=sweep, figure=figure, torch_profile=torch_profile,
        versions=versions, out=out, memory=memory,
    )
    from mpsimpact.prediction.plan import build_plan_report
    from mpsimpact.reports.plan import print_plan, write_plan_folder, write_sweep_figure
    from mpsimpact.runs.scenario import get_scenario

    if figure is not None:
        if not sweep:
            raise UsageError("--figure needs --sweep (it draws the batch-size sweep).", option="--figure")
        check_out_file(figure, "--figure")
        if out and is_inside(figure, out):  # the folder is written whole at the end: a file in it first is a clash
            raise UsageError(f"--figure '{figure}' is inside --out '{out}', which is written whole at the end; "
                             "put the figure beside it.", option="--figure")
    with claimed_out_dir(out, "plan", default=bool(versions)) as folder:
        report = build_plan_report(plan_config, get_scenario(scenario)(model=model))
        if figure:
            write_sweep_figure(report["sweep"], figure, report["model"], report["profile"]["label"])
        options.print_result(report, as_json, lambda: print_plan(report, verbose))
        if folder is not None:
            write_plan_folder(report, folder)
            typer.echo(f"Written to {folder}/", err=as_json)
