"""A Mac's own memory limits beside the index rules: the largest single buffer Metal allocates (PyTorch's MPS
allocator refuses any allocation of that size or more, loudly) and the working set Metal recommends. Pure:
sizes in, a Fault out. See Note [The Mac's largest buffer]."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from mpsimpact.bounds import read_size
from mpsimpact.engine.faults import MPS_INDEX_BITS, Fault, TensorSpec
from mpsimpact.errors import UsageError

# Note [The Mac's largest buffer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# PyTorch's MPS allocator checks every allocation before any kernel runs (aten/src/ATen/mps/MPSAllocator.mm,
# alloc_buffer_block): TORCH_CHECK(size < m_max_buffer_size, "Invalid buffer size: ", format_size(size)), with
# m_max_buffer_size = [device maxBufferLength]. It is a RuntimeError (not torch.OutOfMemoryError), and torch
# does not expose the value. Public reports put maxBufferLength at about half the unified memory (16 GiB on a
# 32 GB M2 MacBook Pro, llama.cpp#1815; "Invalid buffer size: 9.75 GB" on a 16 GB M1 Pro, pytorch#78042;
# "104.25 GB" on a 128 GB M1 Ultra, diffusers#5894): half is assumed unless this Mac measured its own
# (`mpsimpact doctor`). The total a process may hold is recommendedMaxWorkingSetSize, about two thirds
# (torch.mps.recommended_max_memory()).
# Beside the one buffer, the total: MPS's allocator lets a process hold at most its high watermark, the working set
# times PYTORCH_MPS_HIGH_WATERMARK_RATIO (1.7 by default on unified memory; 0: no limit), and refuses the allocation
# that would cross it with "MPS backend out of memory" (MPSAllocator.mm); between the working set and the
# watermark a run proceeds, swapping. A run's total is an estimate of its peak (prediction.memory), judged at
# MPS's own index width only: a narrowed run's weights do not shrink with its limits. See Note [What fits a Mac]
# in prediction/memory.py.
# Every silent bmm rule needs an operand or output past 2**32 elements: 8 GiB in half precision, which a
# 16 GB Mac cannot allocate, so there the loud error comes first. A call whose tensor reaches the largest
# buffer is "error" (rule BUFFER_RULE) before and instead of what the index rules say; the guard cannot split
# an allocation, so it lets the call meet the Mac's own error. At a reduced index width the buffer scales
# with every other limit (by 2**(32 - bits)), so a small run meets it where a full-size one does.
# Judged per call on the tensors the rules see: a product's operands (their storage extent) and its output;
# another op's first input and largest output. Fused SDPA's scores are MPSGraph's own intermediate, not a
# PyTorch buffer: not judged (nobody measured what MPSGraph does there).

BUFFER_RULE = "buffer-size"
WATERMARK_RULE = "high-watermark"  # the process's total past MPS's high watermark: "MPS backend out of memory"
MAC_RULES = frozenset({BUFFER_RULE, WATERMARK_RULE})  # the Mac's own refusals: no guard splits them away
BUFFER_SHARE = 1 / 2  # maxBufferLength, of unified memory (reports above)
WORKING_SET_SHARE = 2 / 3  # recommendedMaxWorkingSetSize, of unified memory
GIB = 1 << 30
WATERMARK_RATIO = 1.7  # MPSAllocator's default_high_watermark_ratio on unified memory
# Where the largest buffer was found: assumed from the memory size, or measured on a Mac (`doctor`).
ASSUMED, MEASURED = "assumed", "measured"
# Bytes per element by dtype name (TensorSpec.dtype); others count as 4.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "float8_e4m3fn": 1,
            "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8}
# Macs Apple sells, by unified memory (GB); the smallest that can show the silent fault is searched here.
MAC_SIZES_GB = (8, 16, 18, 24, 32, 36, 48, 64, 96, 128, 192)
# What --memory may declare: Apple sells unified memory in whole GB, the smallest Mac with an Apple GPU has 8 GB
# (a "3.5 GB Mac" is no Mac: refused, not described), and 4096 GB is past every Mac sold.
MAC_GB_RANGE = (MAC_SIZES_GB[0], 4096)
MEASURED_FILE = "mac-memory.json"


def format_size(n_bytes: int) -> str:
    """A size as MPSAllocator's format_size prints it (two decimals; "GB" means GiB)."""
    if n_bytes <= 1024:
        return f"{n_bytes} bytes"
    for unit, scale in (("KB", 1 << 10), ("MB", 1 << 20)):
        if n_bytes <= scale << 10:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes / GIB:.2f} GB"


def invalid_buffer_message(n_bytes: int) -> str:
    """MPS's own error text for an allocation of `n_bytes` at or past the largest buffer."""
    return f"Invalid buffer size: {format_size(n_bytes)}"


AUTO = "auto"  # --memory's word for this Mac's own memory


def is_auto(memory: Any) -> bool:
    """Whether a --memory value asks for this Mac's own memory ("auto", in any case)."""
    return str(memory).lower() == AUTO


def parse_mac_size(text: Any) -> int:
    """The unified memory of "16GB", "16 GB", "16G" or "16" (Apple's GB are GiB), in GB: a whole number in
    MAC_GB_RANGE, written as every number a person types is (bounds.read_size).

    Raises:
        ValueError: not a Mac's memory (the message says what is accepted).
    """
    low, high = MAC_GB_RANGE
    try:
        size = read_size(str(text), {"G": 1, "GB": 1, "GIB": 1}, "GB")
    except ValueError:
        raise ValueError(f"'{text}' is not a Mac's unified memory: give a size such as 16GB or 32GB (up to "
                         f"{high}GB)") from None
    if size < low:
        raise ValueError(f"'{text}' is less than any Mac's unified memory (the smallest Mac with an Apple GPU has "
                         f"{low} GB): give a size such as 16GB")
    if size > high:
        raise ValueError(f"'{text}' is more than any Mac's unified memory (up to {high}GB): give a size such as "
                         "192GB")
    if size.denominator != 1:
        raise ValueError(f"'{text}' is not a Mac's unified memory, which Apple sells in whole GB (8, 16, 18, 24, "
                         "32, ...): give a size such as 16GB")
    return int(size)


@dataclasses.dataclass(frozen=True)
class MacMemory:
    """One Mac's memory limits: `largest_buffer` (an allocation of this many bytes or more is refused with
    "Invalid buffer size") and `working_set` (what Metal lends a process), with where each came from."""

    unified_gb: float | None  # as Apple sells it ("16 GB" is 16 GiB); None where only measured values are known
    largest_buffer: int
    working_set: int
    basis: str = ASSUMED  # ASSUMED (shares of unified memory) or MEASURED
    measured_on: str = ""  # with MEASURED: chip, macOS, torch and date
    # MPS's high watermark, of the working set: torch's default on unified memory; a command's Mac takes
    # PYTORCH_MPS_HIGH_WATERMARK_RATIO's (variables.high_watermark_ratio, read where --memory is: config). 0: no limit
    watermark_ratio: float = WATERMARK_RATIO

    @classmethod
    def of_size(cls, unified_gb: float) -> MacMemory:
        """The limits assumed for a Mac of `unified_gb` GB: half for the buffer, two thirds for the working set."""
        total = unified_gb * GIB
        return cls(unified_gb, int(total * BUFFER_SHARE), int(total * WORKING_SET_SHARE))

    @property
    def high_watermark(self) -> int | None:
        """The most a process may hold before MPS stops it ("MPS backend out of memory"): the working set times
        the high watermark ratio; None where the ratio is 0 (no limit)."""
        return int(self.working_set * self.watermark_ratio) if self.watermark_ratio else None

    def holds(self, n_bytes: float) -> bool:
        """Whether MPS lets a process hold `n_bytes` in all here (at most its high watermark)."""
        return self.high_watermark is None or n_bytes <= self.high_watermark

    def out_of_memory(self, n_bytes: int, release: str = "") -> Fault:
        """What MPS does with a run that needs `n_bytes` in all here, past its high watermark: raises at the
        allocation that crosses it (MPSAllocator's words, its limit as format_size prints it)."""
        message = f"MPS backend out of memory (max allowed: {format_size(self.high_watermark or 0)})"
        return Fault("error", None, None, message, WATERMARK_RULE, release=release, inferred=True)

    @property
    def label(self) -> str:
        """'a 16 GB Mac' ('an 8 GB Mac', 'an 18 GB Mac': the article as the number is said), or 'this Mac' where the
        size is not known."""
        if not self.unified_gb:
            return "this Mac"
        size = f"{self.unified_gb:g}"
        article = "an" if size.startswith("8") or size in ("11", "18") else "a"
        return f"{article} {size} GB Mac"

    def buffer_at(self, index_bits: int = MPS_INDEX_BITS) -> int:
        """The largest buffer at an index width: scaled with the index limits, so a small run meets it where
        a full-size one does (Note [The Mac's largest buffer])."""
        return max(1, self.largest_buffer >> max(0, MPS_INDEX_BITS - index_bits))

    def refuses(self, n_bytes: float, index_bits: int = MPS_INDEX_BITS) -> bool:
        """Whether MPS refuses one allocation of `n_bytes` on this Mac (`buffer_refuses`)."""
        return buffer_refuses(n_bytes, self.buffer_at(index_bits))

    def fault(self, n_bytes: int, release: str = "") -> Fault:
        """What MPS does with a call that allocates `n_bytes` at once here: raises, before any kernel."""
        return Fault("error", None, None, invalid_buffer_message(n_bytes), BUFFER_RULE, release=release,
                     inferred=self.basis != MEASURED)

    def buffer_words(self) -> str:
        """'largest buffer 8.0 GiB (assumed: half of 16 GB)' or '(measured on this Mac ...)'."""
        return f"largest buffer {self.largest_buffer / GIB:.1f} GiB ({self.source()})"

    def source(self) -> str:
        if self.basis == MEASURED:
            return f"measured{': ' + self.measured_on if self.measured_on else ''}"
        return f"assumed: half of {self.unified_gb:g} GB unified memory"

    def describe(self) -> str:
        """One sentence for a report: which Mac, and its three limits in words (the largest buffer, the working set
        and the high watermark), each with where it came from."""
        watermark = ("MPS sets a process no limit in all (PYTORCH_MPS_HIGH_WATERMARK_RATIO=0)"
                     if self.high_watermark is None else
                     f"MPS stops a process that needs more than {self.high_watermark / GIB:.1f} GiB in all with 'MPS "
                     f"backend out of memory' (its high watermark: {self.watermark_ratio:g} x the working set, "
                     "PYTORCH_MPS_HIGH_WATERMARK_RATIO)")
        return (f"On {self.label}, Metal allocates one buffer of at most {self.largest_buffer / GIB:.1f} GiB "
                f"({self.source()}) and lends a process about {self.working_set / GIB:.1f} GiB (its working set); "
                f"{watermark}.")

    def to_json(self) -> dict[str, Any]:
        watermark = self.high_watermark
        return dataclasses.asdict(self) | {
            "label": self.label, "largest_buffer_gib": round(self.largest_buffer / GIB, 2),
            "working_set_gib": round(self.working_set / GIB, 2),
            "high_watermark_gib": None if watermark is None else round(watermark / GIB, 2),
            "sentence": self.describe()}


def buffer_refuses(n_bytes: float, buffer: int) -> bool:
    """The rule of Note [The Mac's largest buffer], written once: MPS refuses an allocation of `buffer` bytes or
    more (MPSAllocator's size < m_max_buffer_size passes)."""
    return n_bytes >= buffer


FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})


def tensor_bytes(tensor: Any, float_bytes: int | None = None) -> int:
    """The bytes MPS allocates for one tensor: a real (or meta) tensor's storage (a view: its base's), a
    TensorSpec's extent in its dtype (`float_bytes`: a floating one counted at that size, as a plan traced in
    float32 is judged for half precision)."""
    if not isinstance(tensor, TensorSpec):
        return tensor.untyped_storage().nbytes()
    floating = float_bytes is not None and tensor.dtype in FLOATING
    return tensor.extent * (float_bytes if floating else ITEMSIZE.get(tensor.dtype, 4))


def call_bytes(call: Any, float_bytes: int | None = None) -> int:
    """The largest single allocation a recorded call makes or reads, in bytes (Note [The Mac's largest buffer]):
    its operands' storage extent and, for bmm and mm, its output; fused SDPA's scores are not counted."""
    tensors = [call.a, call.b]
    if call.family in ("bmm", "mm"):
        tensors.append(TensorSpec.contiguous((call.out_numel,), call.a.dtype))
    return max(tensor_bytes(t, float_bytes) for t in tensors)


def buffer_fault(call: Any, mac: MacMemory | None, index_bits: int, release: str = "") -> Fault | None:
    """The Mac's refusal of this call (an "error" of rule BUFFER_RULE), or None where it fits (or no Mac)."""
    if mac is None:
        return None
    size = call_bytes(call)
    if not mac.refuses(size, index_bits):
        return None
    return mac.fault(size << max(0, MPS_INDEX_BITS - index_bits), release)  # the size MPS names at full scale


def smallest_showing(shows: Any, sizes: tuple[int, ...] = MAC_SIZES_GB) -> MacMemory | None:
    """The smallest Mac (assumed limits) for which `shows(mac)` holds, or None."""
    return next((mac for mac in map(MacMemory.of_size, sizes) if shows(mac)), None)


def measured_path(cache: Path) -> Path:
    """Where `doctor` keeps this Mac's measured limits, under the cache folder."""
    return cache / MEASURED_FILE


def read_measured(cache: Path, machine: str) -> MacMemory | None:
    """The limits measured on `machine` (its chip and memory, `machine_key`) from the cache; None where none
    were, they were measured on another machine, or the file is not one of ours (never trusted, never fatal)."""
    path = measured_path(cache)
    try:
        if not path.is_file() or path.stat().st_size > 1 << 16:
            return None
        data = json.loads(path.read_text())
        buffer, working = int(data["largest_buffer"]), int(data["working_set"])
        unified = float(data["unified_gb"])
        same = data["machine"] == machine
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not same or buffer <= 0 or working <= 0 or not math.isfinite(unified) or unified <= 0:
        return None
    return MacMemory(unified, buffer, working, MEASURED, str(data.get("measured_on", "")))


def write_measured(cache: Path, machine: str, mac: MacMemory) -> Path:
    """Keeps `mac` (measured) for `machine` in the cache, written beside and renamed over (never half-written)."""
    path = measured_path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, "unified_gb": mac.unified_gb, "largest_buffer": mac.largest_buffer,
            "working_set": mac.working_set, "measured_on": mac.measured_on}
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=".mac-memory.", suffix=".partial")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(data, file, indent=2)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return path


def machine_key() -> str:
    """This machine as the cache knows it: its chip and its memory in bytes ("Apple M2 Pro, 17179869184 bytes")."""
    return f"{chip_name() or platform.machine()}, {_unified_bytes()} bytes"


def chip_name() -> str:
    """A Mac's chip ("Apple M2 Pro"), or "" where sysctl cannot say."""
    try:
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _unified_bytes() -> int:
    """This machine's memory in bytes (a Mac's unified memory)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def this_mac(cache: Path) -> MacMemory:
    """This Mac's limits, measured on it: kept in the cache with the machine, measured now where they were not."""
    machine = machine_key()
    if (found := read_measured(cache, machine)) is not None:
        return found
    return measure_mac(cache, machine)


def measure_mac(cache: Path, machine: str | None = None) -> MacMemory:
    """Measures this Mac's largest buffer (the largest torch.empty(n, dtype=uint8, device="mps") MPS accepts, each
    freed at once; `largest_allocation`, to 1 MiB) and its working set (torch.mps.recommended_max_memory()),
    and keeps them in the cache with the machine."""
    import torch

    total = _unified_bytes()

    def allocates(n_bytes: int) -> bool:
        try:
            block = torch.empty(n_bytes, dtype=torch.uint8, device="mps")
        except RuntimeError as error:
            if is_allocation_failure(error):
                return False
            raise
        del block
        torch.mps.empty_cache()
        return True

    accepted = largest_allocation(allocates, total)
    when = datetime.date.today().isoformat()
    machine = machine or machine_key()
    mac = MacMemory(round(total / GIB), accepted + 1, int(torch.mps.recommended_max_memory()), MEASURED,
                    f"{machine.split(',')[0]}, macOS {platform.mac_ver()[0]}, torch {torch.__version__}, {when}")
    write_measured(cache, machine, mac)
    return mac


# What MPS says when an allocation cannot be made: MPSAllocator's "Invalid buffer size: 8.19 GB" (one buffer at or
# past maxBufferLength) and its high watermark's "MPS backend out of memory".
ALLOCATION_FAILURES = (invalid_buffer_message(0).partition(":")[0], "MPS backend out of memory")


def is_allocation_failure(error: BaseException) -> bool:
    """Whether `error` says an allocation could not be made (not a fault of the op that asked for it): MPS's
    "Invalid buffer size" or "MPS backend out of memory", or torch's OutOfMemoryError (torch.OutOfMemoryError,
    torch.cuda.OutOfMemoryError in older releases: one name)."""
    if any(kind.__name__ == "OutOfMemoryError" for kind in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in ALLOCATION_FAILURES)


def resolve_mac(memory: str | None, cache: Path, flag: str = "--memory") -> MacMemory | None:
    """The Mac a command judges on: None (no Mac declared), "auto" (this Mac: needs MPS), or a size ("16GB").

    Raises:
        UsageError: "auto" without an Apple GPU, or a value that is not a size.
    """
    if memory is None:
        return None
    if is_auto(memory):
        import torch

        if not torch.backends.mps.is_available():
            raise UsageError(f"{flag} auto reads this Mac's own memory and needs a Mac with MPS; give a size "
                             "such as 16GB.", option=flag)
        return this_mac(cache)
    try:
        return MacMemory.of_size(parse_mac_size(memory))
    except ValueError as error:
        raise UsageError(f"{flag}: {error}, or auto on a Mac.", option=flag) from None


def largest_allocation(allocates: Any, high: int, low: int = 0, resolution: int = 1 << 20) -> int:
    """The largest byte count in [low, high] that `allocates(n)` (True: an allocation of n bytes was accepted
    and freed) accepts, by bisection to `resolution` bytes, assuming every smaller count is accepted too.
    Returns `low` where none above it is."""
    if allocates(high):
        return high
    good, bad = low, high
    while bad - good > resolution:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if allocates(mid) else (good, mid)
    return good
