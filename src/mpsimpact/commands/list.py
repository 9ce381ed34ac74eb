"""`mpsimpact list`: the registered scenarios (named after its word like every command module)."""

import typer


def main() -> None:
    """List the registered scenarios."""
    from mpsimpact.runs.scenario import available

    for name, cls in available().items():
        typer.echo(f"{name:<12} {cls.description}")
