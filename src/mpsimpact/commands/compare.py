"""`mpsimpact compare`: two run (or sweep) folders across an upgrade."""

import typer

from mpsimpact.commands import options


def main(
    old: str = typer.Argument(..., help="Run (or sweep) folder from before the upgrade."),
    new: str = typer.Argument(..., help="The same kind of folder from after it."),
    out: str | None = options.out("Also write compare.md, compare.html and compare.json"),
    as_json: bool = options.as_json(),
) -> None:
    """Compare two run (or sweep) folders across an upgrade; exit 1 when something that matters changed, 3 when
    a side could not run (cannot tell)."""
    from mpsimpact.output.files import claimed_out_dir
    from mpsimpact.reports.compare import print_comparison, write_comparison_folder
    from mpsimpact.upgrade.compare import compare_folders

    with claimed_out_dir(out, "compare", default=False) as folder:
        comparison = compare_folders(old, new)
        if folder is not None:
            write_comparison_folder(folder, comparison)
    options.print_result(comparison.to_json(), as_json, lambda: print_comparison(comparison, folder))
    if comparison.exit_code:
        raise typer.Exit(comparison.exit_code)
