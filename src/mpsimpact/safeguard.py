"""The guard: stops (raise), flags (warn) or safely splits (chunk) every matrix-multiply call that
would fault on MPS, deciding through the same fault rules as the emulator.

See Note [MPS 32-bit index faults] in mpsimpact/faults.py.
"""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from mpsimpact.calls import (
    MATMUL_OPS, CallRecord, MatmulMode, activated, active_emulator, classify_call, current_phase, innermost, op_name, push_active,
    remove_active,
)
from mpsimpact.errors import OversizedOpError, UsageError
from mpsimpact.faults import Fault, TensorSpec, largest_safe_batch, limits

GUARD_MODES = ("raise", "warn", "chunk")
_INSTALLED: list[GuardMode] = []
# torch.cat with an output above 2**31 elements was silently wrong on MPS in 2.13.0 (pytorch#189960).
_CAT_WRONG_VERSIONS = ("2.13.0",)


def is_guarding() -> bool:
    """True while a guard is active on this thread."""
    return innermost("guard") is not None


class MpsImpactWarning(UserWarning):
    """Emitted by guard mode "warn", once per op site, with the text the error would have."""


class GuardMode(MatmulMode):
    """The dispatch mode behind `guard()`."""

    def __init__(self, mode: str = "raise", *, index_bits: int = 32, devices: tuple[str, ...] | None = None):
        super().__init__()
        if mode not in GUARD_MODES:
            raise UsageError(f"Guard mode must be one of {', '.join(GUARD_MODES)}, got '{mode}'.", mode=mode)
        limits(index_bits)
        self.mode = mode
        self.index_bits = index_bits
        self.devices = devices
        self.stopped: list[CallRecord] = []
        self.chunked: list[CallRecord] = []
        self.chunk_sizes: list[int] = []  # parallel to `chunked`
        self._warned: set[tuple[str, int]] = set()
        self._check_cat = torch.__version__.split("+")[0] in _CAT_WRONG_VERSIONS

    def on_other(self, func, args, kwargs):
        if self._check_cat and func is torch.ops.aten.cat.default:
            self._check_cat_size(args)
        return func(*args, **kwargs)

    def _applies(self, tensor: torch.Tensor) -> bool:
        if self.devices is not None:
            return tensor.device.type in self.devices
        return tensor.device.type == "mps" or active_emulator() is not None

    def on_matmul(self, func, family, a, b, args, kwargs):
        if not self._applies(a):
            return func(*args, **kwargs)
        active = active_emulator()
        fault, full_a, full_b = (
            active.peek(family, func, a, b) if active else (classify_call(family, a, b, self.index_bits), a, b)
        )
        if fault.is_ok:
            return func(*args, **kwargs)
        bits = active.index_bits if active and active.plan is None else self.index_bits
        # Under plan replay the decision, the chunk and the record are those of the full-scale call.
        spec_a, spec_b = (s if isinstance(s, TensorSpec) else TensorSpec.of(s) for s in (full_a, full_b))
        chunk = _chunk_here(family, spec_a, spec_b, a, bits)
        record = CallRecord(len(self.stopped) + len(self.chunked), op_name(func), spec_a, spec_b, fault, current_phase())
        if self.mode == "chunk":
            self.chunked.append(record)
            self.chunk_sizes.append(chunk)
            with active.as_one_call() if active else contextlib.nullcontext():
                return run_chunked(func, family, args, kwargs, chunk)
        message = describe_stop(record, fault, chunk)
        if self.mode == "warn":
            self._warn_once(message)
            return func(*args, **kwargs)
        self.stopped.append(record)
        raise OversizedOpError(message, op=record.op, a=record.a, b=record.b, fault=fault, phase=record.phase, safe_chunk=chunk)

    def _warn_once(self, message: str) -> None:
        site = _user_site()
        if site not in self._warned:
            self._warned.add(site)
            warnings.warn(message, MpsImpactWarning, stacklevel=2)

    def _check_cat_size(self, args) -> None:
        tensors = [t for t in args[0] if isinstance(t, torch.Tensor)]
        total = sum(t.numel() for t in tensors)
        if tensors and self._applies(tensors[0]) and total > limits(self.index_bits)[1]:
            raise OversizedOpError(
                f"mpsimpact guard: cat output of {total} elements exceeds 2^{self.index_bits - 1}; "
                f"torch {torch.__version__} returns it silently wrong on MPS (pytorch#189960). "
                "Concatenate smaller pieces or upgrade torch.",
                op="cat", numel=total,
            )


def _user_site() -> tuple[str, int]:
    # The innermost frame outside torch and mpsimpact: where the op was asked for.
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and "/mpsimpact/" not in frame.filename:
            return frame.filename, frame.lineno or 0
    return "", 0


def _chunk_here(family: str, full_a: TensorSpec, full_b: TensorSpec, a: torch.Tensor, index_bits: int) -> int:
    """The safe chunk of the (full-scale) call, in this call's rows: bmm batches are the same at
    both scales; mm rows scale with the sequence length."""
    chunk = largest_safe_batch(full_a, full_b, index_bits=index_bits, op=family, as_slices=True)
    if family == "mm" and full_a.shape[0] != a.shape[0]:
        chunk = max(1, chunk * a.shape[0] // full_a.shape[0])
    return chunk


def describe_stop(record: CallRecord, fault: Fault, chunk: int) -> str:
    """The error text: what, the numbers, the rule it would hit, the safe chunk, what to do."""
    what = {
        "wrong_all": "return wrong values in every batch",
        "wrong_tail": f"return wrong values from batch {fault.first_bad_batch} onward",
        "error": f"raise '{fault.message}'",
        "abort": "abort the process",
    }[fault.kind]
    unit = "rows" if record.family == "mm" else "batches"
    return (
        f"mpsimpact guard: {record.describe()} in {record.phase} (output {record.out_numel} elements, "
        f"a {record.a.numel}, b {record.b.numel}) would {what} on MPS (rule {fault.rule}). "
        f"The largest safe chunk for this op is {chunk} {unit}: lower the batch size, or use guard mode 'chunk'."
    )


def run_chunked(func, family: str, args: tuple, kwargs: dict, chunk: int) -> torch.Tensor:
    """Computes one bmm/baddbmm/mm/addmm in leading-dim chunks of at most `chunk`."""
    _, ia, ib = MATMUL_OPS[func]
    a, b = args[ia], args[ib]
    rows = a.shape[0]
    pieces = []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        part = list(args)
        part[ia] = a[start:stop]
        if family == "bmm":
            part[ib] = b[start:stop]
        if ia == 1:  # baddbmm/addmm: slice the added input where it has this leading dim
            base = args[0]
            if base.dim() == a.dim() and base.shape[0] == rows:
                part[0] = base[start:stop]
        pieces.append((start, stop, func(*part, **kwargs)))
    out = torch.empty((rows, *pieces[0][2].shape[1:]), dtype=pieces[0][2].dtype, device=a.device)
    for start, stop, piece in pieces:
        out[start:stop].copy_(piece)
    return out


@contextlib.contextmanager
def guard(mode: str = "raise", *, index_bits: int = 32, devices: tuple[str, ...] | None = None) -> Iterator[GuardMode]:
    """Guards every bmm/mm that would fault on MPS.

    Args:
        mode: "raise" (stop before the op runs with `OversizedOpError`), "warn" (warn once per op
            site, then run it) or "chunk" (split it into safe pieces; the result is correct).
        index_bits: index width of the rules (under `emulate()` the emulator's decisions are used).
        devices: device types to guard; None means MPS tensors, and any tensor under `emulate()`.

    Yields:
        The active `GuardMode`; `stopped` and `chunked` list the calls it acted on.
    """
    mode_obj = GuardMode(mode, index_bits=index_bits, devices=devices)
    with activated("guard", mode_obj), mode_obj:
        yield mode_obj


def install_guard(mode: str | None = None, **options: Any) -> GuardMode | None:
    """Installs a guard for the rest of this thread's work (until `uninstall_guard()`).

    `mode` defaults to the environment variable MPSIMPACT_GUARD (off|raise|warn|chunk; unset means
    raise). Returns the installed mode, or None for "off".
    """
    mode = mode or os.environ.get("MPSIMPACT_GUARD", "raise")
    if mode == "off":
        return None
    mode_obj = GuardMode(mode, **options)
    mode_obj.__enter__()
    push_active("guard", mode_obj)
    _INSTALLED.append(mode_obj)
    return mode_obj


def uninstall_guard() -> None:
    """Removes the guard `install_guard()` installed last; does nothing if none is installed."""
    if _INSTALLED:
        mode_obj = _INSTALLED.pop()
        remove_active("guard", mode_obj)
        mode_obj.__exit__(None, None, None)

