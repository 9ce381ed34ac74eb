"""What the modes share: the aten ops that reach MPS's bmm/mm and their operands, the registry of
active modes by role, and `MatmulMode`, the dispatch mode under the emulator, the guard and the tracer."""

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

aten = torch.ops.aten

# op -> (family, index of a, index of b) in the op's positional args.
MATMUL_OPS: dict[Any, tuple[str, int, int]] = {
    aten.bmm.default: ("bmm", 0, 1), aten.baddbmm.default: ("bmm", 1, 2),
    aten.mm.default: ("mm", 0, 1), aten.addmm.default: ("mm", 1, 2),
}

# CompositeImplicitAutograd ops that reach a dispatch mode undecomposed under
# torch.inference_mode(); decomposing them exposes the real bmm/mm operands. Every other such op
# (softmax.int, layer_norm, dropout, ...) is decomposed too (`is_composite`), so that a mode sees the
# kernels MPS runs, named as a trace under no_grad names them (a replayed plan counts them by name).
DECOMPOSED_OPS = frozenset({
    aten.matmul.default, aten.linear.default, aten.einsum.default, aten.tensordot.default,
    aten.bilinear.default, aten._scaled_dot_product_attention_math.default,
})
_COMPOSITE: dict[Any, bool] = {}
_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


def is_composite(func: Any) -> bool:
    """Whether `func` has a CompositeImplicitAutograd kernel (cached: asked for every op)."""
    found = _COMPOSITE.get(func)
    if found is None:
        try:
            found = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT)
        except RuntimeError:  # an op the dispatcher does not hold (prim::device, seen under torch.export)
            found = False
        _COMPOSITE[func] = found
    return found


# What a dispatch mode does with an op: decompose a product of DECOMPOSED_OPS to see its bmm/mm (PRODUCT),
# decompose another composite op (COMPOSITE), judge a bmm/mm (MATMUL), or hand it to on_other (OTHER).
PRODUCT, COMPOSITE, MATMUL, OTHER = "product", "composite", "matmul", "other"

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
# Keyed by id(func): an OpOverload's __hash__ is Python, and a mode asks for every op. The entry keeps
# the op alive beside its kind (_OPS), so an id is never another op's.
_ROUTES: dict[int, str] = {}
_OPS: list[Any] = []


def route(func: Any) -> str:
    """The kind of `func` for a dispatch mode (cached by id)."""
    kind = (PRODUCT if func in DECOMPOSED_OPS else COMPOSITE if is_composite(func)
            else MATMUL if func in MATMUL_OPS else OTHER)
    _OPS.append(func)
    _ROUTES[id(func)] = kind
    return kind


def op_name(func: Any) -> str:
    return func.__name__.split(".")[0]


def operands(func: Any, args: tuple) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(family, a, b) of a call to one of MATMUL_OPS."""
    family, ia, ib = MATMUL_OPS[func]
    return family, args[ia], args[ib]


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


def _stack(role: str) -> list[Any]:
    return ACTIVE.stacks[role]


def push_active(role: str, mode: Any) -> None:
    """Registers `mode` as the innermost active mode of `role` on this thread."""
    _stack(role).append(mode)


def remove_active(role: str, mode: Any) -> None:
    """Unregisters `mode` (wherever it is in the stack)."""
    _stack(role).remove(mode)


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


_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


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
        if _eval_frame_callback() is not None:  # See Note [Dynamo kept out at no cost]
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
        kind = _ROUTES.get(id(func)) or route(func)
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
            if func not in MATMUL_OPS:
                return self.on_other(func, args, kwargs)
        family, a, b = operands(func, args)
        return self.on_matmul(func, family, a, b, args, kwargs)

    def decomposes(self, func, args: tuple, kwargs: dict) -> bool:
        """Whether to decompose this CompositeImplicitAutograd op (one that reached the mode whole, under
        inference_mode) into the kernels it runs: always, unless a mode says it can judge it whole (a
        product of DECOMPOSED_OPS judged whole runs as it is)."""
        return True

    def on_matmul(self, func, family: str, a: torch.Tensor, b: torch.Tensor, args: tuple, kwargs: dict):
        return func(*args, **kwargs)

    def on_other(self, func, args: tuple, kwargs: dict):
        return func(*args, **kwargs)
