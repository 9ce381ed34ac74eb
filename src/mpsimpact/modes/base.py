"""What the modes share: the registry of active modes by role, SDPA's arguments and math path, and `MatmulMode`,
the dispatch mode under the emulator, the guard and the tracer, which routes each op as the table
(modes/op_table.py) says."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.nested._internal.nested_tensor import NestedTensor as JAGGED  # torch.nested's jagged layout
from torch.utils._python_dispatch import TorchDispatchMode

from mpsimpact.engine.faults import MODE_INDEX_BITS_RANGE, MPS_INDEX_BITS, Fault
from mpsimpact.errors import UsageError
from mpsimpact.modes.op_table import MATMUL, OP_ENTRIES, OTHER, PRODUCT, op_entry

aten = torch.ops.aten

# Note [TorchScript's numbers under a dispatch mode]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A graph torch.jit.trace recorded holds a Python number of the traced code (`x * 2.0`) as a wrapped-number
# tensor constant. Run under any Python dispatch mode, TorchScript hands the mode that tensor as the number
# itself (torch::jit::toPyObject): `_local_scalar_dense(2.0)`, and `view(2.0, ...)` when the graph is printed
# (jit.trace's own check prints it), which the op then refuses ("Expected a value of type 'Tensor'"). A no-op
# TorchDispatchMode fails so too (torch 2.13), and so did jit.trace's check under strict. A mode whose op
# refuses its arguments calls it again with those numbers as the 0-d tensors they were (`numbers_as_tensors`):
# no cost until an op refuses.
_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def numbers_as_tensors(func: Any, args: tuple) -> tuple | None:
    """`args` with each Python number that `func` takes as a Tensor made a 0-d tensor again; None where there
    is none. See Note [TorchScript's numbers under a dispatch mode]."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    at = [i for i, (argument, value) in enumerate(zip(schema.arguments, args))
          if type(value) in _NUMBER_DTYPES and isinstance(argument.type, torch.TensorType)]
    if not at:
        return None
    fixed = list(args)
    for i in at:
        fixed[i] = torch.tensor(args[i], dtype=_NUMBER_DTYPES[type(args[i])])
    return tuple(fixed)


def op_name(func: Any) -> str:
    return func.__name__.split(".")[0]


def needs_grad(tensors: Any) -> bool:
    """Whether autograd will record a call on these tensors."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


# scaled_dot_product_attention's arguments, in their positional order.
SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A scaled_dot_product_attention call's arguments by name (positional ones named), defaults left out."""
    return dict(zip(SDPA_ARGUMENTS, args)) | kwargs


def sdpa_operands(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, key, value) of a scaled_dot_product_attention call, positional or by keyword."""
    return tuple(  # type: ignore[return-value]
        args[i] if i < len(args) else kwargs[name] for i, name in enumerate(SDPA_ARGUMENTS[:3]))


def sdpa_dropout(args: tuple, kwargs: dict) -> float:
    """The call's dropout_p (0 when not given)."""
    return float(args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0))


def sdpa_math(*args: Any, **kwargs: Any) -> torch.Tensor:
    """SDPA computed by its math path (matmul, softmax, matmul), as MPS runs it with gradients and on
    2.4.1, so a dispatch mode sees its bmm calls. The value F.scaled_dot_product_attention gives for every
    argument it accepts: a boolean mask becomes the additive mask torch makes of it (0 where True, -inf
    where False; the math kernel would add the booleans as 0/1), `scale` and `enable_gqa` by name or
    position."""
    bound = sdpa_arguments(args, kwargs)
    query, key, value = bound.pop("query"), bound.pop("key"), bound.pop("value")
    mask = bound.get("attn_mask")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        bound["attn_mask"] = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
            mask.logical_not(), float("-inf"))
    return aten._scaled_dot_product_attention_math(query, key, value, **bound)[0]


def check_index_bits(index_bits: Any, name: str = "index_bits") -> None:
    """Raises UsageError unless `index_bits` is an integer in MODE_INDEX_BITS_RANGE, in the words the CLI
    uses for --index-bits."""
    low, high = MODE_INDEX_BITS_RANGE
    if isinstance(index_bits, bool) or not isinstance(index_bits, int) or not low <= index_bits <= high:
        raise UsageError(f"{name} must be in {low}..{high} ({MPS_INDEX_BITS} is MPS), got {index_bits!r}.",
                         option=name)


def current_phase() -> str:
    """"backward" while autograd's engine runs a node on this thread, else "forward"."""
    return "backward" if torch._C._current_autograd_node() is not None else "forward"


class ActiveEmulator(Protocol):
    """What the guard needs from an active emulator: its width, release, plan, and its decisions."""

    index_bits: int
    profile: Any
    plan: Any

    def peek(self, family: str, func: Any, a: Any, b: Any) -> tuple[Fault, Any, Any]:
        """The decision the next call would get, and the operands it was decided on."""

    def peek_op(self, func: Any) -> Any:
        """Under a plan: the planned record of the next call of this op (any other family), or None."""

    def as_one_call(self, op: str | None = None) -> contextlib.AbstractContextManager[None]:
        """Counts the calls made inside as the one call they split (a product, or a call of `op`)."""

    def decomposes(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether a composite op that reached the dispatch modes whole is decomposed into its kernels."""


# The active modes of this thread, by role ("emulator", "guard"), innermost last. One registry, so
# the emulator and the guard can find each other without importing each other.
class _Stacks(threading.local):
    def __init__(self) -> None:
        self.stacks: collections.defaultdict[str, list[Any]] = collections.defaultdict(list)


ACTIVE = _Stacks()  # ACTIVE.stacks[role]: this thread's active modes of `role`, innermost last


def push_active(role: str, mode: Any) -> None:
    """Registers `mode` as the innermost active mode of `role` on this thread."""
    ACTIVE.stacks[role].append(mode)


def remove_active(role: str, mode: Any) -> None:
    """Unregisters `mode` (wherever it is in the stack)."""
    ACTIVE.stacks[role].remove(mode)


@contextlib.contextmanager
def activated(role: str, mode: Any) -> Iterator[Any]:
    """Registers `mode` under `role` for the duration of the block."""
    push_active(role, mode)
    try:
        yield mode
    finally:
        remove_active(role, mode)


def innermost(role: str) -> Any | None:
    """The innermost active mode of `role` on this thread, or None."""
    stack = ACTIVE.stacks[role]
    return stack[-1] if stack else None


def active_emulator() -> ActiveEmulator | None:
    """The innermost active emulator on this thread, or None."""
    return innermost("emulator")


def flat_arguments(args: tuple, kwargs: dict) -> Iterator[Any]:
    """Positional and keyword arguments, lists and tuples opened one level (cat, einsum); not `out`."""
    for arg in (*args, *(v for k, v in kwargs.items() if k != "out")):
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg


def has_nested(args: tuple, kwargs: dict) -> bool:
    """Whether an argument (or a tensor of a list argument, cat's) is a nested tensor (torch.nested)."""
    return any(isinstance(t, torch.Tensor) and t.is_nested for t in flat_arguments(args, kwargs))


eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def _dispatched(mode: Any, func: Any, types: Any, args: tuple, kwargs: Any) -> Any:
    return mode._torch_dispatch(func, types, args, kwargs)


_kept_from_dynamo = torch._disable_dynamo(_dispatched, recursive=True)


class MatmulMode(TorchDispatchMode):
    """A dispatch mode that sees every bmm/mm call with its real operands: it decomposes matmul and
    linear (which reach it whole under inference mode) and hands each matmul call to
    `on_matmul`; `on_other` sees every other op."""

    _passing = False  # inside a call decided at its entry (a fused SDPA): MPS runs it as one op

    def _as_one_op(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs a call decided at its entry as one op: what runs it here (a CPU kernel, or on meta its
        math decomposition) is not what MPS runs, so this mode lets its ops through."""
        passing, self._passing = self._passing, True
        try:
            return fn(*args, **kwargs)
        finally:
            self._passing = passing

    # Note [Dynamo kept out at no cost]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # torch wraps every TorchDispatchMode's __torch_dispatch__ in torch._dynamo.disable, so that a compiled region
    # running ops under the mode never compiles the handler's frame: two eval-frame swaps on every op, which the
    # emulator and a strict guard pay on each of a model's hundreds of small ops even where nothing is compiled.
    # This mode keeps Dynamo out itself: where no eval-frame callback is set (nothing compiled is running) the
    # handler runs as it is; where one is, through the same disable wrapper torch would have put around it.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's wrapper is not put around __torch_dispatch__: See Note [Dynamo kept out at no cost]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if eval_frame_callback() is not None:  # See Note [Dynamo kept out at no cost]
            return _kept_from_dynamo(self, func, types, args, kwargs)
        return self._torch_dispatch(func, types, args, kwargs)

    def _torch_dispatch(self, func, types, args=(), kwargs=None):
        if types and JAGGED in types:
            return NotImplemented  # See Note [Nested tensors] in modes/shape_table.py
        try:
            return self.dispatch(func, args, kwargs or {})
        except RuntimeError:
            if has_nested(args, kwargs or {}):
                return self.on_nested(func, args, kwargs or {})
            fixed = numbers_as_tensors(func, args)  # See Note [TorchScript's numbers under a dispatch mode]
            if fixed is None:
                raise
        return self.dispatch(func, fixed, kwargs or {})

    def on_nested(self, func, args: tuple, kwargs: dict) -> Any:
        """An op of a strided nested tensor, whose kernel no mode sees into: See Note [Nested tensors]."""
        return func(*args, **kwargs)

    def dispatch(self, func, args: tuple, kwargs: dict):
        """The body of __torch_dispatch__ (which torch wraps to keep Dynamo out: a subclass calls this)."""
        entry = OP_ENTRIES.get(id(func)) or op_entry(func)  # the table, asked once a call
        kind = entry.route
        if kind is OTHER:
            return self.on_other(func, args, kwargs)
        if kind is not MATMUL:
            if self.decomposes(func, args, kwargs):
                with self:
                    out = func.decompose(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            elif kind is PRODUCT:  # a product the mode judged whole: below every limit
                return func(*args, **kwargs)
            if entry.operands is None:
                return self.on_other(func, args, kwargs)
        family, ia, ib = entry.operands
        return self.on_matmul(func, family, args[ia], args[ib], args, kwargs)

    def decomposes(self, func, args: tuple, kwargs: dict) -> bool:
        """Whether to decompose this CompositeImplicitAutograd op (one that reached the mode whole, under
        inference_mode) into the kernels it runs: always, unless a mode says it can judge it whole (a
        product, the table's PRODUCT route, judged whole runs as it is)."""
        return True

    def on_matmul(self, func, family: str, a: torch.Tensor, b: torch.Tensor, args: tuple, kwargs: dict):
        return func(*args, **kwargs)

    def on_other(self, func, args: tuple, kwargs: dict):
        return func(*args, **kwargs)
