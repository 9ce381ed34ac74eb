"""`mpsimpact matrix`: the transformers side of an upgrade check, one environment per release."""

import typer

from mpsimpact.commands import options
from mpsimpact.config import MatrixConfig
from mpsimpact.commands.options import option, shared


CONFIG = MatrixConfig  # the options' dataclass: --help shows its defaults


def main(
    scenario: str = options.scenario(),
    transformers: str | None = option("--transformers", "Comma-separated transformers releases, each probed "
                                      "in an environment of its own over the installed torch."),
    model: str | None = shared("--model"),
    batch_size: str | None = shared("--batch-size"),
    max_length: str | None = shared("--max-length"),
    out: str | None = options.out("Write the reports", "outputs/matrix-<time>/"),
    offline: bool | None = option("--offline", "Use only cached environments and say which are missing "
                                               "(automatic when UV_OFFLINE or PIP_NO_INDEX is set)."),
    torch_profile: str | None = shared("--torch-profile"),
) -> None:
    """Per transformers release: its attention, what reaches MPS, whether the guard holds (exit 1 if not)."""
    from mpsimpact.output.files import claimed_out_dir

    # "4.44.2, 5.24.0" -> ("4.44.2", "5.24.0"); empty items stay, for the check to name
    releases = None if transformers is None else tuple(part.strip() for part in transformers.split(","))
    matrix_config = options.config_from(  # validated before anything heavy is imported
        MatrixConfig, scenario=scenario, transformers=releases, model=model, batch_size=batch_size,
        max_length=max_length, out=out, offline=offline, torch_profile=torch_profile,
    )
    from mpsimpact.reports.matrix import print_matrix, progress_bars, write_matrix_folder
    from mpsimpact.upgrade.matrix import build_matrix

    with claimed_out_dir(out, "matrix") as folder:
        with progress_bars() as progress:
            report = build_matrix(matrix_config, progress=progress)
        write_matrix_folder(folder, report)
    print_matrix(report, folder)
    if not report["all_ok"]:
        raise typer.Exit(1)
