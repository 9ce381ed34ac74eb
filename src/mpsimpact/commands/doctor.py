"""`mpsimpact doctor`: versions, devices, memory and the MPS fault profile that applies here."""


def main() -> None:
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
