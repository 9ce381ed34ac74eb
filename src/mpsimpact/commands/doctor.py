"""`mpsimpact doctor`: versions, devices, memory and the MPS fault profile that applies here."""


def main() -> None:
    """Print versions, devices, memory and which MPS fault profile applies here."""
    from mpsimpact.output.console import Console

    from mpsimpact.engine.release import judge_release
    from mpsimpact.output.page import fitted_table
    from mpsimpact.runs.environment import collect_environment

    env = collect_environment()
    console = Console()
    release = judge_release(None, apple_gpu=env["mps_available"])
    console.print(fitted_table("mpsimpact doctor", ("what", "here"), doctor_rows(env, release)))
    if not env["mps_available"]:
        console.print("No MPS here: mpsimpact will emulate MPS's faults (said in every result).", markup=False)
    console.print(profile_sentence(env), markup=False)
    console.print(mac_sentence(env["mps_available"]), markup=False)
    console.print(release_rule(release), markup=False)
    fallback = env["mps_fallback_env"]
    said = "is not set" if fallback is None else f"is {fallback!r}"
    console.print(f"PYTORCH_ENABLE_MPS_FALLBACK {said}. Setting it would not help: it only reroutes ops MPS does "
                  "not implement, and bmm is implemented.", markup=False)


def doctor_rows(env: dict, release) -> list[list[str]]:
    """The environment in words a person reads: yes and no, sizes with their unit, and rows with nothing to say
    left out (report.json keeps every field as it is)."""
    profile = f"torch {env['fault_profile']}: " + (
        "measured (the study)" if env["fault_profile_source"] == "study" and env["fault_profile_measured"] else
        f"measured by a sweep on {env['fault_profile_measured_on']}" if env["fault_profile_measured_on"] else
        "nobody measured it (judged conservatively)")
    rows = [["mpsimpact", env["mpsimpact"]], ["python", env["python"]], ["torch", env["torch"]],
            ["transformers", env["transformers"]], ["machine", env["machine"]],
            ["Apple GPU (MPS)", "yes" if env["mps_available"] else "no"],
            ["NVIDIA GPU (CUDA)", env["cuda_device"] or ("yes" if env["cuda_available"] else "no")],
            ["host memory", f"{env['host_memory_gib']} GiB ({env['host_memory_available_gib']} GiB free)"]]
    if "mps_recommended_max_memory_gib" in env:
        rows.append(["Metal lends a process", f"{env['mps_recommended_max_memory_gib']} GiB"])
    rows += [["installed torch's MPS faults", profile], ["the commands judge", f"torch {release.profile.label}"]]
    if env["fault_profile_unmeasured"]:
        rows.append(["judged conservatively", env["fault_profile_unmeasured"]])
    if env["fault_profile_cache_file"]:
        rows.append(["a measured profile would be read from", env["fault_profile_cache_file"]])
    rows.append(["PYTORCH_ENABLE_MPS_FALLBACK", env["mps_fallback_env"] or "not set"])
    return rows


def release_rule(release) -> str:
    """The rule every command (run, plan, check, matrix) follows for the release it judges, and its
    outcome here."""
    return ("Which torch release the commands judge: the one --torch-profile names; else on a Mac the "
            "installed torch; else (no Apple GPU: the installed torch says nothing about a Mac) 2.14.0, a "
            f"release measured on Macs where the bug is silent (the published demo's). {release.sentence()}")


def profile_sentence(env: dict) -> str:
    """Which fault profile applies here, where it comes from and when it was measured."""
    label, source = env["fault_profile"], env["fault_profile_source"]
    if source != "study":
        unmeasured = env["fault_profile_unmeasured"]
        rest = f"; judged conservatively: {unmeasured}" if unmeasured else ""
        return (f"The installed torch's fault profile: torch {label}: a profile.json for this torch in the cache, "
                f"used automatically; measured on {env['fault_profile_measured_on']}{rest}.")
    cache = env["fault_profile_cache_file"]
    if env["fault_profile_measured"] or env["fault_profile_group"] != "unmeasured":
        return (f"The installed torch's fault profile: torch {label}, from the study's table (arXiv 2609.22991); "
                f"a profile.json at {cache} would be used instead.")
    return (f"The installed torch's fault profile: torch {label}: nobody measured this release, so every call "
            "any measured release faults on is treated as faulting. Measure it on a Mac with `mpsimpact sweep "
            f"--device mps --full --out sweep/` and copy sweep/profile.json to {cache} (see the documentation's "
            "page docs/measuring-a-release.md).")


def mac_sentence(apple_gpu: bool) -> str:
    """On a Mac: its largest buffer and working set, measured now and kept in the cache (plan --memory auto,
    run and sweep on MPS read it there). Elsewhere: what a declared Mac (--memory 16GB) is assumed to have."""
    from mpsimpact.engine.mac_memory import measure_mac, measured_path
    from mpsimpact.engine.release import cache_root

    if not apple_gpu:
        return ("No Apple GPU here, so no Mac's memory to measure. A Mac declared with --memory (plan, check, "
                "run) is assumed to allocate one buffer of at most half its unified memory (on a 16 GB Mac, "
                "8 GiB: no 2^32 half-precision numbers), to lend a process about two thirds (its working set), "
                "and to stop a process past its high watermark (1.7 x the working set by default, "
                "PYTORCH_MPS_HIGH_WATERMARK_RATIO) with 'MPS backend out of memory'; `mpsimpact doctor` on the "
                "Mac measures its own.")
    mac = measure_mac(cache_root())
    return (f"This Mac's memory, measured now (the largest torch.empty MPS accepts): {mac.describe()} "
            f"Kept in {measured_path(cache_root())} for plan --memory auto, run and sweep on MPS.")
