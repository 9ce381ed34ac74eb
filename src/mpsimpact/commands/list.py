"""`mpsimpact list`: the registered scenarios (named after its word like every command module)."""

import typer


def main() -> None:
    """List the registered scenarios."""
    import shutil
    import textwrap

    from mpsimpact.runs.scenario import available

    width = min(shutil.get_terminal_size().columns, 100)
    scenarios = available()
    indent = max(map(len, scenarios), default=0) + 2
    for name, cls in scenarios.items():
        lines = textwrap.wrap(cls.description, max(width - indent, 30), break_long_words=False)
        typer.echo(f"{name:<{indent}}{lines[0]}")
        for line in lines[1:]:
            typer.echo(" " * indent + line)
