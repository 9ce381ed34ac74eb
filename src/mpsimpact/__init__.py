"""mpsimpact: show, measure and prevent PyTorch MPS's silent large-tensor bmm faults.

Public API (imported lazily, so `mpsimpact --help` stays instant).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Fault": "mpsimpact.engine.faults",
    "TensorSpec": "mpsimpact.engine.faults",
    "classify_bmm": "mpsimpact.engine.faults",
    "classify_bmm_backward": "mpsimpact.engine.faults",
    "classify_mm": "mpsimpact.engine.faults",
    "emulate": "mpsimpact.modes.emulator",
    "EmulateMode": "mpsimpact.modes.emulator",
    "trace_faults": "mpsimpact.modes.tracer",
    "trace_module": "mpsimpact.modes.tracer",
    "FaultPlan": "mpsimpact.engine.fault_plan",
    "guard": "mpsimpact.modes.guard",
    "install_guard": "mpsimpact.modes.guard",
    "uninstall_guard": "mpsimpact.modes.guard",
    "install_thread_guard": "mpsimpact.modes.guard",
    "uninstall_thread_guard": "mpsimpact.modes.guard",
    "MpsImpactError": "mpsimpact.errors",
    "OversizedOpError": "mpsimpact.errors",
    "EmulatedMpsError": "mpsimpact.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)  # asked once
        return value
    raise AttributeError(f"module 'mpsimpact' has no attribute {name!r}")
