"""The size of any aten call before it runs: its tensors, and the output it will make where that can
outgrow every input (creation ops, arange, cat, broadcasts, lookups), by arithmetic on its arguments (no
meta kernel: most are Python and cost more than the op itself). Also the prefilter the tracer, the
emulator and the guard share: a call whose every tensor has at most DIM_MAX elements meets no family rule
(Note [Op families past INT_MAX] in engine/families.py).

At a reduced index width the limits scale so that a small batch meets the faults a big one meets on MPS:
the activations scale, the weights do not. So a parameter (nn.Parameter: an embedding table, a LayerNorm
weight), and the gradient an op makes for one (embedding_dense_backward's), is judged against MPS's own
limit (`full_most`), not the scaled one: a 30522 x 384 vocabulary table is far below 2**31 on MPS,
whatever the width an emulation runs at."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch

from mpsimpact.engine.faults import MPS_INDEX_BITS, TensorSpec, dim_max
from mpsimpact.engine.release import family_of

# Families decided elsewhere (the products: on_matmul and the SDPA entry) or with no kernel (views).
SKIPPED = frozenset({"view", "bmm", "mm", "sdpa"})
# Families whose output can have more elements than every input.
GROWING = frozenset({"creation", "random", "indexing", "cat"})
# Ops whose output size depends on values (or on arithmetic not written here): known only once run.
_KNOWN_AFTER = frozenset({"nonzero", "masked_select", "unique", "repeat_interleave"})

# Ops whose output is the gradient of a parameter (a weight's size, whatever the batch).
_WEIGHT_GRADIENTS = frozenset({"embedding_dense_backward"})
# By id(func), the op kept alive beside it (as modes/base.py's routes): an OpOverload's __hash__ is Python.
_FAMILY: dict[int, tuple[Any, str]] = {}
_ARGUMENT_NAMES: dict[Any, tuple[str, ...]] = {}


def op_family(func: Any) -> str:
    """`family_of` an op overload, cached (the modes ask for every op)."""
    found = _FAMILY.get(id(func))
    if found is None:
        found = _FAMILY[id(func)] = (func, family_of(func))
    return found[1]


def bound_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by their schema names (positional ones named), defaults left out."""
    names = _ARGUMENT_NAMES.get(func)
    if names is None:
        names = _ARGUMENT_NAMES[func] = tuple(a.name for a in func._schema.arguments)
    return dict(zip(names, args)) | kwargs


def tensors_of(args: Any, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The tensors among the arguments (or outputs), lists and tuples opened one level."""
    found = []
    for item in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            found.extend(x for x in item if isinstance(x, torch.Tensor))
    return found


def has_symbolic_sizes(items: Any) -> bool:
    """Whether a tensor among `items` (lists opened one level) has a symbolic size or storage offset:
    torch.export's dynamic dims, a ShapeEnv's fake tensors (Note [Symbolic sizes] in modes/guard_mode.py)."""
    return any(type(t.storage_offset()) is not int or any(type(d) is not int for d in t.shape)
               for t in tensors_of(items))


@functools.lru_cache(maxsize=None)
def judged_at(index_bits: int) -> tuple[int, int]:
    """(most, full_most): DIM_MAX at this width, for activations, and at MPS's, for parameters."""
    return dim_max(index_bits), dim_max(max(index_bits, MPS_INDEX_BITS))


def judged(tensors: list[torch.Tensor], full_most: int) -> list[torch.Tensor]:
    """The tensors the rules judge: parameters within MPS's own limit left out (the module's docstring)."""
    return [t for t in tensors if not (isinstance(t, torch.nn.Parameter) and t.numel() <= full_most)]


def judged_outputs(func: Any, outputs: list[torch.Tensor], full_most: int) -> list[torch.Tensor]:
    """The outputs the rules judge: a parameter's gradient within MPS's own limit left out."""
    if func.__name__.split(".")[0] not in _WEIGHT_GRADIENTS:
        return outputs
    return [t for t in outputs if t.numel() > full_most]


def outputs_of(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned; a nested tensor it made is left out (no sizes as numbers: its buffer is
    judged through the ops that use it, Note [Nested tensors] in modes/shape_table.py)."""
    if isinstance(out, torch.Tensor):
        return [] if out.is_nested else [out]
    return [t for t in tensors_of(out) if not t.is_nested] if isinstance(out, (list, tuple)) else []


@dataclasses.dataclass(frozen=True)
class SizedCall:
    """A call that may pass a limit: its family, input tensors, and the output it will make.

    `out` is the predicted output where it may outgrow the inputs (None where it cannot, or where only
    running the op tells: then `after`, and the caller judges the call on its real output).
    """

    family: str
    inputs: list[torch.Tensor]
    out: TensorSpec | None = None
    after: bool = False


def size_call(func: Any, args: tuple, kwargs: dict, most: int,
              full_most: int | None = None) -> SizedCall | None:
    """The call to judge, or None when it has no kernel, is a product, or no tensor it reads or makes has
    more than `most` (DIM_MAX) elements (a parameter: `full_most`, MPS's DIM_MAX)."""
    family = op_family(func)
    if family in SKIPPED:
        return None
    inputs = tensors_of(args, kwargs)
    if full_most is not None and full_most != most:
        inputs = judged(inputs, full_most)
    big = False
    for tensor in inputs:
        if tensor.numel() > most:
            big = True
            break
    if family == "elementwise" and len(inputs) > 1:
        if not big and math.prod(t.numel() for t in inputs) <= most:
            return None  # a broadcast output has at most the product of its inputs' elements
        out = _broadcast(inputs)
        return SizedCall(family, inputs, out) if big or (out is not None and out.numel > most) else None
    if family in GROWING:
        out, known = _grown(func, family, args, kwargs, inputs)
        if not known:
            return SizedCall(family, inputs, None, after=True)
        return SizedCall(family, inputs, out) if big or (out is not None and out.numel > most) else None
    if big:
        return SizedCall(family, inputs)
    if family == "other":  # nobody wrote its output size down: judged on what it makes
        return SizedCall(family, inputs, None, after=True)
    return None


def _broadcast(inputs: list[torch.Tensor]) -> TensorSpec | None:
    shapes = [t.shape for t in inputs]
    if all(s == shapes[0] for s in shapes):
        return None
    try:
        shape = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return None
    return TensorSpec.contiguous(tuple(shape), _dtype(inputs[0].dtype))


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _grown(func: Any, family: str, args: tuple, kwargs: dict, inputs: list[torch.Tensor]
           ) -> tuple[TensorSpec | None, bool]:
    """(the output spec, whether it is known before running) of a creation, random, lookup or cat op."""
    name = func.__name__.split(".")[0].rstrip("_")
    if name in _KNOWN_AFTER:
        return None, False
    bound = bound_arguments(func, args, kwargs)
    dtype = _dtype(bound.get("dtype") or (inputs[0].dtype if inputs else torch.get_default_dtype()))
    masks = (torch.bool, torch.uint8)
    if name == "index" and any(t is not None and t.dtype in masks for t in bound["indices"]):
        return None, False  # a mask picks as many elements as it holds True values
    shape = _shape_of(name, family, bound, inputs)
    if shape is None:
        return None, True  # fills, *_like, scatter, index_put: the output is an input's size
    return TensorSpec.contiguous(tuple(int(n) for n in shape), dtype), True


def _shape_of(name: str, family: str, bound: dict[str, Any], inputs: list[torch.Tensor]) -> Any:
    """The output shape from the arguments alone; None where the output is an input's size."""
    if family in ("creation", "random"):
        size = bound.get("size")
        return tuple(size) if isinstance(size, (list, tuple, torch.Size)) else None
    if family == "cat":
        tensors = [t for t in bound.get("tensors", inputs) if not (t.dim() == 1 and t.numel() == 0)]
        if not tensors:
            return None
        first, dim = tensors[0], bound.get("dim", 0)
        if name == "stack":
            shape = list(first.shape)
            shape.insert(dim % (first.dim() + 1), len(tensors))
            return shape
        shape = list(first.shape)
        shape[dim % first.dim()] = sum(t.shape[dim % first.dim()] for t in tensors)
        return shape
    return _lookup_shape(name, bound)


def _lookup_shape(name: str, bound: dict[str, Any]) -> Any:
    """arange, and the lookups whose output is the index's size times the rows they pick."""
    if name == "arange":
        start, end, step = bound.get("start", 0), bound.get("end", 0), bound.get("step", 1)
        return (max(0, math.ceil((end - start) / step)),)
    if name == "embedding":
        return (*bound["indices"].shape, bound["weight"].shape[-1])
    if name == "index_select":
        shape = list(bound["self"].shape)
        if shape:
            shape[bound["dim"] % len(shape)] = bound["index"].numel()
        return shape
    if name in ("gather", "take"):
        return tuple(bound["index"].shape)
    if name == "index":
        picks = [t for t in bound["indices"] if t is not None]
        rest = bound["self"].shape[len(bound["indices"]):]
        picked = torch.broadcast_shapes(*(t.shape for t in picks)) if picks else ()
        return (*picked, *rest)
    return None  # scatter, index_put, index_add, ...: the output is `self`


# Factories, by how their size is given (modes/entrypoint.py's FACTORY_POINTS).
_SIZES = (tuple, list, torch.Size)


def factory_elements(name: str, args: tuple, kwargs: dict) -> int:
    """The elements a factory call asks for; 0 where its sizes are not plain numbers (an FX proxy, a symbolic
    size under torch.export: no arithmetic on them), so the call passes unseen."""
    if name == "like":
        like = args[0] if args else kwargs.get("input")
        return like.numel() if isinstance(like, torch.Tensor) else 0
    if name == "arange":
        return _arange_length(args, kwargs)
    if name == "new":
        args = args[1:]  # after the tensor
    if name == "randint":  # (high, size) or (low, high, size)
        size = next((a for a in args if isinstance(a, _SIZES)), kwargs.get("size"))
    else:  # (*size), (size, ...), size=
        size = args[0] if args and isinstance(args[0], _SIZES) else args or kwargs.get("size")
    if not isinstance(size, _SIZES) or not all(type(d) is int for d in size):
        return 0
    return math.prod(size)


def _arange_length(args: tuple, kwargs: dict) -> int:
    numbers = [a for a in args if not isinstance(a, (torch.dtype, torch.device, str))]
    start, end, step = ((0, numbers[0], 1) if len(numbers) == 1 else (*numbers[:2], 1) if len(numbers) == 2
                        else tuple(numbers[:3]) if numbers else (0, None, 1))
    start, end, step = kwargs.get("start", start), kwargs.get("end", end), kwargs.get("step", step)
    if not all(type(x) in (int, float) for x in (start, end, step)) or not step:
        return 0
    return max(0, math.ceil((end - start) / step))
