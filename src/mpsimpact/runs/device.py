"""Devices: which ones this machine has, picking one, and how much memory it offers."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator

import torch

from mpsimpact.errors import DeviceError, MemoryPreflightError, UsageError
from mpsimpact.config import DEVICES, GIB


def machine_name() -> str:
    """E.g. "Linux x86_64" or "macOS 15.1 arm64 (Apple M2 Ultra)"."""
    if platform.system() != "Darwin":
        return f"{platform.system()} {platform.machine()}"
    from mpsimpact.engine.mac_memory import chip_name

    chip = chip_name()
    return f"macOS {platform.mac_ver()[0]} {platform.machine()}" + (f" ({chip})" if chip else "")


def has_device(name: str) -> bool:
    if name == "mps":
        return torch.backends.mps.is_available()
    if name == "cuda":
        return torch.cuda.is_available()
    return name == "cpu"


def resolve_device(requested: str) -> str:
    """Turns "auto" into mps, else cuda, else cpu; refuses a device this machine lacks."""
    if requested not in DEVICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICES)}, got '{requested}'.",
                          device=requested)
    if requested == "auto":
        return next(name for name in ("mps", "cuda", "cpu") if has_device(name))
    if not has_device(requested):
        raise DeviceError(f"Device '{requested}' is not available on this machine ({machine_name()}); "
                          "use --device cpu to emulate MPS faults.", device=requested)
    return requested


def resolve_emulation(requested: bool | None, device: str) -> bool:
    """--emulate/--no-emulate: emulate by default everywhere but on MPS, where the real fault runs."""
    emulated = requested if requested is not None else device != "mps"
    if emulated and device == "mps":
        raise UsageError("--emulate is for CPU and CUDA devices; on MPS the real fault runs. "
                         "Use --no-emulate or --device cpu.")
    return emulated


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as fh:
            fields = dict(line.split(":", 1) for line in fh)
        return total, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return total, total


def device_memory(device: str) -> int:
    """Bytes a run may use on `device`: free GPU memory, MPS's recommended maximum, or host RAM."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    if device == "mps":
        return int(torch.mps.recommended_max_memory())
    return host_memory()[1]


def check_memory(device: str, needed: int, what: str, advice: str) -> None:
    """Raises MemoryPreflightError, before anything is allocated, when `needed` does not fit."""
    offered = device_memory(device)
    if needed > offered:
        raise MemoryPreflightError(f"This run needs about {needed / GIB:.1f} GiB for {what}; {device} offers "
                                   f"{offered / GIB:.1f} GiB. {advice}",
                                   device=device, needed_bytes=needed, offered_bytes=offered)


@contextlib.contextmanager
def full_precision_reductions() -> Iterator[None]:
    """On CUDA, half-precision matrix products accumulate in fp32 whatever the batch size (cuBLAS
    otherwise may reduce in half precision, differently per shape), so a small-batch reference and a
    big batch round alike. Elsewhere nothing to set."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction = saved
