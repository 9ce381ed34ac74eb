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

    from mpsimpact.environment import collect_environment

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
    from mpsimpact.scenario import available

    for name, cls in available().items():
        typer.echo(f"{name:<12} {cls.description}")
