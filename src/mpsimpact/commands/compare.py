"""`mpsimpact compare`: two run (or sweep) folders across an upgrade."""

import typer

from mpsimpact.commands import options


def main(
    old: str = typer.Argument(..., help="Run (or sweep) folder from before the upgrade."),
    new: str = typer.Argument(..., help="The same kind of folder from after it."),
    out: str | None = options.out("Also write compare.md, compare.html and compare.json"),
    as_json: bool = options.as_json(),
) -> None:
    """Compare two run or sweep folders across an upgrade; exit 1 on a change that matters, 3 if it cannot tell.

    It cannot tell when nothing changed but a side did not run or ran an unmeasured release. Bad input: exit 2."""
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
