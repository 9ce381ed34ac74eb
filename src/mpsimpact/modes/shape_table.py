"""The guard's hot-path table of shapes: the largest element count of a product's (or linear's) operands and
output by their shapes; whether a composite op is near a limit (`near_a_limit`); and how a nested tensor's call is
judged (Note [Nested tensors])."""

from __future__ import annotations

import math
from typing import Any

import torch

from mpsimpact.modes.chunking import entry_bound, product_elements
from mpsimpact.modes.op_size import tensors_of
from mpsimpact.modes.op_table import PRODUCT, op_entry


def near_a_limit(func: Any, args: tuple, kwargs: dict, view_limit: int, most: int) -> bool:
    """Whether a composite op that reached a dispatch mode whole could meet a rule, so that the mode decomposes
    it to see the kernels it runs: a product (the table's PRODUCT route) whose entry point's bound (its operands
    and output, SDPA's scores) reaches VIEW_LIMIT, or that no entry point bounds; or any op one of whose tensors
    passes DIM_MAX (`most`). Below, the op runs whole and is judged as its family, on what it makes."""
    entry = op_entry(func)
    if entry.route is PRODUCT:
        return entry.bound_by is None or entry_bound(entry.bound_by, args, kwargs) >= view_limit
    return any(t.numel() > most for t in tensors_of(args, kwargs))


# (is linear, shape of a, shape of b) -> the largest element count of the call's operands (as bmm sees them,
# broadcast) and output: the guard's hot path reads shapes, not sizes one by one.
LARGEST: dict[tuple[bool, torch.Size, torch.Size], int | float] = {}


def largest_count(key: tuple[bool, torch.Size, torch.Size]) -> int | float:
    """The largest element count among a product's (or linear's) operands and output, by their shapes (is
    linear, shape of a, shape of b), remembered; a shape it cannot read (a 0-d operand, which torch rejects)
    counts as past every limit, sending the call to the exact route."""
    found = LARGEST.get(key)
    if found is None:
        found = _count_for(*key)
        if len(LARGEST) > 4096:
            LARGEST.clear()
        LARGEST[key] = found
    return found


def _count_for(linear: bool, sa: torch.Size, sb: torch.Size) -> int | float:
    if not sa or not sb:
        return math.inf
    na, nb = math.prod(sa), math.prod(sb)
    if linear:
        return max(na, nb, na // (sa[-1] or 1) * (sb[0] if len(sb) == 2 else 1))
    return max(na, nb, product_elements(sa, sb))


# Note [Nested tensors]
# ~~~~~~~~~~~~~~~~~~~~~
# A nested tensor (torch.nested) has no sizes as numbers: a jagged dim is a symbol, and the strided layout
# has none at all. The jagged layout is a tensor subclass whose own dispatch runs dense ops on its values:
# the guard's dispatch mode lets it (NotImplemented) and judges those dense ops exactly, so a call that may
# cross a limit goes through the dispatch mode as a dense one would, split or stopped alike. The strided
# layout's kernels are C++ over its buffer, whose pieces no mode sees: its product, linear, SDPA or cat is
# judged at its entry as one dense call (`stacked_shapes`: its components stacked along their shared last
# dim, a bound at least as large as any component's call), run whole when safe and stopped otherwise (the
# guard cannot split it). A ragged last dim cannot be read: torch decides such a call (mostly an error).
# Under a dispatch mode, a strided nested tensor's op that reached no entry runs unjudged. The table
# (modes/op_table.py: `stacked_shapes`, `OpEntry.nested_as`) says which dense call stands for which.
