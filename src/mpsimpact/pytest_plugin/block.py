"""What the plugin's options asked (`Settings`, checked before any test runs) and one block of a test run as a
Mac would run it (`Block`: the emulator outside, the guard inside), which steps aside while a block inside it
runs and comes back after it."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest

from mpsimpact.bounds import read_whole
from mpsimpact.pytest_plugin.sighting import EMULATED, SPLIT, STOPPED, WARNED, WARNED_PLAIN
from mpsimpact.pytest_plugin.usage import index_bits_problem

DEVICE_CHOICES = ("cpu", "cuda", "mps")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the options asked; `active`: any of them given."""

    guard: str | None = None
    strict: bool = False
    emulate: bool = False
    profile: str | None = None
    index_bits: int | None = None
    devices: tuple[str, ...] | None = None
    json_path: str | None = None

    @classmethod
    def of(cls, config: pytest.Config) -> Settings:
        """The options, checked (one line each, as pytest says a usage error; nothing is created)."""
        bits, devices = config.getoption("mps_index_bits"), config.getoption("mps_devices")
        if bits is not None:  # read as every number a person types (bounds.read_whole): digits 0-9 alone
            try:
                bits = read_whole(bits)
            except ValueError as error:
                raise pytest.UsageError(f"--mps-index-bits {bits!r} {error}; give 4..32 (32 is MPS).") from None
            if problem := index_bits_problem(bits, "--mps-index-bits"):
                raise pytest.UsageError(problem)
        if devices is not None:
            devices = tuple(d.strip() for d in devices.split(",") if d.strip())
            unknown = [d for d in devices if d not in DEVICE_CHOICES]
            if unknown or not devices:
                raise pytest.UsageError(f"--mps-devices takes {', '.join(DEVICE_CHOICES)}, comma-separated; got "
                                        f"{config.getoption('mps_devices')!r}.")
        if config.getoption("mps_strict") and not config.getoption("mps_guard"):
            raise pytest.UsageError("--mps-strict applies to the guard: give --mps-guard raise, warn or chunk too.")
        json_path = config.getoption("mps_json")
        if json_path is not None and getattr(config, "workerinput", None) is None:  # the controller writes it
            from mpsimpact.errors import UsageError
            from mpsimpact.output.files import check_out_file

            try:
                check_out_file(json_path, "--mps-json")
            except UsageError as error:
                raise pytest.UsageError(error.message) from None
        return cls(config.getoption("mps_guard"), config.getoption("mps_strict"), config.getoption("mps_emulate"),
                   config.getoption("mps_profile"), bits, devices, json_path)

    @property
    def active(self) -> bool:
        return bool(self.guard or self.emulate or self.profile or self.index_bits or self.devices or self.json_path)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Block:
    """The modes of one test, fixture or `mpsimpact_as_a_mac` block: the emulator (outside) and the guard (inside),
    each record noted with the user's line where it is made (the caller's samples known then: Note [A call's
    samples] in modes/entrypoint.py), for `run` (the plugin's MacRun). `enter` and `leave` may alternate: a block inside it runs while it is left."""

    def __init__(self, run: Any, who: str, guard_mode: str | None, emulated: bool, bits: int | None) -> None:
        self.run, self.who, self.guard_mode, self.emulated = run, who, guard_mode, emulated
        self.bits = bits
        self._stack: contextlib.ExitStack | None = None
        self._modes: tuple[tuple[str, Any], ...] = ()  # (role, mode): the emulator and the guard, while entered
        self._base = 0  # torch's dispatch mode stack's length before them

    def enter(self) -> None:
        import torch

        from mpsimpact.engine.faults import MPS_INDEX_BITS
        from mpsimpact.modes.emulator import emulate
        from mpsimpact.modes.guard import guard

        bits, profile = self.bits or MPS_INDEX_BITS, self.run.release.profile
        self._base, modes = torch._C._len_torch_dispatch_stack(), []
        with contextlib.ExitStack() as stack:
            if self.emulated:
                emulator = stack.enter_context(emulate(index_bits=bits, profile=profile))
                emulator.listeners.append(lambda record, outcome: self.note(record, EMULATED[outcome]))
                modes.append(("emulator", emulator))
            if self.guard_mode:
                devices = None if self.emulated else self.run.devices
                mode = stack.enter_context(guard(self.guard_mode, index_bits=bits, profile=profile, devices=devices,
                                                 strict=self.run.settings.strict))
                mode.stopped = _Noted(self, STOPPED)
                mode.chunked = _Noted(self, SPLIT)
                mode.warned = _Noted(self, WARNED if self.emulated else WARNED_PLAIN)
                modes.append(("guard", mode))
            self._stack, self._modes = stack.pop_all(), tuple(modes)

    def leave(self) -> None:
        stack, self._stack, self._modes = self._stack, None, ()
        if stack is not None:
            stack.close()

    def can_step_aside(self) -> bool:
        """Whether this block's modes are the innermost of their kinds and on top of torch's dispatch stack, so it
        can be left for a block inside it and entered again after (not where the test entered its own guard,
        emulator or dispatch mode since)."""
        import torch

        from mpsimpact.modes.base import innermost

        ours = [id(mode) for _, mode in self._modes]
        above = range(self._base, torch._C._len_torch_dispatch_stack())
        return all(id(torch._C._get_dispatch_stack_at(i)) in ours for i in above) and all(
            innermost(role) is mode for role, mode in self._modes)

    def note(self, record: Any, action: str) -> None:
        """A record of this block's emulator or guard, made now: noted with the user's line and the samples."""
        from mpsimpact.engine.call import rows_per_sample
        from mpsimpact.engine.faults import MPS_INDEX_BITS
        from mpsimpact.modes.entrypoint import entry_shape
        from mpsimpact.modes.stop_text import what_mps_does_with

        bits = self.bits or MPS_INDEX_BITS
        per = rows_per_sample(record, entry_shape())
        said = what_mps_does_with(record, bits, per)
        self.run.note(self.who, record, action, per, said, bits)


class _Noted(list):
    """A guard's record list that notes each record as it is added."""

    def __init__(self, block: Block, action: str) -> None:
        super().__init__()
        self._block, self._action = block, action

    def append(self, record: Any) -> None:
        super().append(record)
        self._block.note(record, self._action)
