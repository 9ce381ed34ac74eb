"""The shape-only fault tracer: runs a model on meta tensors at any size and predicts, call by
call, what MPS does with each bmm/mm/SDPA call and each other op past the per-dimension limit. Its
`FaultPlan` can be replayed by the emulator."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mpsimpact.engine.call import CallRecord
from mpsimpact.engine.fault_plan import FaultPlan
from mpsimpact.engine.faults import MPS_INDEX_BITS, Fault, Profile, TensorSpec
from mpsimpact.engine.release import takes_release
from mpsimpact.modes.base import MatmulMode, current_phase, needs_grad, op_name, sdpa_math, sdpa_operands
from mpsimpact.modes.entrypoint import handling
from mpsimpact.modes.op_size import judged, judged_at, judged_outputs, outputs_of, tensors_of
from mpsimpact.modes.op_table import ENTRY_KINDS, OP_ENTRIES, SKIP, op_entry


def _shape_only(entry: Any, args: tuple) -> Any:
    """An op whose meta kernel refuses what a real device runs (grouped_mm's accepts bf16 alone; an MoE model in
    fp32 runs it on MPS and the CPU): on meta, a new tensor of the output's shape (the table's `shape_only`), as
    on_matmul makes for bmm."""
    a, b = args[0], args[1]
    if not (a.is_meta and b.is_meta and a.dim() == 2 and b.dim() == 3 and a.shape[-1] == b.shape[-2]):
        return entry.op(*args)  # another layout: the kernel's own answer (or its error)
    return torch.empty(entry.shape_only(args), dtype=a.dtype, device="meta")


# Ops whose meta output shapes the table works out (`OpEntry.meta`): the broadcast shape of their tensors
# (elementwise), their first tensor's shape (a softmax, tril/triu), a layer norm's, cat's, a reduction's over
# dims; their meta kernels are Python decompositions that cost 100 to 1400 us a call, most of a trace's time.
# With every tensor contiguous on meta, the output is a new contiguous tensor of that shape; its dtype depends
# on the inputs' dtypes alone, so the kernel runs once per signature (op, dtypes, scalar types) and the answer
# is kept (`_META_DTYPES`), or the signature is refused for good where it gave anything else.
_META_DTYPES: dict[tuple[Any, ...], Any] = {}


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.dim() == 0)
    if isinstance(value, (list, tuple)):  # cat's tensors: their dtypes decide the output's
        return tuple(map(_signature, value))
    if isinstance(value, (str, torch.dtype, type(None))):
        return value
    return type(value)


def _fast_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)` on meta tensors: for a pointwise or same-shape op (or a layer norm) whose tensors
    are all meta and contiguous, new contiguous meta tensors of its shapes and dtypes (see _META_DTYPES); for any
    other call that makes new tensors, the kernel's answer to the same exact call (see _STRIDED); for a view or
    an in-place op, the kernel's own."""
    entry = OP_ENTRIES.get(id(func)) or op_entry(func)
    if "out" in kwargs or func._schema.is_mutable or entry.family == "view" or entry.in_place:
        return func(*args, **kwargs)  # in place, or a view: what it returns is (part of) an input
    tensors = tensors_of(args, kwargs)
    if not tensors or not all(t.is_meta for t in tensors):
        return func(*args, **kwargs)
    if entry.meta is None or not all(t.is_contiguous() for t in tensors):
        return _strided_meta(func, args, kwargs)
    shapes = entry.meta(tensors, args, kwargs)
    if shapes is None:  # a reduction over one dim, a cat of mixed ranks: as any other call
        return _strided_meta(func, args, kwargs)
    key = (func, tuple(map(_signature, args)), tuple((k, _signature(v)) for k, v in kwargs.items()))
    dtypes = _META_DTYPES.get(key)
    if dtypes is None:
        out = func(*args, **kwargs)
        made = outputs_of(out)
        same = len(made) == len(shapes) and all(
            t.shape == shape and t.is_contiguous() and t.is_meta for t, shape in zip(made, shapes))
        _META_DTYPES[key] = tuple(t.dtype for t in made) if same else False
        return out
    if dtypes is False:
        return func(*args, **kwargs)
    made = tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in zip(shapes, dtypes))
    return made if len(made) > 1 else made[0]


# Any other call that makes new tensors (a non-contiguous input, RoPE's rotate_half or a transposed operand, whose
# outputs' strides follow the inputs' in TensorIterator's order; an op nobody sized here): only the kernel works
# its outputs out, and on meta they depend on the call alone. Every layer of a model makes the same calls,
# so the answer is kept per exact call (op; each tensor's shape, strides, offset and dtype; every other argument)
# and the kernel runs once per distinct call; a call whose output is not a new meta tensor is never kept.
_STRIDED: dict[tuple[Any, ...], Any] = {}
_STRIDED_MOST = 1 << 16  # distinct calls kept (traces at many lengths); then the table starts again


def _exact(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(map(_exact, value))
    if isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format,
                          type(None))):
        return (type(value), value)
    raise TypeError  # not keyed: the kernel's own answer


def _strided_meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)` on meta tensors, the kernel run once per exact call (see _STRIDED)."""
    try:
        key = (func, _exact(args), tuple((k, _exact(v)) for k, v in kwargs.items()))
    except TypeError:
        return func(*args, **kwargs)
    kept = _STRIDED.get(key)
    if kept is None:
        out = func(*args, **kwargs)
        made = outputs_of(out)
        read = {t.untyped_storage()._cdata for t in tensors_of(args, kwargs)}
        plain = (isinstance(out, torch.Tensor) or isinstance(out, tuple) and len(made) == len(out)) and all(
            t.is_meta and not t._is_view() and t.storage_offset() == 0 and t.untyped_storage()._cdata not in read
            for t in made) and len({t.untyped_storage()._cdata for t in made}) == len(made)
        if len(_STRIDED) >= _STRIDED_MOST:
            _STRIDED.clear()
        _STRIDED[key] = (isinstance(out, torch.Tensor), tuple((tuple(t.shape), t.stride(), t.dtype) for t in made)) \
            if plain else False
        return out
    if kept is False:
        return func(*args, **kwargs)
    single, specs = kept
    made = tuple(torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs)
    return made[0] if single else made


# A record's fault before FaultPlan.from_trace decides it: the tracer records operands only (deciding each op
# here too was a fifth of a trace's own time, and from_trace decided every call MPS runs again anyway).
UNDECIDED = Fault("undecided", None, None, "not decided: FaultPlan.from_trace decides the calls MPS runs", "undecided")


class TraceMode(MatmulMode):
    """Records every bmm/mm call, and every SDPA call with its math path's calls, and every other op (views
    aside) whose largest tensor has more than DIM_MAX elements (with `every_op`, all of them: traces rescaled
    by arithmetic need the same calls at every size); computes nothing on meta tensors. Each record's fault
    is left UNDECIDED: `trace_faults` returns FaultPlan.from_trace of them, which decides the calls the
    release runs (its `trace` keeps them all, to be decided again for another release)."""

    def __init__(self, index_bits: int = MPS_INDEX_BITS, module: torch.nn.Module | None = None,
                 every_op: bool = False, allocations: bool = False) -> None:
        super().__init__()
        self._allocations = allocations  # record the ops that allocate without a kernel (empty): a Mac's buffer
        self.index_bits = index_bits
        self.calls: list[CallRecord] = []
        self._names: list[str] = []
        self._module = module
        self._within: int | None = None
        most, self._full_most = judged_at(index_bits)
        self._most = -1 if every_op else most
        self._seen: dict[tuple[int | None, str], int] = {}  # calls per (sdpa scope, op name): plan replay
        self._made: list[weakref.ref] = []  # every op's outputs, with every_op (see _track)
        self._kept = 0

    def on_matmul(self, func, family, a, b, args, kwargs):
        self._add(op_name(func), family, a, b)
        if a.is_meta and b.is_meta and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2]:
            # What aten's meta kernel returns (a new contiguous product), without its Python decomposition
            # (a third of a trace's time); a mismatch goes to the kernel, for its error.
            return self._track(torch.empty((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device="meta"))
        return self._track(func(*args, **kwargs))

    def _track(self, out: Any) -> Any:
        """Keeps a weak reference to each output (with `every_op`): which are still alive when a softmax runs
        is what the model itself holds (Python frees a tensor when its last name goes)."""
        if self._most < 0:
            for tensor in outputs_of(out):
                if isinstance(tensor, torch.Tensor):
                    self._made.append(weakref.ref(tensor))
            if len(self._made) > 4 * self._kept + 4096:
                self._made = [ref for ref in self._made if ref() is not None]
                self._kept = len(self._made)
        return out

    def _live_bytes(self, args: tuple, kwargs: dict, out: Any) -> int:
        """Bytes of the distinct storages of tensors with as many elements as `out`'s largest, alive now."""
        made = [t for t in outputs_of(out) if isinstance(t, torch.Tensor)]
        size = max((t.numel() for t in made), default=0)
        alive = (ref() for ref in self._made)
        storages = {}
        for tensor in (*alive, *tensors_of(args, kwargs), *made):
            if isinstance(tensor, torch.Tensor) and tensor.numel() == size:
                storage = tensor.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        return sum(storages.values())

    def _add(self, op: str, family: str, a, b, grad: bool = False) -> int:
        phase = current_phase()
        record = CallRecord(len(self.calls), op, TensorSpec.of(a), TensorSpec.of(b), UNDECIDED, phase,
                            self._where(phase), grad, self._within)
        self.calls.append(record)
        return record.index

    def on_other(self, func, args, kwargs):
        entry = OP_ENTRIES.get(id(func)) or op_entry(func)
        out = self._track(_shape_only(entry, args) if entry.shape_only else _fast_meta(func, args, kwargs))
        if entry.sizing is SKIP and not (self._allocations and entry.allocates):
            return out
        name = op_name(func)
        key = (self._within, name)
        occurrence = self._seen[key] = self._seen.get(key, -1) + 1
        inputs = judged(tensors_of(args, kwargs), self._full_most)
        outputs = judged_outputs(func, outputs_of(out), self._full_most)
        if max((t.numel() for t in (*inputs, *outputs)), default=0) <= self._most:
            return out  # the prefilter: past no limit
        phase = current_phase()
        live = self._live_bytes(args, kwargs, out) if self._most < 0 and entry.family == "softmax" else None
        record = CallRecord.of_op(len(self.calls), name, inputs, outputs, UNDECIDED, phase,
                                  module=self._where(phase), within=self._within, occurrence=occurrence,
                                  live_bytes=live)
        self.calls.append(record)
        return out

    def passes(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Every entry point but SDPA runs as it is (the dispatch mode records its calls)."""
        return not ENTRY_KINDS[name].at_entry or self._within is not None

    def on_entry(self, name: str, proceed, args: tuple, kwargs: dict):
        """SDPA: one record for the fused op, then its math path's calls (see FaultPlan.from_trace)."""
        if self.passes(name, args, kwargs):
            return proceed(*args, **kwargs)
        query, key, value = sdpa_operands(args, kwargs)
        self._within = self._add("sdpa", "sdpa", query, key, needs_grad((query, key, value)))
        try:
            return sdpa_math(*args, **kwargs)
        finally:
            self._within = None

    def _where(self, phase: str) -> str:
        if phase == "backward":
            return torch._C._current_autograd_node().name()
        return self._names[-1] if self._names else ""

    @contextlib.contextmanager
    def naming_modules(self) -> Iterator[None]:
        """Tracks the innermost module running a forward, to name each call's layer."""
        if self._module is None:
            yield
            return
        def enter(name: str) -> Callable[..., None]:
            return lambda *_: self._names.append(name)

        def leave(*_: Any) -> None:
            self._names.pop()

        handles = []
        for name, sub in self._module.named_modules():
            handles.append(sub.register_forward_pre_hook(enter(name)))
            handles.append(sub.register_forward_hook(leave, always_call=True))  # a forward that raised left too
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@takes_release
def trace_faults(
    fn: Callable[..., Any],
    *args: Any,
    index_bits: int = MPS_INDEX_BITS,
    module: torch.nn.Module | None = None,
    profile: Profile = None,
    every_op: bool = False,
    allocations: bool = False,
    **kwargs: Any,
) -> FaultPlan:
    """Runs `fn(*args, **kwargs)` (on meta tensors, typically) and predicts every call's fault.

    Args:
        fn: the computation; with meta inputs and a meta model it allocates nothing.
        index_bits: the index width of the rules.
        module: if given, each forward call is labelled with the innermost submodule's name.
        profile: the torch release whose rules decide ("2.12.1"); None: the installed one.
        every_op: record every op but views, not only those past DIM_MAX (for traces rescaled by
            arithmetic, which must hold the same calls at every size).
        allocations: record the ops that allocate without running a kernel (empty, new_empty): where a Mac's
            largest buffer decides too (Note [The Mac's largest buffer]), the allocation is where MPS refuses.

    Returns:
        The `FaultPlan`, whose calls are in the order a run of `fn` under that release makes them.
    """
    mode = TraceMode(index_bits, module, every_op, allocations)
    with mode.naming_modules(), handling(mode), mode:
        fn(*args, **kwargs)
    return FaultPlan.from_trace(tuple(mode.calls), index_bits, profile)


def trace_module(
    module: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    backward: bool = False,
    index_bits: int = MPS_INDEX_BITS,
    profile: Profile = None,
    every_op: bool = False,
    allocations: bool = False,
) -> FaultPlan:
    """Traces `module(**inputs)` in eval mode, and one backward pass of its output's sum if asked: a first
    step, with every parameter's grad None (as after `zero_grad()`), and the grads restored after it, so that
    every trace makes the same calls (an accumulated grad would add an `add_` per parameter)."""

    def step() -> None:
        if not backward:
            with torch.no_grad():
                module(**inputs)
            return
        kept = [(p, p.grad) for p in module.parameters()]
        for p, _ in kept:
            p.grad = None
        try:
            output = module(**inputs)
            (output if isinstance(output, torch.Tensor) else output[0]).float().sum().backward()
        finally:
            for p, grad in kept:
                p.grad = grad

    return trace_faults(step, index_bits=index_bits, module=module, profile=profile, every_op=every_op,
                        allocations=allocations)
