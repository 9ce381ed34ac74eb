"""GuardMode, what `guard()` activates: stops (raise), flags (warn) or safely splits (chunk) every
matrix-multiply, SDPA and cat call that would fault on MPS under a torch release's profile, deciding
through the same fault rules as the emulator, at near-zero cost for every other op; with `strict` (and
under the emulator) every other op too: the families past the per-dimension limit.

See Note [MPS 32-bit index faults] in engine/faults.py and Note [Entry points and the dispatch
mode] in modes/entrypoint.py.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch

from mpsimpact.engine.call import CallRecord, classify_call, rows_per_sample
from mpsimpact.modes.base import (
    ACTIVE, check_index_bits, MatmulMode, active_emulator, current_phase, innermost, op_name,
)
from mpsimpact.modes.call_site import TORCH_AND_OURS, innermost_outside
from mpsimpact.modes.chunking import Split, run_in_pieces, split_bmm
from mpsimpact.modes.entrypoint import entry_shape
from mpsimpact.modes.guard_dispatch import DispatchJudge
from mpsimpact.modes.guard_entry import EntryJudge
from mpsimpact.modes.op_size import has_symbolic_sizes, tensors_of
from mpsimpact.modes.piecewise import Pieces
from mpsimpact.modes.shape_table import near_a_limit
from mpsimpact.modes.stop_text import what_mps_does, whole_rows
from mpsimpact.errors import OversizedOpError, UsageError
from mpsimpact.engine.faults import MPS_INDEX_BITS, Fault, dim_max, limits, Profile, TensorSpec
from mpsimpact.engine.mac_memory import BUFFER_RULE
from mpsimpact.engine.release import FaultProfile, installed_profile, resolve_profile
from mpsimpact.variables import GUARD_MODES

_fake_mode, _FAKE = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE
# A device type's flag on a tensor (cheaper than tensor.device, which makes an object each time).
_DEVICE_FLAGS = {"cpu": "is_cpu", "cuda": "is_cuda", "mps": "is_mps", "meta": "is_meta"}


def _mps_bytes() -> int:
    return torch.mps.current_allocated_memory() if torch.backends.mps.is_available() else 0


def _cuda_bytes() -> int:
    if not torch.cuda.is_initialized():
        return 0  # no CUDA tensor exists (and asking would start CUDA)
    return sum(torch.cuda.memory_allocated(index) for index in range(torch.cuda.device_count()))


# Device type -> the bytes its tensors hold now: where a strict guard can be gated (Note [Strict, gated]).
HELD_BYTES: dict[str, Callable[[], int]] = {"mps": _mps_bytes, "cuda": _cuda_bytes}


class MpsImpactWarning(UserWarning):
    """Emitted by guard mode "warn", once per op site, with the text the error would have."""


class GuardMode(EntryJudge, DispatchJudge, MatmulMode):
    """What `guard()` activates: an entry-point handler that answers small calls at once, and the
    dispatch mode that decides each bmm/mm of a call that may cross a limit (every call, when
    `everywhere`: under an emulator, or strict; then every other op too, by its family)."""

    hot_path = True  # strict's hot path answers what it can (Note [Strict's hot path]); False: the full route

    def __init__(self, mode: str = "raise", *, index_bits: int = MPS_INDEX_BITS, devices: tuple[str, ...] | None = None,
                 profile: Profile = None, strict: bool = False):
        super().__init__()
        if mode not in GUARD_MODES:
            raise UsageError(f"Guard mode must be one of {', '.join(GUARD_MODES)}, got '{mode}'.", mode=mode)
        check_index_bits(index_bits)
        self.mode = mode
        self.index_bits = index_bits
        self.devices = devices
        if devices is not None and devices and all(device in _DEVICE_FLAGS for device in devices):
            # the tensor's own flags (`is_cuda`), read without making a torch.device on the hot path
            self._applies = _any_flag(*(_DEVICE_FLAGS[device] for device in devices))  # type: ignore[method-assign]
        if profile is not None:  # a release asked for: resolved (a bad name refused) on entering, unless a value
            self.profile = profile if isinstance(profile, FaultProfile) else resolve_profile(profile)
        emulated = bool(ACTIVE.stacks["emulator"])
        self.everywhere = strict or emulated
        # Note [Strict, gated]: strict without an emulator, on devices that count their bytes, watches every op
        # only from a sighting of a tensor that could pass a limit (a factory's too: `sees_births`).
        self.sees_births = strict and not emulated and all(
            device in HELD_BYTES for device in self._guarded_devices)
        self.watching = False  # the dispatch mode is pushed for the rest of the block
        self._hot = True  # no emulator below: strict's hot path may answer (Note [Strict's hot path])
        self._held = 0  # how many times the dispatch mode is entered now (watching, or around one call)
        self._depth = 0  # the dispatch stack's length when the guard was entered
        # Every rule of every release needs some count at VIEW_LIMIT or more: below it, nothing to look at.
        self._view_limit = limits(index_bits)[1]
        self._most = dim_max(index_bits)
        self.stopped: list[CallRecord] = []
        self.chunked: list[CallRecord] = []
        self.chunk_sizes: list[int] = []  # parallel to `chunked`
        self.warned: list[CallRecord] = []  # mode "warn": the calls it let run (and warned of, once a site)
        self._warned: set[tuple[str, int]] = set()
        self._paused_trace: Any = None  # torch.jit.trace's state, paused while the guard decides a call

    @functools.cached_property
    def profile(self) -> FaultProfile:
        """The installed torch's profile, read when a call first needs it (most guarded calls do not): entering
        a guard around each small batch does not pay for the file system and the environment."""
        return installed_profile()

    @property
    def _guarded_devices(self) -> tuple[str, ...]:
        return self.devices if self.devices is not None else ("mps",)

    def __enter__(self) -> GuardMode:
        self._entering = True  # TorchDispatchMode.__enter__ asks ignore_compile_internals too
        try:
            entered = super().__enter__()
        finally:
            self._entering = False
        self._hot = self.hot_path and not ACTIVE.stacks["emulator"]
        self._held += 1
        return entered

    def __exit__(self, *exc: Any) -> None:
        self._held -= 1
        super().__exit__(*exc)

    # Note [Strict, gated]
    # ~~~~~~~~~~~~~~~~~~~~
    # Every rule of every release needs some tensor of VIEW_LIMIT (2**31) elements or more, and such a tensor
    # holds VIEW_LIMIT bytes or more. A dispatch mode costs a Python call on every op of a model before it
    # judges anything, so strict, on devices that count the bytes their tensors hold (MPS, CUDA), pushes it only
    # from the first sighting of a tensor that could pass a limit until the block ends: on entering, when the
    # guarded devices already hold VIEW_LIMIT bytes; at a matrix product, SDPA or cat (the fast path's own
    # arithmetic) that could meet a rule; at a factory (empty, zeros, ones, full, rand, randn, randint, arange,
    # their _like and new_ forms) asked for VIEW_LIMIT elements or more. Bytes held do not say how many elements
    # any one tensor has: a model of about a billion parameters holds 2 GiB of weights, none of them near a limit.
    # So what the sighting starts is not the route on every op: each op is looked up in the table and judged only
    # where a tensor it reads or makes could reach a limit (Note [Strict's hot path]); such a model pays the
    # mode's call and a lookup per op. Not seen at its birth: a tensor past the limit made, from smaller ones, by
    # any other op (a broadcast `a[:, None] * b`, `repeat`, a TorchScript body, a name bound before the guard)
    # while the device holds less: the ops on it are judged from the next sighting on (a product or cat it
    # feeds, or entering the guard again). On devices without a count (the CPU, meta) and under an emulator,
    # strict watches from the start, as it always did. Where another dispatch mode was entered inside the guard,
    # the guard cannot push beneath it: the calls it sees are judged one by one, as the fast path does, with
    # every op family.

    def begin(self) -> None:
        """On entering (or installing): strict watches from here when it is not gated, or when the guarded
        devices already hold a tensor's worth of bytes (Note [Strict, gated])."""
        self._depth = torch._C._len_torch_dispatch_stack()
        if self.everywhere and (not self.sees_births or  # gated: held bytes for a tensor past a limit
                                sum(HELD_BYTES[device]() for device in self._guarded_devices) >= self._view_limit):
            self._watch()

    def end(self, *exc: Any) -> None:
        """On leaving (or uninstalling): the dispatch mode leaves with the guard."""
        if self.watching:
            self.watching = False
            self.__exit__(*exc)

    def _watch(self) -> bool:
        """Pushes the dispatch mode for the rest of the block; False where it cannot go where the guard was
        entered (entered around a call now, or another mode entered since: Note [Strict, gated])."""
        if self.watching:
            return True
        if self._held or torch._C._len_torch_dispatch_stack() != self._depth:
            return False
        self.__enter__()
        self.watching = True
        return True

    def ignore_compile_internals(self) -> bool:
        """Yes: torch.compile compiles with this mode off (Dynamo skips every frame while a mode that says
        no is active, so `fullgraph=True` would find none) and the compiled code runs past it; the guard
        says so once, when Dynamo first asks."""
        if not getattr(self, "_entering", True) and "torch.compile" not in _SAID:
            _SAID.add("torch.compile")
            warnings.warn("mpsimpact guard: torch.compile traces with the strict guard stepped aside, and "
                          "the compiled code's fused kernels run past it; run the model eagerly under the "
                          "guard to have every op judged.", MpsImpactWarning, stacklevel=2)
        return True

    def _applies(self, tensor: torch.Tensor) -> bool:
        if self.devices is not None:
            return tensor.device.type in self.devices
        return tensor.is_mps or active_emulator() is not None

    def _is_outer(self) -> bool:
        """Whether a guard entered (or installed) later on this thread is active: nested guards, the inner one
        decides alone, with or without an emulator; an outer one passes every call on."""
        return innermost("guard") is not self

    def decomposes(self, func, args: tuple, kwargs: dict) -> bool:
        """A composite op is judged whole (softmax.int as softmax, an 'other' op on what it makes) unless
        one of its tensors passes DIM_MAX (shape_table.near_a_limit), or the emulator below decomposes it: decomposing
        every one would double strict mode's cost."""
        active = active_emulator()
        if active is not None:
            return active.decomposes(func, args, kwargs)  # the emulator below decides what it must see
        return near_a_limit(func, args, kwargs, self._view_limit, self._most)

    # Note [Symbolic sizes]
    # ~~~~~~~~~~~~~~~~~~~~~
    # Under torch.export with dynamic dims (and any fake tensors of a ShapeEnv) a tensor's sizes are symbols,
    # not numbers: every comparison on one records a guard in the export (`8*batch <= 2147483647`), which
    # then refuses the dims the user marked dynamic ("Constraints violated"). The guard judges no call whose
    # sizes are symbolic, at its entry or in its dispatch mode: the exported program keeps every dim dynamic,
    # as without a guard, and is judged where it runs (under a guard, with numbers). Sizes are symbolic only
    # under a FakeTensorMode (export's, Dynamo's, make_fx's): the check looks closer only while one is active.

    def dispatch(self, func, args: tuple, kwargs: dict):
        """The full route (MatmulMode.dispatch), but for a call inside one decided at its entry, and one whose
        sizes are symbols (Note [Symbolic sizes])."""
        if self._passing:  # inside a call decided at its entry (a fused SDPA, a nested tensor's)
            return func(*args, **kwargs)
        if _fake_mode(_FAKE) is not None and has_symbolic_sizes(tensors_of(args, kwargs)):
            return func(*args, **kwargs)  # See Note [Symbolic sizes]
        return super().dispatch(func, args, kwargs)

    # One bmm/mm with its real operands.
    def on_matmul(self, func, family, a, b, args, kwargs):
        if self._passing or self._is_outer() or not self._applies(a):
            return func(*args, **kwargs)
        active = active_emulator()
        fault, full_a, full_b = (
            active.peek(family, func, a, b) if active else (classify_call(family, a, b, self.index_bits, self.profile), a, b)
        )
        if fault.is_ok:
            return func(*args, **kwargs)
        # Under plan replay the decision, the chunk and the record are those of the full-scale call.
        spec_a, spec_b = (s if isinstance(s, TensorSpec) else TensorSpec.of(s) for s in (full_a, full_b))
        split = _split_here(family, spec_a, spec_b, a, self._bits(active))
        record = CallRecord(len(self.stopped) + len(self.chunked), op_name(func), spec_a, spec_b, fault, current_phase())
        return self._act(record, fault, split and split.batches,
                         lambda: run_in_pieces(func, family, args, kwargs, split, self._copies(active)),
                         lambda: func(*args, **kwargs), active)

    def _act(self, record: CallRecord, fault: Fault, chunk: int | Pieces | None, split: Callable[[], Any],
             unguarded: Callable[[], Any], active, op: str | None = None, why_not: str | None = None) -> Any:
        """The one place a decision turns into raise, warn or chunk; a call no split makes safe (chunk
        None) is refused in every mode but warn. `op`: a call of the other families (an emulator replaying
        a plan counts it as one call of that op). A Mac's refusal of an allocation (an emulator's decision on a
        declared Mac) is not the guard's to stop or split: the call goes on and meets MPS's own loud error."""
        if fault.rule == BUFFER_RULE:  # See Note [The Mac's largest buffer]
            return unguarded()
        if self.mode == "chunk" and chunk is not None:
            self.chunked.append(record)
            self.chunk_sizes.append(chunk.step if isinstance(chunk, Pieces) else chunk)
            with active.as_one_call(op) if active else contextlib.nullcontext():
                return split()
        bits = self._bits(active)
        whole = whole_rows(record, bits, active.profile if active else self.profile)
        message = "mpsimpact guard: " + what_mps_does(record, fault, chunk, why_not, index_bits=bits,
                                                      whole=whole)
        if self.mode == "warn":
            self.warned.append(record)
            self._warn_once(message)
            return unguarded()
        self.stopped.append(record)
        safe_chunk = chunk.step if isinstance(chunk, Pieces) else chunk
        # rows_per_sample: the call's rows one sample of the caller's first dimension holds (Note [A call's samples])
        raise OversizedOpError(message, op=record.op, a=record.a, b=record.b, fault=fault, phase=record.phase,
                               safe_chunk=safe_chunk, safe_batch=whole,
                               rows_per_sample=rows_per_sample(record, entry_shape()),
                               index_bits=bits)

    def _bits(self, active) -> int:
        return active.index_bits if active and active.plan is None else self.index_bits

    def _copies(self, active) -> bool:
        # Releases that count a slice's storage offset (2.5.1 .. 2.9.1) need pieces copied to offset 0.
        return (active.profile if active else self.profile).slice_extent

    def _warn_once(self, message: str) -> None:
        # Once a site: the innermost frame outside torch and mpsimpact (by folder), where the op was asked.
        frame = innermost_outside(TORCH_AND_OURS)
        site = (frame.filename, frame.lineno or 0) if frame is not None else ("", 0)
        if site not in self._warned:
            self._warned.add(site)
            warnings.warn(message, MpsImpactWarning, stacklevel=2)


@functools.lru_cache(maxsize=64)
def _any_flag(*flags: str) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor has one of these flags (`is_cpu`, `is_cuda`): one attribute read, or one C call."""
    if len(flags) == 1:
        return operator.attrgetter(flags[0])
    read = operator.attrgetter(*flags)
    return lambda tensor: True in read(tensor)


_SAID: set[str] = set()  # what this process was told once (a transform the guard steps aside for)


def _split_here(family: str, full_a: TensorSpec, full_b: TensorSpec, a: torch.Tensor, index_bits: int) -> Split | None:
    """The safe pieces of the (full-scale) call, in this call's rows: bmm batches are the same at
    both scales; mm rows scale with the sequence length."""
    split = split_bmm(full_a, full_b, index_bits, family)
    if split is not None and family == "mm" and full_a.shape[0] != a.shape[0]:
        split = Split(max(1, split.batches * a.shape[0] // full_a.shape[0]))
    return split
