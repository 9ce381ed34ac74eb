"""The MPS emulator: a dispatch mode that makes CPU or CUDA tensors fault the way MPS does: the matrix
products, SDPA, and every other op past the per-dimension limit by its family.

See Note [MPS 32-bit index faults] in engine/faults.py and Note [Op families past INT_MAX] in
engine/families.py for the rules it applies.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from mpsimpact.engine.call import CallRecord, classify_call
from mpsimpact.modes.base import (
    check_index_bits, eval_frame_callback,
    MatmulMode, activated, current_phase, innermost, needs_grad, op_name, sdpa_dropout, sdpa_math,
    sdpa_operands,
)
from mpsimpact.modes.chunking import entry_bound
from mpsimpact.modes.entrypoint import handling
from mpsimpact.modes.op_size import judged_at, judged_outputs, outputs_of, size_call, tensors_of
from mpsimpact.modes.op_table import (
    AFTER, BROADCAST, COMPOSITE, ENTRY_KINDS, INPUTS, NO_KERNEL, PRODUCT, SKIP, broadcast_within, op_entry,
    plain_types, stacked_shapes, within,
)
from mpsimpact.errors import EmulatedMpsError, MpsImpactError, NotEmulatedError, PlanMismatchError
from mpsimpact.engine.faults import (
    MPS_INDEX_BITS, contiguous_strides, dim_max, Fault, Profile, limits, sdpa_path, TensorSpec,
    wrap_start_batch,
)
from mpsimpact.engine.families import classify_op
from mpsimpact.engine.mac_memory import MacMemory, parse_mac_size, tensor_bytes
from mpsimpact.engine.release import allocates, takes_release

if TYPE_CHECKING:
    from mpsimpact.engine.fault_plan import FaultPlan

_fake_mode, _FAKE = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE
_HOT = frozenset({NO_KERNEL, INPUTS, BROADCAST, AFTER})  # the kinds its hot path answers: Note [The emulator's hot path]
_HOT_ENTRIES: dict[int, tuple[str | None, Any]] = {}  # by id(op), as op_table.OP_ENTRIES: (its kind here or None, run)
_Tensor = torch.Tensor


def _hot_entry(func: Any) -> tuple[str | None, Any]:
    """The kind the emulator's hot path answers an op as (None: the full route), and how to run it; asked once an op.
    See Note [The emulator's hot path]."""
    entry = op_entry(func)
    hot = entry.hot if entry.hot in _HOT and not entry.fused_sdpa and not (
        entry.hot is AFTER and entry.route is COMPOSITE) else None
    found = _HOT_ENTRIES[id(func)] = (hot, entry.run)
    return found
# What the emulator does with a call it altered (EmulateMode._keep).
RETURNED, INFERRED, RAISED, ABORTED, REFUSED = "returned", "inferred", "raised", "aborted", "refused"

def read_stride_ignored(x: torch.Tensor) -> torch.Tensor:
    """`x`'s storage read as if packed row-major in x's shape, offset kept (a view, no copy)."""
    return x.as_strided(x.shape, contiguous_strides(tuple(x.shape)), x.storage_offset())


def _wrap_bounds(batches: int, per: int, wrap_elements: int) -> list[int]:
    """Batch indices below `batches` where the wrap count floor(i * per / wrap) goes up."""
    bounds, wraps = [], 1
    while (start := wrap_start_batch(per, wraps * wrap_elements)) < batches:
        bounds.append(start)
        wraps += 1
    return bounds


def _wrapped_segment(x: torch.Tensor, start: int, stop: int, wrap_elements: int | None) -> torch.Tensor:
    """Batches [start, stop) of `x` as MPS reads them: from flat offset (i * per) mod wrap."""
    if wrap_elements is None:
        return x[start:stop]
    per = x[0].numel()
    offset = (start * per) % wrap_elements
    return x.as_strided((stop - start, *x.shape[1:]), x.stride(), x.storage_offset() + offset)


def wrong_bmm(a: torch.Tensor, b: torch.Tensor, fault: Fault, wraps: dict[str, int]) -> torch.Tensor:
    """The values MPS returns for `a @ b` under `fault` (wrong_all or wrong_tail).

    Zero-copy: wrong operands are `as_strided` views of the originals; a wrapped operand is
    computed batch range by batch range, one range per wrap count. `wraps` maps "a"/"b" to the
    element period of that operand's wrap.
    """
    if fault.kind == "wrong_all":
        a = read_stride_ignored(a) if "a" in fault.operand else a
        b = read_stride_ignored(b) if "b" in fault.operand else b
        return torch.bmm(a, b)
    batches = a.shape[0]
    cuts = {0, batches}
    for name, x in (("a", a), ("b", b)):
        if name in wraps:
            cuts.update(_wrap_bounds(batches, x[0].numel(), wraps[name]))
    cuts = sorted(cuts)
    out = torch.empty((batches, a.shape[1], b.shape[2]), dtype=a.dtype, device=a.device)  # (B, M, N)
    for start, stop in zip(cuts, cuts[1:]):
        torch.bmm(
            _wrapped_segment(a, start, stop, wraps.get("a")),
            _wrapped_segment(b, start, stop, wraps.get("b")),
            out=out[start:stop],
        )
    return out


class EmulateMode(MatmulMode):
    """Applies the MPS fault rules of one torch release to every bmm/mm/SDPA call and every other op
    past the per-dimension limit; records the calls it altered.

    With a `plan` (from `trace_faults` at full scale), each call takes the plan's decision
    instead of classifying its own, smaller shapes. See `emulate()`.
    """

    hot_path = True  # Note [The emulator's hot path] (off: every op takes the full route, as the tests compare)

    @takes_release
    def __init__(self, index_bits: int = MPS_INDEX_BITS, plan: FaultPlan | None = None, profile: Profile = None,
                 memory: MacMemory | None = None) -> None:
        super().__init__()
        check_index_bits(index_bits)
        self.index_bits = index_bits
        self.plan = plan
        self.profile = plan.profile if plan is not None else profile
        # The Mac whose largest buffer refuses an allocation (a plan carries its own: decided at full scale).
        self.mac = memory if plan is None else None
        self.calls = 0
        self._near = limits(index_bits)[1]  # every rule needs a count at VIEW_LIMIT or more
        self._most = dim_max(index_bits)  # a call whose every tensor has at most DIM_MAX elements is past none
        self._fast = self.hot_path and plan is None and self.mac is None  # Note [The emulator's hot path]
        self.records: list[CallRecord] = []
        # Called with each record and what the emulator does with it (`_keep`): the pytest plugin's summary.
        self.listeners: list[Callable[[CallRecord, str], None]] = []
        self._grouped = False
        # Plan replay of the other families: each planned call by (sdpa scope, op name, occurrence), and
        # the calls of each (scope, name) made so far (see `peek_op`).
        others = [c for c in (plan.calls if plan else ()) if not c.is_product]
        self._planned = {(c.within, c.op, c.occurrence): c for c in others}
        self._allocations = any(allocates(c.op) for c in others)  # a plan traced with them replays them
        self._seen: dict[tuple[int | None, str], int] = {}
        self._scope: int | None = None

    # Note [The emulator's hot path]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # As strict's (Note [Strict's hot path] in modes/guard_dispatch.py): the emulator sees every op, and almost none
    # can reach a limit, so each op is decided from the table first: a view runs; an op whose every tensor has at
    # most DIM_MAX elements runs where its output cannot outgrow them (INPUTS, BROADCAST within DIM_MAX); an op
    # nobody sized (AFTER, a kernel: a composite one is decomposed to see what it runs) runs and is judged only if
    # what it made passes DIM_MAX. SDPA's own kernels (Note [SDPA past its entry]), products, grown ops (factories,
    # lookups, cat), a replayed plan (whose calls are counted by name), a Mac's buffer (every tensor held against it),
    # tensor subclasses and a compiled region running take the full route, which would have run these as they are.
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        hot, run = _HOT_ENTRIES.get(id(func)) or _hot_entry(func)
        if hot is None or not self._fast or types and not plain_types(types) or eval_frame_callback() is not None:
            return MatmulMode.__torch_dispatch__(self, func, types, args, kwargs)
        most = self._most
        if kwargs:
            answered = within(args, most) and within(kwargs.values(), most) and (
                hot is not BROADCAST or broadcast_within(args, kwargs, most))
        elif hot is NO_KERNEL or self._passing:
            answered = True
        elif len(args) == 2 and type(args[0]) is _Tensor and type(args[1]) is _Tensor:  # most of a model's ops
            a, b = args
            answered = a.numel() <= most and b.numel() <= most and (
                hot is not BROADCAST or a.shape == b.shape or broadcast_within(args, {}, most))
        else:
            answered = broadcast_within(args, {}, most) if hot is BROADCAST else within(args, most)
        if not answered:
            return self._torch_dispatch(func, types, args, kwargs)
        try:
            out = run(*args, **(kwargs or {}))
        except RuntimeError:  # an op that refused its arguments: the full route says why, or runs it as it can
            return self._torch_dispatch(func, types, args, kwargs)
        return self._judged_after(func, args, kwargs or {}, out) if hot is AFTER and not self._passing else out

    def _judged_after(self, func, args: tuple, kwargs: dict, out: Any) -> Any:
        """An op nobody sized, run: as it is where what it made has at most DIM_MAX elements; else judged on that."""
        if type(out) is torch.Tensor and out.numel() <= self._most and not out.is_nested:
            return out
        made = judged_outputs(func, outputs_of(out), judged_at(self.index_bits)[1])
        if max((t.numel() for t in made), default=0) > self._most:
            self._decide_other(func, tensors_of(args, kwargs), made)
        return out

    def decomposes(self, func, args: tuple, kwargs: dict) -> bool:
        """A composite op that reached the mode whole (under no_grad or inference_mode) is decomposed into the
        kernels MPS runs: always under a plan (whose calls are counted by name as its trace names them), and
        always a product (its bmm/mm calls are counted as a trace counts them); any other op only where a tensor
        it reads or makes could pass a limit (op_size.size_call: broadcasts, growing and unknown families
        included). Below every limit it runs whole, as without the emulator: the same values, at a fraction of
        the cost."""
        if self.plan is not None or op_entry(func).route is PRODUCT:
            return True
        return size_call(func, args, kwargs, *judged_at(self.index_bits)) is not None

    def ignore_compile_internals(self) -> bool:
        """Yes: torch.compile traces with the emulator stepped aside (Dynamo skips every frame while a mode that
        says no is active, so `fullgraph=True` would find none), and the compiled code runs under it: the eager
        and aot_eager backends' ops come to it as any op does (SDPA: Note [SDPA past its entry]); a fused kernel
        of another backend (inductor's) runs past it."""
        return True

    def on_matmul(self, func, family, a, b, args, kwargs):
        if self._passing or (self._grouped and self.plan is not None):
            return func(*args, **kwargs)  # a guard's safe chunk of one planned call
        index = self.calls
        self.calls += 1
        fault, wraps = self._decide(index, family, func, a, b)
        if self.mac is not None:
            self._check_buffer(index, op_name(func), a, b, (*a.shape[:-1], b.shape[-1]), a.dtype)
        if fault.is_ok:
            return func(*args, **kwargs)
        record = self._record(index, op_name(func), a, b, fault)
        if fault.rule == "unmeasured-layout":
            return self._as_contiguous_copy(record, func, family, a, b, args, kwargs)
        self._refuse(record)
        # An unmeasured layout in a measured fault: computed as its contiguous copy (inferred).
        a, b = (x.contiguous() if TensorSpec.of(x).layout == "strided" else x for x in (a, b))
        product = torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device) if fault.kind == "truncated" \
            else wrong_bmm(a, b, fault, wraps)
        if family == "bmm" and op_entry(func).operands[1]:  # baddbmm: its input added (beta, alpha)
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            product = product.mul_(alpha) if alpha != 1 else product
            return product if beta == 0 else product.add_(args[0], alpha=beta)
        return product

    def _record(self, index: int, op: str, a, b, fault: Fault) -> CallRecord:
        # Under a plan the record (and any error text) shows the full-scale call MPS would see.
        planned = self.plan.products[index] if self.plan is not None else None
        spec_a, spec_b = (planned.a, planned.b) if planned else (TensorSpec.of(a), TensorSpec.of(b))
        record = CallRecord(index, op, spec_a, spec_b, fault, current_phase())
        self._keep(record, self._product_outcome(fault))
        return record

    def _product_outcome(self, fault: Fault) -> str:
        # What on_matmul and SDPA's entry do with a faulting product: See `_keep`.
        if fault.is_stop:
            return ABORTED if fault.kind == "abort" else RAISED
        if fault.kind == "wrong_other" or fault.rule == "unmeasured-layout" and self.plan is not None:
            return REFUSED
        return INFERRED if fault.rule == "unmeasured-layout" else RETURNED

    def _keep(self, record: CallRecord, outcome: str) -> None:
        """Records a call the emulator altered and tells each listener what it does with it: RETURNED (MPS's
        wrong values), INFERRED (a layout nobody measured, computed as its contiguous copy is inferred to read),
        RAISED (MPS's error, as EmulatedMpsError), ABORTED (MPS would abort the process; raised here as
        EmulatedMpsError) or REFUSED (values nobody characterised or measured: NotEmulatedError)."""
        self.records.append(record)
        for listener in self.listeners:
            listener(record, outcome)

    def _refuse(self, record: CallRecord) -> None:
        """Raises what MPS raises (or aborts with), or refuses to invent values nobody characterised."""
        fault = record.fault
        if fault.is_stop:
            what = "the process aborts on MPS" if fault.kind == "abort" else "MPS raises"
            raise EmulatedMpsError(
                f"{record.describe()}: {fault.message} (emulated MPS {self.profile.release}, rule {fault.rule}; {what})",
                op=record.op, a=record.a, b=record.b, fault=fault, phase=record.phase,
            )
        if fault.kind == "wrong_other":
            raise NotEmulatedError(
                f"{record.describe()}: wrong on MPS {self.profile.release}; values not characterised, not emulated "
                f"(rule {fault.rule}{'; ' + fault.message if fault.message else ''})",
                op=record.op, a=record.a, b=record.b, fault=fault, phase=record.phase,
            )

    def _as_contiguous_copy(self, record: CallRecord, func, family, a, b, args, kwargs):
        """An unmeasured layout, computed as the contiguous copy its read is inferred to equal."""
        if self.plan is not None:
            raise NotEmulatedError(
                f"{record.describe()}: unmeasured layout on MPS {self.profile.release}; not replayed at a reduced length "
                "(inferred only). Run at full scale, or guard it.", op=record.op, fault=record.fault,
            )
        fault = classify_call(family, a.contiguous(), b.contiguous(), self.index_bits, self.profile)
        if fault.kind != "wrong_tail":
            return func(*args, **kwargs)
        return wrong_bmm(a.contiguous(), b.contiguous(), fault, {name: fault.wrap_elements for name in fault.operand})

    def _decide(self, index, family, func, a, b) -> tuple[Fault, dict[str, int]]:
        if self.plan is None:
            fault = classify_call(family, a, b, self.index_bits, self.profile)
            wraps = {name: fault.wrap_elements for name in (fault.operand or "")}
            return fault, wraps if fault.kind == "wrong_tail" else {}
        return replay_decision(self.plan, index, family, op_name(func) if func is not None else family, a, b)

    def on_nested(self, func, args: tuple, kwargs: dict) -> Any:
        """A strided nested tensor's op: C++ kernels over one buffer, which no mode sees into (Note [Nested
        tensors]). Below every limit MPS computes what runs here; past one, nobody can say what it returns."""
        tensors = tensors_of(args, kwargs)
        kind = op_entry(func).nested_as or ENTRY_KINDS["cat"]  # any other op: all its elements, end to end
        shapes = stacked_shapes(kind, tensors)
        if shapes is not None and max(math.prod(shape) for shape in shapes) <= judged_at(self.index_bits)[0]:
            return func(*args, **kwargs)
        raise NotEmulatedError(
            f"{op_name(func)} of a strided nested tensor ({sum(t.numel() for t in tensors)} elements) near MPS's "
            f"limits at {self.index_bits} index bits: its kernel's pieces are not visible to the emulator, so "
            "it does not invent what MPS returns. Use the jagged layout (torch.jagged) or dense tensors.",
            op=op_name(func))

    def on_other(self, func, args, kwargs):
        """Every other op past the per-dimension limit, by its family (prefiltered: a call whose tensors all
        have at most DIM_MAX elements runs at once). Under a plan, its full-scale decision. On a Mac (`mac`),
        every op's tensors are held against its largest buffer (see `_within_buffer`)."""
        if self._passing:
            return func(*args, **kwargs)
        if op_entry(func).fused_sdpa:
            self._check_sdpa_past_entry(func, args)
        if self.plan is not None:
            return self._replay_other(func, args, kwargs)
        if self.mac is not None:
            return self._within_buffer(func, args, kwargs)
        return self._on_other(func, args, kwargs)

    # Note [SDPA past its entry]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The emulator decides SDPA at its Python entry point: which path MPS takes (its fused op, or with gradients
    # the math path whose bmm calls the dispatch mode then sees) and what that path returns. A call that bypasses
    # the entry (the graph torch.compile made, TorchScript, an exported program, a name bound before the
    # emulator) reaches the dispatch mode as this device's own fused kernel, whose outputs (a logsumexp for its
    # backward) no MPS path can stand in for. Below every limit nothing differs and it runs; near one it is
    # refused with a line that says why, never run as if MPS were right.
    def _check_sdpa_past_entry(self, func, args: tuple) -> None:
        query, key, value = args[:3]
        scores = query.numel() // max(query.shape[-1], 1) * key.shape[-2]
        if max(scores, query.numel(), key.numel(), value.numel()) <= dim_max(self.index_bits):
            return
        path = sdpa_path(needs_grad((query, key, value)), self.profile)
        if path == "fused" and classify_call("sdpa", query, key, self.index_bits, self.profile).is_ok:
            return
        raise NotEmulatedError(
            f"{op_name(func)} (scaled_dot_product_attention's own kernel, {scores} score elements) reached the "
            "emulator past SDPA's Python entry point (a torch.compile graph, TorchScript, an exported program, or "
            f"a name bound before the emulator), near MPS's limits at {self.index_bits} index bits: MPS would run "
            f"its {path} path there, which the emulator replays only from the entry point; not emulated. Run this "
            "code eagerly under the emulator, or guard it.", op=op_name(func))

    def _within_buffer(self, func, args, kwargs):
        """An op on a Mac: refused, as MPS refuses it, where a tensor it reads, or the output it will make (where
        its arguments tell), reaches the largest buffer; the output it made is held against it too (what it
        computed is dropped: on the Mac the allocation fails first). See Note [The Mac's largest buffer]."""
        entry = op_entry(func)
        if entry.sizing is SKIP and not entry.allocates:
            return func(*args, **kwargs)
        name, inputs = op_name(func), tensors_of(args, kwargs)
        sized = size_call(func, args, kwargs, -1)
        made = [sized.out] if sized is not None and sized.out is not None else []
        self._check_tensors(name, inputs, made)
        out = self._on_other(func, args, kwargs)
        self._check_tensors(name, inputs, outputs_of(out))
        return out

    def _check_tensors(self, op: str, inputs: list, outputs: list) -> None:
        if (refused := self._refused([*inputs, *outputs])) is not None:
            tensor, n = refused
            self._refuse_buffer(CallRecord.of_op(self.calls, op, inputs or [tensor], [tensor], Fault(),
                                                 current_phase()), n)

    def _check_buffer(self, index: int, op: str, a, b, out_shape: tuple, dtype) -> None:
        """A product on a Mac: refused where an operand or its output reaches the largest buffer."""
        out = TensorSpec.contiguous(tuple(out_shape), str(dtype).removeprefix("torch."))
        if (refused := self._refused([a, b, out])) is not None:
            record = CallRecord(index, op, TensorSpec.of(a), TensorSpec.of(b), Fault(), current_phase())
            self._refuse_buffer(record, refused[1])

    def _refused(self, tensors: list) -> tuple[Any, int] | None:
        """The largest of `tensors` (with its bytes) the Mac refuses at this index width, None where it refuses
        none. A parameter is as big at every width: held against the Mac's own buffer (see modes/op_size)."""
        sizes = [(t, tensor_bytes(t)) for t in tensors]
        refused = [(t, n) for t, n in sizes
                   if self.mac.refuses(n, MPS_INDEX_BITS if _is_parameter(t) else self.index_bits)]
        return max(refused, key=lambda item: item[1], default=None)

    def _refuse_buffer(self, record: CallRecord, n_bytes: int) -> None:
        """Raises MPS's own error for `record`, whose tensor of `n_bytes` (at this width; MPS names its size at
        full scale) the Mac refuses."""
        record = record.evolve(fault=self.mac.fault(n_bytes << (MPS_INDEX_BITS - self.index_bits),
                                                    self.profile.release))
        self._keep(record, RAISED)
        raise EmulatedMpsError(
            f"{record.describe()}: {record.fault.message} (emulated MPS {self.profile.release} on "
            f"{self.mac.label}, {self.mac.buffer_words()}; MPS raises before running it)",
            op=record.op, a=record.a, b=record.b, fault=record.fault, phase=record.phase)

    def _on_other(self, func, args, kwargs):
        sized = size_call(func, args, kwargs, *judged_at(self.index_bits))
        if sized is None:
            return func(*args, **kwargs)
        if sized.after:  # judged on what it made ('other' families: never a stop)
            out = func(*args, **kwargs)
            made = judged_outputs(func, outputs_of(out), judged_at(self.index_bits)[1])
            if max((t.numel() for t in (*sized.inputs, *made)), default=0) > self._most:
                self._decide_other(func, sized.inputs, made)
            return out
        fault = self._decide_other(func, sized.inputs, [sized.out] if sized.out is not None else sized.inputs)
        if fault.rule == "reduction-wrap":
            return wrapped_reduction(func, args, kwargs, fault.wrap_elements)
        return func(*args, **kwargs)

    def _decide_other(self, func, inputs: list, outputs: list) -> Fault:
        """Classifies the call; raises for a stop or values nobody characterised (see `_refuse`)."""
        fault = classify_op(func, inputs, outputs, index_bits=self.index_bits, profile=self.profile)
        if fault.is_ok:
            return fault
        record = CallRecord.of_op(self.calls, op_name(func), inputs, outputs, fault, current_phase())
        # a characterised reduction wrap: a reduction over every element of its one input
        wraps = fault.rule == "reduction-wrap" and len(inputs) == 1 and op_entry(func).wraps
        self._keep(record, RETURNED if wraps else self._product_outcome(fault) if fault.is_stop else REFUSED)
        if not wraps:
            self._refuse(record)
            raise NotEmulatedError(
                f"{record.describe()}: {fault.kind} on MPS {self.profile.release} (rule {fault.rule}); "
                "not emulated",
                op=record.op, a=record.a, b=record.b, fault=fault, phase=record.phase)
        return fault

    def _replay_other(self, func, args, kwargs):
        """A planned call of the other families: the full-scale decision of its occurrence."""
        entry = op_entry(func)
        skipped = entry.sizing is SKIP and not (self._allocations and entry.allocates)
        planned = None if self._grouped or skipped else self._take(op_name(func))
        if planned is None or planned.fault.is_ok:
            return func(*args, **kwargs)
        self._keep(planned, self._product_outcome(planned.fault) if planned.fault.is_stop else REFUSED)
        self._refuse(planned)
        raise NotEmulatedError(
            f"{planned.describe()}: {planned.fault.kind} on MPS {self.profile.release} (rule "
            f"{planned.fault.rule}) at full scale; not replayed at a reduced length. Run at full scale, or "
            "guard it.",
            op=planned.op, fault=planned.fault,
        )

    def _take(self, name: str) -> CallRecord | None:
        key = (self._scope, name)
        occurrence = self._seen[key] = self._seen.get(key, -1) + 1
        return self._planned.get((self._scope, name, occurrence))

    def peek_op(self, func: Any) -> CallRecord | None:
        """Under a plan: the planned record of this op's next call (any other family), or None; the call is
        not consumed."""
        if self.plan is None or self._passing:
            return None
        name = op_name(func)
        return self._planned.get((self._scope, name, self._seen.get((self._scope, name), -1) + 1))

    def passes(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Every entry point but SDPA runs as it is (the dispatch mode sees its bmm/mm calls); a product that
        could meet a rule goes by on_entry, so that its records tell the caller's samples (Note [A call's
        samples] in modes/entrypoint.py)."""
        kind = ENTRY_KINDS[name]
        if kind.at_entry:
            return self._grouped and self.plan is not None
        if not kind.product:
            return True
        try:
            return self.plan is None and entry_bound(kind, args, kwargs) < self._near
        except (RuntimeError, AttributeError, TypeError, ValueError):  # nested or symbolic sizes: not looked at
            return True

    def on_entry(self, name: str, proceed, args: tuple, kwargs: dict):
        """SDPA at the Python entry point: see Note [Entry points and the dispatch mode]; any other call runs as
        it is (its operand's shape kept while it runs, by the wrapper)."""
        if not ENTRY_KINDS[name].at_entry or self.passes(name, args, kwargs):
            return proceed(*args, **kwargs)
        query, key, value = sdpa_operands(args, kwargs)
        if _fake_mode(_FAKE) is not None:  # traced (torch.export, make_fx): torch's own op is recorded
            return self._as_one_op(proceed, *args, **kwargs)
        if self.mac is not None:  # its scores are MPSGraph's own: only its tensors are held against the buffer
            self._check_tensors("sdpa", [query, key, value], [])
        if sdpa_path(needs_grad((query, key, value)), self.profile) == "math":
            if sdpa_dropout(args, kwargs):
                return self._math_path_with_dropout(proceed, args, kwargs, query.device)
            return self._math_path(*args, **kwargs)  # its calls come through on_matmul and on_other
        index = self.calls
        self.calls += 1
        fault, _ = self._decide(index, "sdpa", None, query, key)
        if not fault.is_ok:
            self._refuse(self._record(index, "sdpa", query, key, fault))
        return self._as_one_op(proceed, *args, **kwargs)  # what runs it here is not what MPS runs

    def _math_path_with_dropout(self, proceed, args: tuple, kwargs: dict, device: torch.device) -> Any:
        """The math path with dropout: MPS draws its random mask in the math kernel, this device's SDPA kernel
        draws another. Where the math path altered no call, its values are this device's plain ones: the
        plain call is made again from the same random state; else the emulated (wrong) values stand."""
        rng = torch.cuda if device.type == "cuda" else torch
        state = rng.get_rng_state()
        altered = len(self.records)
        out = self._math_path(*args, **kwargs)
        if len(self.records) != altered:
            return out
        rng.set_rng_state(state)
        return self._as_one_op(proceed, *args, **kwargs)

    def _math_path(self, *args: Any, **kwargs: Any) -> Any:
        """SDPA's math path; under a plan, its other calls are looked up in the scope of that SDPA call
        (the trace index its planned calls carry)."""
        if self.plan is None:
            return sdpa_math(*args, **kwargs)
        products = self.plan.products
        scope, self._scope = self._scope, products[self.calls].within if self.calls < len(products) else -1
        try:
            return sdpa_math(*args, **kwargs)
        finally:
            self._scope = scope

    def peek(self, family: str, func: Any, a: torch.Tensor, b: torch.Tensor) -> tuple[Fault, Any, Any]:
        """The decision the next call would get, and the operands it was decided on (the
        full-scale specs under a plan), without consuming it. For the guard."""
        if self.plan is None:
            return classify_call(family, a, b, self.index_bits, self.profile), a, b
        fault, _ = self._decide(self.calls, family, func, a, b)
        planned = self.plan.products[self.calls]
        return fault, planned.a, planned.b

    @contextlib.contextmanager
    def as_one_call(self, op: str | None = None) -> Iterator[None]:
        """Counts the calls made inside as the one planned call they split (guard chunking): a product,
        or a call of `op` (the other families)."""
        grouped, self._grouped = self._grouped, True
        try:
            yield
        finally:
            self._grouped = grouped
        if self.plan is not None and op is None:
            self.calls += 1
        elif self.plan is not None:
            self._take(op)

    def check_plan_consumed(self) -> None:
        """Raises if a replayed plan had calls this run never made."""
        if self.plan is not None and self.calls != len(self.plan.products):
            raise PlanMismatchError(
                f"The run made {self.calls} bmm/mm calls but the fault plan has "
                f"{len(self.plan.products)}; the plan was traced for another model or phase. "
                "Re-trace the plan with the same model and inputs."
            )


def wrapped_reduction(func: Any, args: tuple, kwargs: dict, wrap: int) -> torch.Tensor:
    """What 2.13.0 returns for a full reduction past INT_MAX: the reduction of its first numel mod `wrap`
    elements (ones(N).sum() returns N mod 2**32). See Note [Op families past INT_MAX]."""
    x = args[0]
    first = x.reshape(-1)[: x.numel() % wrap]
    dims = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else None)
    if dims is not None and len(dims) not in (0, x.dim()):
        raise NotEmulatedError(f"{func.__name__} over some dimensions of a tensor past INT_MAX: not "
                               "characterised")
    rest = [[0] if isinstance(a, (list, tuple)) and a else a for a in args[1:]]
    named = {argument: ([0] if argument == "dim" and v else v) for argument, v in kwargs.items()}
    return func(first, *rest, **named)


def replay_decision(plan: FaultPlan, index: int, family: str, op: str, a, b) -> tuple[Fault, dict[str, int]]:
    """Maps call `index`'s full-scale decision onto this (smaller) call.

    Exact when every wrap period is a whole number of batches (2**bits divisible by the wrapped
    operand's per-batch elements, e.g. L*L with L a power of two): then batch i reads batch
    i mod period at both scales. Otherwise refuses, rather than replay inexactly.
    """
    products = plan.products
    if index >= len(products):
        raise PlanMismatchError(
            f"Call {index} ({op}) is past the end of the fault plan ({len(products)} calls); "
            "the plan was traced for another model or phase."
        )
    planned = products[index]
    if planned.family != family or (family == "bmm" and planned.a.shape[0] != a.shape[0]):
        raise PlanMismatchError(
            f"Call {index} is {op}{list(a.shape)} @ {list(b.shape)} but the plan expected "
            f"{planned.describe()}; trace the plan with the same model, batch size and workload (inference or "
            "training)."
        )
    fault = planned.fault
    if fault.kind != "wrong_tail":
        return fault, {}
    wraps = {}
    for name, full, here in (("a", planned.a, a), ("b", planned.b, b)):
        if name not in fault.operand:
            continue
        period, rest = divmod(fault.wrap_elements, full.per_batch)
        if rest:
            raise PlanMismatchError(
                f"Cannot replay {planned.describe()} exactly: its wrap period "
                f"{fault.wrap_elements}/{full.per_batch} is not a whole number of batches. "
                "Use a power-of-two sequence length or run at full scale."
            )
        wraps[name] = period * here[0].numel()
    return fault, wraps


def _is_parameter(tensor: Any) -> bool:
    """A module's weight, or a view of one (Linear's weight.t())."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(getattr(tensor, "_base", None), torch.nn.Parameter)


@contextlib.contextmanager
def emulate(index_bits: int = MPS_INDEX_BITS, plan: FaultPlan | None = None, profile: Profile = None,
            memory: MacMemory | str | None = None) -> Iterator[EmulateMode]:
    """Makes bmm/mm/SDPA and every other op on CPU or CUDA tensors behave like MPS's, faults included:
    crashes and errors raise `EmulatedMpsError`, 2.13.0's sum past INT_MAX returns the wrapped result,
    and values nobody characterised or measured (wrong_other, unmeasured:*) raise `NotEmulatedError`.

    Args:
        index_bits: index width of the rules (32 is MPS; smaller widths show the same faults on
            small tensors).
        plan: a full-scale `FaultPlan` to replay call by call on a smaller run (its profile applies).
        profile: the torch release to emulate ("2.12.1"); None: the installed torch's. Values nobody
            characterised (kind wrong_other) are never invented: such a call raises `NotEmulatedError`.
        memory: a Mac ("16GB", or an engine.mac_memory.MacMemory): a call that allocates or reads a tensor of
            its largest buffer or more raises `EmulatedMpsError` with MPS's own "Invalid buffer size" text
            (the buffer scaled with `index_bits`). With a `plan`, its calls are decided on that Mac
            (FaultPlan.on_mac); a plan decided on a Mac carries it.

    Yields:
        The active `EmulateMode`; its `records` list every call it altered.
    """
    if innermost("guard") is not None:
        raise MpsImpactError(
            "emulate() was entered inside an active guard, so the guard would never see the "
            "emulated faults; enter emulate() first and guard() inside it."
        )
    if isinstance(memory, str):
        memory = MacMemory.of_size(parse_mac_size(memory))
    if plan is not None and memory is not None:
        plan = plan.on_mac(memory)  # the plan's calls decided on that Mac
    mode = EmulateMode(index_bits, plan, profile, memory)
    with activated("emulator", mode), handling(mode), mode:
        yield mode
    mode.check_plan_consumed()
