"""What this machine and these libraries are: the facts `doctor` prints and every report embeds."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from importlib.metadata import version as _package_version
from mpsimpact.runs.device import host_memory, machine_name
from mpsimpact.engine.release import STUDY, cached_profile_path, installed_profile


def collect_environment(profile: Any = None) -> dict[str, Any]:
    """Versions, devices, memory and the fault profile that applies to this torch (`profile`, where the caller
    has it: JudgedRelease.installed)."""
    import transformers

    total, available = host_memory()
    profile = profile or installed_profile()
    env: dict[str, Any] = {
        "mpsimpact": _package_version("mpsimpact"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": machine_name(),
        "mps_available": torch.backends.mps.is_available(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "host_memory_gib": round(total / 2**30, 1),
        "host_memory_available_gib": round(available / 2**30, 1),
        "fault_profile": profile.label,
        "fault_profile_group": profile.group,
        "fault_profile_measured": profile.measured,
        "fault_profile_source": profile.source,
        "fault_profile_measured_on": profile.measured_on or None,
        "fault_profile_unmeasured": ", ".join(profile.unmeasured) or None,
        "fault_profile_cache_file": (str(cached_profile_path(profile.release)) if profile.source == STUDY
                                     else None),
        "mps_fallback_env": os.environ.get("PYTORCH_ENABLE_MPS_FALLBACK"),
    }
    if env["mps_available"]:
        env["mps_recommended_max_memory_gib"] = round(torch.mps.recommended_max_memory() / 2**30, 1)
    return env
