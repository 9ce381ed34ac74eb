"""mpsimpact: show, measure and prevent PyTorch MPS's silent large-tensor bmm faults.

Public API (imported lazily, so `mpsimpact --help` stays instant).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Fault": "mpsimpact.faults",
    "TensorSpec": "mpsimpact.faults",
    "classify_bmm": "mpsimpact.faults",
    "classify_bmm_backward": "mpsimpact.faults",
    "classify_mm": "mpsimpact.faults",
    "emulate": "mpsimpact.emulator",
    "EmulateMode": "mpsimpact.emulator",
    "trace_faults": "mpsimpact.tracer",
    "trace_module": "mpsimpact.tracer",
    "FaultPlan": "mpsimpact.tracer",
    "guard": "mpsimpact.safeguard",
    "install_guard": "mpsimpact.safeguard",
    "uninstall_guard": "mpsimpact.safeguard",
    "MpsImpactError": "mpsimpact.errors",
    "OversizedOpError": "mpsimpact.errors",
    "EmulatedMpsError": "mpsimpact.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mpsimpact' has no attribute {name!r}")
