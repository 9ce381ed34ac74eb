"""The size of any aten call before it runs: its tensors, and the output it will make where that can
outgrow every input (creation ops, arange, cat, broadcasts, lookups), by arithmetic on its arguments (no
meta kernel: most are Python and cost more than the op itself), as the table says for each op
(modes/op_table.py: `OpEntry.sizing`, `output`). Also the prefilter the tracer, the emulator and the guard
share: a call whose every tensor has at most DIM_MAX elements meets no family rule (Note [Op families past
INT_MAX] in engine/families.py).

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
from mpsimpact.modes.op_table import AFTER, BROADCAST, GROWN, KNOWN_AFTER, OP_ENTRIES, SKIP, op_entry

_ARGUMENT_NAMES: dict[Any, tuple[str, ...]] = {}


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
    if not op_entry(func).weight_gradient:
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
    more than `most` (DIM_MAX) elements (a parameter: `full_most`, MPS's DIM_MAX). How it is sized is the
    table's (`OpEntry.sizing`)."""
    entry = OP_ENTRIES.get(id(func)) or op_entry(func)
    sizing = entry.sizing
    if sizing is SKIP:
        return None
    family = entry.family
    inputs = tensors_of(args, kwargs)
    if full_most is not None and full_most != most:
        inputs = judged(inputs, full_most)
    big = False
    for tensor in inputs:
        if tensor.numel() > most:
            big = True
            break
    if sizing is BROADCAST and len(inputs) > 1:
        if not big and math.prod(t.numel() for t in inputs) <= most:
            return None  # a broadcast output has at most the product of its inputs' elements
        out = _broadcast(inputs)
        return SizedCall(family, inputs, out) if big or (out is not None and out.numel > most) else None
    if sizing is GROWN:
        out, known = _grown(entry, args, kwargs, inputs)
        if not known:
            return SizedCall(family, inputs, None, after=True)
        return SizedCall(family, inputs, out) if big or (out is not None and out.numel > most) else None
    if big:
        return SizedCall(family, inputs)
    if sizing is AFTER:  # nobody wrote its output size down: judged on what it makes
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


def _grown(entry: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> tuple[TensorSpec | None, bool]:
    """(the output spec, whether it is known before running) of a creation, random, lookup or cat op: its
    shape as the table works it out from the arguments; None where the output is an input's size (fills,
    *_like, scatter, index_put)."""
    output = entry.output
    if output is KNOWN_AFTER:
        return None, False
    bound = bound_arguments(entry.op, args, kwargs)
    dtype = _dtype(bound.get("dtype") or (inputs[0].dtype if inputs else torch.get_default_dtype()))
    shape = output(bound, inputs) if output is not None else None
    if shape is KNOWN_AFTER:
        return None, False
    if shape is None:
        return None, True
    return TensorSpec.contiguous(tuple(int(n) for n in shape), dtype), True
