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
    console.print(profile_sentence(env))
    fallback = env["mps_fallback_env"]
    console.print(
        f"PYTORCH_ENABLE_MPS_FALLBACK={fallback!r}: it only reroutes ops MPS does not implement; "
        "bmm is implemented, so it does not help against this bug."
    )


def profile_sentence(env: dict) -> str:
    """Which fault profile applies here, where it comes from and when it was measured."""
    label, source = env["fault_profile"], env["fault_profile_source"]
    if source != "study":
        unmeasured = env["fault_profile_unmeasured"]
        rest = f"; judged conservatively: {unmeasured}" if unmeasured else ""
        return (f"Fault profile: torch {label}: a profile.json for this torch in the cache, used "
                f"automatically; measured on {env['fault_profile_measured_on']}{rest}.")
    cache = env["fault_profile_cache_file"]
    if env["fault_profile_measured"] or env["fault_profile_group"] != "unmeasured":
        return (f"Fault profile: torch {label}, from the study's table (arXiv 2609.22991); a profile.json "
                f"at {cache} would be used instead.")
    return (f"Fault profile: torch {label}: nobody measured this release, so every call any measured "
            f"release faults on is treated as faulting. Measure it on a Mac with `mpsimpact sweep --device "
            f"mps --full --out sweep/` and copy sweep/profile.json to {cache} (see README, 'Measuring a new "
            "release').")
