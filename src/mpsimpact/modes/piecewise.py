"""Splitting one call of the other op families (Note [Op families past INT_MAX] in engine/families.py)
into pieces that pass no limit, each tensor of a piece at most DIM_MAX elements: elementwise ops,
masked_fill, copies and fills block by block over their output; softmax over blocks that keep its
dimension whole; reductions over some dimensions over blocks that keep those whole; full reductions by
combining the pieces' results (sum: add; amax/amin: max/min; mean: weighted; argmax/argmin: with
offsets); an embedding lookup over blocks of its indices; layer norm over blocks of rows (its normalized
dimensions whole). Which of these a call takes, and how a reduction's pieces combine, is the table's
(modes/op_table.py: `OpEntry.split`, `combine`, `fill`). Any other call has no split: the guard stops it. The
result equals the unsplit correct one."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from mpsimpact.engine.faults import TensorSpec, dim_max
from mpsimpact.modes.op_size import bound_arguments
from mpsimpact.modes.op_table import (
    ADDED, BOTH, EITHER, FILL, IN_PLACE_FILL, LARGEST, LARGEST_AT, LOOKUP, MULTIPLIED, POINTWISE, REDUCE,
    REDUCE_WHOLE, ROWS, SMALLEST, SMALLEST_AT, SOFTMAX_ROWS, WEIGHTED, op_entry, split_named,
)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """How one call is cut: `how` ("pointwise", "reduce" or "fill"), over blocks of `shape` (the output's,
    or a reduction's input's) that keep the dimensions `kept` whole and take `step` indices of dimension
    `dim` (every dimension before it one index at a time)."""

    how: str
    shape: tuple[int, ...]
    kept: tuple[int, ...]
    dim: int
    step: int

    @property
    def elements(self) -> int:
        """Elements of the largest block."""
        before = math.prod(self.shape[j] for j in range(self.dim) if j in self.kept)
        return before * self.step * math.prod(self.shape[self.dim + 1:])

    def describe(self) -> str:
        return f"blocks of {self.step} along dimension {self.dim} ({self.elements} elements)"


def cut(shape: tuple[int, ...], kept: tuple[int, ...], most: int) -> tuple[int, int] | None:
    """(dim, step): the first dimension that blocks of at most `most` elements can be cut along, keeping
    `kept` whole and every dimension before it at one index; None if even that is too big."""
    for dim, size in enumerate(shape):
        if dim in kept:
            continue
        fixed = math.prod(shape[j] for j in range(dim) if j in kept) * math.prod(shape[dim + 1:])
        if fixed <= most:
            return dim, max(1, min(size, most // max(fixed, 1)))
    return None


def _reduced_dims(bound: dict[str, Any], ndim: int) -> tuple[int, ...] | None:
    """The dimensions a reduction reduces; None for all of them."""
    dim = bound.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) in (0, ndim)):
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return tuple(sorted(d % max(ndim, 1) for d in dims))


def split_call(func: Any, args: tuple, kwargs: dict, out: TensorSpec | None, most: int) -> Pieces | None:
    """The pieces of this call (every tensor of each at most `most` elements: DIM_MAX, or its share under
    a replayed plan), or None where no split is known (the table's `split`: lookups by mask, random, 'other'
    ops, a softmax or kept dimension past the limit)."""
    how = op_entry(func).split
    if how is None:
        return None
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if how is POINTWISE or how is FILL or how is IN_PLACE_FILL and first is not None:
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        largest = tuple(max(tensors, key=lambda t: t.numel()).shape) if tensors else None
        shape = tuple(out.shape) if out is not None else largest
        return _pieces("fill" if how is FILL else "pointwise", shape, (), most)
    if how is LOOKUP:  # (*indices, D): blocks of indices, each row whole
        return None if out is None else _pieces("lookup", tuple(out.shape), (len(out.shape) - 1,), most)
    if first is None:
        return None
    bound = bound_arguments(func, args, kwargs)
    if how is SOFTMAX_ROWS:
        return _pieces("pointwise", tuple(first.shape), (bound.get("dim", -1) % max(first.dim(), 1),), most)
    if how is ROWS:  # rows, the normalized dims whole
        normalized = len(bound["normalized_shape"])
        return _pieces("rows", tuple(first.shape), tuple(range(first.dim() - normalized, first.dim())), most)
    reduced = _reduced_dims(bound, first.dim())
    if reduced is None:
        return _pieces("reduce", tuple(first.shape), (), most)
    if how is REDUCE:  # not REDUCE_WHOLE: max.dim/min.dim return two tensors, not written
        return _pieces("pointwise-reduce", tuple(first.shape), reduced, most)
    return None


def has_split(op: str, family: str, a: TensorSpec, b: TensorSpec, index_bits: int) -> bool:
    """Whether the guard can split a recorded call of this op and family (a = its largest input, b = its
    largest output): for plans and check's advice, which see shapes only (a softmax is taken over its last
    dim)."""
    how, most = split_named(op, family), dim_max(index_bits)
    if how is POINTWISE or how is IN_PLACE_FILL:
        return cut(b.shape, (), most) is not None
    if how is SOFTMAX_ROWS:
        return cut(a.shape, (len(a.shape) - 1,), most) is not None
    if how is LOOKUP or how is ROWS:
        return cut(b.shape, (len(b.shape) - 1,), most) is not None
    return how is FILL or how is REDUCE or how is REDUCE_WHOLE


def _pieces(how: str, shape: tuple[int, ...] | None, kept: tuple[int, ...], most: int) -> Pieces | None:
    if shape is None or not shape:
        return None
    found = cut(shape, kept, most)
    return None if found is None else Pieces(how, tuple(shape), kept, *found)


def blocks(pieces: Pieces) -> Iterator[tuple[slice, ...]]:
    """The blocks' index tuples, in row-major order (each a tuple of slices: no dimension dropped)."""
    shape, dim, step = pieces.shape, pieces.dim, pieces.step
    leading = [range(shape[j]) if j not in pieces.kept else [None] for j in range(dim)]
    for head in itertools.product(*leading):
        lead = tuple(slice(None) if i is None else slice(i, i + 1) for i in head)
        for start in range(0, shape[dim], step):
            yield (*lead, slice(start, min(shape[dim], start + step)))


def _align(x: Any, index: tuple[slice, ...], ndim: int, shape: tuple[int, ...]) -> Any:
    """The part of a (broadcast) argument that a block of the output reads."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    offset = ndim - x.dim()
    parts = []
    for j in range(x.dim()):
        k = j + offset
        whole = k >= len(index) or x.shape[j] == 1 != shape[k]
        parts.append(slice(None) if whole else index[k])
    return x[tuple(parts)]


def run_pieces(func: Any, args: tuple, kwargs: dict, pieces: Pieces) -> Any:
    """Computes the call block by block into one result (see `split_call`)."""
    if pieces.how in _RUNS:
        return _RUNS[pieces.how](func, args, kwargs, pieces)
    mutates = bool(func._schema.arguments) and func._schema.arguments[0].alias_info is not None \
        and func._schema.arguments[0].alias_info.is_write
    out = None
    reduce = pieces.how == "pointwise-reduce"
    for index in blocks(pieces):
        part_args = [_align(x, index, len(pieces.shape), pieces.shape) for x in args]
        part_kwargs = {k: _align(v, index, len(pieces.shape), pieces.shape) for k, v in kwargs.items()}
        piece = func(*part_args, **part_kwargs)
        if mutates:
            continue
        target = _reduced_index(index, pieces.kept, bound_arguments(func, args, kwargs)) if reduce else index
        if out is None:
            out = piece.new_empty(_full_shape(pieces, piece, reduce, func, args, kwargs))
        out[target].copy_(piece)
    return args[0] if mutates else out


def _full_shape(pieces: Pieces, piece: torch.Tensor, reduce: bool, func: Any, args: tuple,
                kwargs: dict) -> tuple:
    if not reduce:
        return pieces.shape
    keepdim = bound_arguments(func, args, kwargs).get("keepdim", False)
    kept = pieces.kept
    return tuple(1 if j in kept else n for j, n in enumerate(pieces.shape) if keepdim or j not in kept)


def _reduced_index(index: tuple[slice, ...], kept: tuple[int, ...],
                   bound: dict[str, Any]) -> tuple[slice, ...]:
    """A block's place in a reduction's output: the reduced dims dropped (or whole, with keepdim)."""
    keepdim = bound.get("keepdim", False)
    full = (*index, *[slice(None)] * 64)
    ndim = max(len(index), max(kept) + 1)
    return tuple(slice(None) if j in kept else full[j] for j in range(ndim) if keepdim or j not in kept)


def _fill(func: Any, args: tuple, kwargs: dict, pieces: Pieces) -> torch.Tensor:
    """ones/zeros/full (and their _like and new_ forms): an empty tensor (no kernel) filled block by block."""
    bound = bound_arguments(func, args, kwargs)
    fill = op_entry(func).fill
    value = fill if fill is not None else bound.get("fill_value")
    like = args[0] if args and isinstance(args[0], torch.Tensor) else None
    dtype = bound.get("dtype") or (like.dtype if like is not None else torch.get_default_dtype())
    device = bound.get("device") or (like.device if like is not None else None)
    out = torch.empty(pieces.shape, dtype=dtype, device=device)  # no kernel runs
    for index in blocks(pieces):
        out[index].fill_(value)
    return out


def _lookup(func: Any, args: tuple, kwargs: dict, pieces: Pieces) -> torch.Tensor:
    """embedding(weight, indices): each block of indices looked up into its rows of one output."""
    weight, indices, rest = args[0], args[1], args[2:]
    out = weight.new_empty(pieces.shape)  # no kernel runs
    for index in blocks(pieces):
        out[index].copy_(func(weight, indices[index[:indices.dim()]], *rest, **kwargs))
    return out


def _rows(func: Any, args: tuple, kwargs: dict, pieces: Pieces) -> tuple[torch.Tensor, ...]:
    """native_layer_norm(x, shape, weight, bias, eps) -> (out, mean, rstd), block of rows by block of rows:
    each output is the input's shape, its normalized dims of the piece's size (D, or 1 for the stats)."""
    x, rest = args[0], args[1:]
    outs: list[torch.Tensor] = []
    for index in blocks(pieces):
        parts = func(x[index], *rest, **kwargs)
        if not outs:  # empty outputs: no kernel runs
            outs = [p.new_empty(tuple(p.shape[j] if j in pieces.kept else n for j, n in enumerate(pieces.shape)))
                    for p in parts]
        for out, part in zip(outs, parts):
            out[index].copy_(part)
    return tuple(outs)


def _reduce_whole(func: Any, args: tuple, kwargs: dict, pieces: Pieces) -> torch.Tensor:
    """A reduction over every element, piece by piece, the pieces' results combined."""
    x, rest = args[0], args[1:]
    how = op_entry(func).combine
    total: Any = None
    best_value: Any = None
    for index in blocks(pieces):
        part = x[index]
        if how is LARGEST_AT or how is SMALLEST_AT:
            local = func(part, *rest, **kwargs)
            value = part.reshape(-1)[local.reshape(-1)[0]]  # a block is contiguous in x's flat order
            better = best_value is None or bool(value > best_value if how is LARGEST_AT else value < best_value)
            if better:
                best_value, total = value, local + _flat_offset(index, x.shape)
            continue
        result = func(part, *rest, **kwargs)
        if how is WEIGHTED:
            result = result * (part.numel() / x.numel())
        total = result if total is None else _COMBINED[how](total, result)
    return total


def _flat_offset(index: tuple[slice, ...], shape: torch.Size) -> int:
    """The flat (row-major) index of a block's first element."""
    offset, stride = 0, 1
    starts = [s.start or 0 for s in index] + [0] * (len(shape) - len(index))
    for size, start in zip(reversed(shape), reversed(starts)):
        offset += start * stride
        stride *= size
    return offset


# How a full reduction's pieces' results combine (the table's `combine`), and how each kind of Pieces runs.
_COMBINED = {ADDED: torch.add, WEIGHTED: torch.add, MULTIPLIED: torch.mul, LARGEST: torch.maximum,
             SMALLEST: torch.minimum, EITHER: torch.logical_or, BOTH: torch.logical_and}
_RUNS = {"fill": _fill, "reduce": _reduce_whole, "lookup": _lookup, "rows": _rows}
