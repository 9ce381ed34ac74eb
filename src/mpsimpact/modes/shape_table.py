"""The guard's hot-path tables: the largest element count of a product's (or linear's) operands and output
by their shapes, and per op how strict's hot path may pass it (GuardMode.__torch_dispatch__)."""

from __future__ import annotations

import math
from typing import Any

import torch

from mpsimpact.modes.base import COMPOSITE, DECOMPOSED_OPS, MATMUL, OTHER, PRODUCT, aten, route
from mpsimpact.modes.chunking import entry_bound, product_elements
from mpsimpact.modes.op_size import SKIPPED, op_family, tensors_of

# The products MatmulMode decomposes, by the entry point whose bound (chunking.entry_bound) says whether they
# can meet a rule (below it they run whole, so a dispatch mode beneath sees them as without a guard);
# tensordot and bilinear are always decomposed.
DECOMPOSED_ENTRY = {aten.matmul.default: "matmul", aten.linear.default: "linear",
                    aten.einsum.default: "einsum", aten._scaled_dot_product_attention_math.default: "sdpa"}

def near_a_limit(func: Any, args: tuple, kwargs: dict, view_limit: int, most: int) -> bool:
    """Whether a composite op that reached a dispatch mode whole could meet a rule, so that the mode decomposes
    it to see the kernels it runs: a product (DECOMPOSED_OPS) whose bound (its operands and output, SDPA's
    scores) reaches VIEW_LIMIT, or any op one of whose tensors passes DIM_MAX (`most`). Below, the op runs whole
    and is judged as its family, on what it makes."""
    if func in DECOMPOSED_OPS:
        name = DECOMPOSED_ENTRY.get(func)
        if name is None:
            return True
        bound = entry_bound(name, args, kwargs)
        if name == "sdpa":
            query, key = args[0], args[1]
            bound = max(bound, query.numel() // max(query.shape[-1], 1) * key.shape[-2])
        return bound >= view_limit
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
# Under a dispatch mode, a strided nested tensor's op that reached no entry runs unjudged.

def stacked_shapes(name: str, tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The dense call a nested tensor's call is judged as (See Note [Nested tensors]): for cat, its first
    tensor and all the elements stacked alike; for a product (linear, matmul, SDPA's scores), an mm of the
    first operand's stacked rows by the second's columns (a Linear's weight's rows, or every key); None where
    a last dim is ragged."""
    try:
        stacked = [tuple(_stacked(t)) if t.is_nested else tuple(t.shape) for t in tensors]
    except RuntimeError:
        return None
    first, second = stacked[0], stacked[1] if len(stacked) > 1 else (1,)
    if name == "cat":
        return first, (sum(t.numel() for t in tensors) // (first[-1] or 1), first[-1])
    columns = (math.prod(second[:-1]) if name == "sdpa" else second[0] if name == "linear" or len(second) == 1
               else second[-1])
    return (math.prod(first[:-1]), first[-1]), (first[-1], columns)


def nested_call_name(func: Any) -> str | None:
    """The entry point a nested tensor's aten op is judged as (stacked_shapes), or None: not judged."""
    return ("cat" if func is aten.cat.default else "linear" if func is aten.linear.default
            else "matmul" if route(func) in (PRODUCT, MATMUL) else None)


def _stacked(t: torch.Tensor) -> torch.Size:
    last = t.size(-1)
    return torch.Size((t.numel() // (last or 1), last))


# Per op (by id, the op kept alive beside it): how strict's hot path may pass it (GuardMode.__torch_dispatch__).
FULL, NO_KERNEL, SIZED, COMPOSITE_SIZED = "full", "no kernel", "sized", "composite sized"
PLAIN: dict[int, str] = {}
_PLAIN_OPS: list[Any] = []


def plain_check(func) -> str:
    """"linear", "matmul": a product whose entry point's quick bound decides it as decomposes' bound would;
    NO_KERNEL: a view, or a product or SDPA call decided elsewhere (size_call's SKIPPED); SIZED: any other op,
    passed where size_call finds nothing to judge (on_other's own test); COMPOSITE_SIZED: a composite op, passed
    where moreover no tensor makes decomposes split it; FULL: the other products and SDPA (the full route)."""
    kind = route(func)
    family = op_family(func) if kind in (OTHER, COMPOSITE) else None
    entry = DECOMPOSED_ENTRY.get(func) if kind is PRODUCT else None
    check = (entry if entry in ("linear", "matmul")
             else FULL if family is None or family in SKIPPED and kind is COMPOSITE
             else NO_KERNEL if family in SKIPPED
             else SIZED if kind is OTHER else COMPOSITE_SIZED)
    _PLAIN_OPS.append(func)
    PLAIN[id(func)] = check
    return check
