"""The one table of the ops mpsimpact knows: for each aten op (an `OpEntry` made from its name on first sight,
found by the overload's id) and each Python entry point (an `EntryKind`, by its name), how a call's tensors are
sized, which family judges it (engine/release.py's), how the guard splits it, how the emulator reproduces it and
what the tracer makes of it on meta. The modes ask it once per call; adding an op is one line of `_KNOWN`. The
only module of modes/ that decides anything by an op's name (tests/test_op_table.py reads the others)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mpsimpact.engine.release import allocates, family_of

# What a dispatch mode does with an op (MatmulMode.dispatch): decompose a product to see its bmm/mm (PRODUCT),
# decompose another CompositeImplicitAutograd op (COMPOSITE), judge a bmm/mm (MATMUL), or hand it to on_other.
PRODUCT, COMPOSITE, MATMUL, OTHER = "product", "composite", "matmul", "other"
# How strict's hot path may pass an op (GuardMode.__torch_dispatch__, Note [Strict's hot path] in
# modes/guard_mode.py): NO_KERNEL runs it (a view, or a product or SDPA call decided elsewhere); QUICK, a matmul
# or linear, runs within its entry's bound (the bound decomposing would take); an op of the other families runs
# by its `sizing` (below) where every tensor it reads has at most DIM_MAX elements; FULL takes the full route (a
# bmm/mm, a product the table bounds by no entry point).
FULL, NO_KERNEL, QUICK = "full", "no kernel", "quick"
# How op_size.size_call sizes a call: SKIP (no kernel, or a product decided elsewhere), INPUTS (its output is no
# larger than an input), BROADCAST (elementwise: its inputs broadcast), GROWN (its output may outgrow every input:
# `output` says to what), AFTER (nobody wrote its output size down: judged on what it made).
SKIP, INPUTS, BROADCAST, GROWN, AFTER = "skip", "inputs", "broadcast", "grown", "after"
# How the guard splits a call of the other families (modes/piecewise.py): POINTWISE blocks of its output;
# IN_PLACE_FILL the same, for a fill of a tensor; SOFTMAX_ROWS blocks that keep the softmax's dim whole; FILL an
# empty output filled by blocks; LOOKUP blocks of indices; ROWS blocks of rows, the normalized dims whole;
# REDUCE a reduction over all or some dims; REDUCE_WHOLE over all dims only (max.dim returns two tensors).
POINTWISE, IN_PLACE_FILL, SOFTMAX_ROWS, FILL, LOOKUP, ROWS, REDUCE, REDUCE_WHOLE = (
    "pointwise", "in-place fill", "softmax rows", "filled", "lookup", "rows", "reduce", "reduce whole")
# How a full reduction's pieces combine (modes/piecewise.py): by adding them (a mean's pre-weighted), multiplying,
# keeping the largest or smallest, or'ing or and'ing, or keeping the index of the largest or smallest value.
ADDED, WEIGHTED, MULTIPLIED, LARGEST, SMALLEST, EITHER, BOTH, LARGEST_AT, SMALLEST_AT = (
    "added", "weighted", "multiplied", "largest", "smallest", "either", "both", "largest at", "smallest at")
# How an entry point's bound is taken (chunking.entry_bound): PAIR, the last two tensors' product; WEIGHTED_ROWS,
# a Linear's input by its weight's rows; JOINED, cat's tensors laid end to end; CONTRACTED, an einsum's
# subscripts; SCORES, SDPA's (query rows times keys); BIRTH, a factory's elements (`elements`).
PAIR, WEIGHTED_ROWS, JOINED, CONTRACTED, SCORES, BIRTH = (
    "pair", "weighted rows", "joined", "contracted", "scores", "birth")
# A GROWN op whose output size only running it tells (a mask's True values, unique's count).
KNOWN_AFTER = "known after"
_SIZES = (tuple, list, torch.Size)


@dataclasses.dataclass(frozen=True, eq=False)
class EntryKind:
    """A kind of call at torch's Python entry points, wrapped at `places` while a handler is active (modes/
    entrypoint.py). `quick`: decided on the hot path by its operands' shapes (guard_entry._quick_pass);
    `product`: a matrix product; `elements`: a factory's element count from its arguments (None: not a factory);
    `sizes`: a factory whose operands are sizes, not tensors. Derived (plain fields: the hot path reads them):
    `at_entry`, decided at its entry as the one fused op it is (SDPA), not at the dispatch level; `batched`, a
    call that vmap batches into one bigger call of the same kind."""

    name: str
    places: tuple[tuple[Any, str], ...]
    bound: str
    quick: bool = False
    product: bool = False
    elements: Callable[[tuple, dict], int] | None = None
    sizes: bool = False
    at_entry: bool = dataclasses.field(init=False)
    batched: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "at_entry", self.bound is SCORES)
        object.__setattr__(self, "batched", not self.at_entry and self.elements is None)


def _sized_elements(args: tuple, kwargs: dict) -> int:
    # (*size), (size,), size=
    return _elements(args[0] if args and isinstance(args[0], _SIZES) else args or kwargs.get("size"))


def _elements(size: Any) -> int:
    """0 where the sizes are not plain numbers (an FX proxy, export's symbols): no arithmetic on them."""
    return math.prod(size) if isinstance(size, _SIZES) and all(type(d) is int for d in size) else 0


def _like_elements(args: tuple, kwargs: dict) -> int:
    like = args[0] if args else kwargs.get("input")
    return like.numel() if isinstance(like, torch.Tensor) else 0


def _arange_elements(args: tuple, kwargs: dict) -> int:
    numbers = [a for a in args if not isinstance(a, (torch.dtype, torch.device, str))]
    start, end, step = ((0, numbers[0], 1) if len(numbers) == 1 else (*numbers[:2], 1) if len(numbers) == 2
                        else tuple(numbers[:3]) if numbers else (0, None, 1))
    start, end, step = kwargs.get("start", start), kwargs.get("end", end), kwargs.get("step", step)
    if not all(type(x) in (int, float) for x in (start, end, step)) or not step:
        return 0
    return max(0, math.ceil((end - start) / step))


def _randint_elements(args: tuple, kwargs: dict) -> int:  # (high, size) or (low, high, size)
    return _elements(next((a for a in args if isinstance(a, _SIZES)), kwargs.get("size")))


def _on_torch(*names: str) -> tuple[tuple[Any, str], ...]:
    return tuple((torch, name) for name in names)


# Every entry point, by name. Tensor.__rmatmul__ calls torch.matmul, so it needs no wrapper of its own. The
# factories (the births a gated strict guard sees: Note [Strict, gated] in modes/guard_mode.py) come last.
ENTRY_KINDS: dict[str, EntryKind] = {kind.name: kind for kind in (
    EntryKind("matmul", ((torch, "matmul"), (torch.Tensor, "matmul"), (torch.Tensor, "__matmul__")), PAIR,
              quick=True, product=True),
    EntryKind("bmm", ((torch, "bmm"), (torch.Tensor, "bmm")), PAIR, quick=True, product=True),
    EntryKind("baddbmm", ((torch, "baddbmm"), (torch.Tensor, "baddbmm")), PAIR, product=True),
    EntryKind("mm", ((torch, "mm"), (torch.Tensor, "mm")), PAIR, quick=True, product=True),
    EntryKind("addmm", ((torch, "addmm"), (torch.Tensor, "addmm")), PAIR, product=True),
    EntryKind("linear", ((F, "linear"),), WEIGHTED_ROWS, quick=True, product=True),
    EntryKind("einsum", ((torch, "einsum"),), CONTRACTED, product=True),
    EntryKind("sdpa", ((F, "scaled_dot_product_attention"),), SCORES),
    EntryKind("cat", _on_torch("cat", "concat", "concatenate"), JOINED),
    EntryKind("sized", _on_torch("empty", "zeros", "ones", "rand", "randn"), BIRTH, elements=_sized_elements,
              sizes=True),
    EntryKind("full", _on_torch("full"), BIRTH, elements=_sized_elements, sizes=True),
    EntryKind("randint", _on_torch("randint"), BIRTH, elements=_randint_elements, sizes=True),
    EntryKind("arange", _on_torch("arange"), BIRTH, elements=_arange_elements, sizes=True),
    EntryKind("like", _on_torch(*(f"{f}_like" for f in "empty zeros ones full rand randn randint".split())), BIRTH,
              elements=_like_elements),
    EntryKind("new", tuple((torch.Tensor, f"new_{f}") for f in ("empty", "zeros", "ones", "full")), BIRTH,
              elements=lambda args, kwargs: _sized_elements(args[1:], kwargs)),  # the sizes after the tensor
)}


def stacked_shapes(kind: EntryKind, tensors: list[torch.Tensor]) -> tuple[tuple[int, ...], ...] | None:
    """The dense call a nested tensor's call is judged as (See Note [Nested tensors] in modes/shape_table.py): for
    cat, its first tensor and all the elements stacked alike; for a product (linear, matmul, SDPA's scores), an mm
    of the first operand's stacked rows by the second's columns (a Linear's weight's rows, or every key); None
    where a last dim is ragged."""
    try:
        stacked = [(t.numel() // (t.size(-1) or 1), t.size(-1)) if t.is_nested else tuple(t.shape)
                   for t in tensors]
    except RuntimeError:
        return None
    first, second = stacked[0], stacked[1] if len(stacked) > 1 else (1,)
    if kind.bound is JOINED:
        return first, (sum(t.numel() for t in tensors) // (first[-1] or 1), first[-1])
    columns = (math.prod(second[:-1]) if kind.bound is SCORES
               else second[0] if kind.bound is WEIGHTED_ROWS or len(second) == 1 else second[-1])
    return (math.prod(first[:-1]), first[-1]), (first[-1], columns)


# Output shapes of the GROWN ops from their bound arguments (None: the output is an input's size; KNOWN_AFTER).
def _size_argument(bound: dict[str, Any], inputs: list) -> Any:
    size = bound.get("size")
    return tuple(size) if isinstance(size, _SIZES) else None


def _laid_end_to_end(bound: dict[str, Any], inputs: list, stacks: bool = False) -> Any:
    tensors = [t for t in bound.get("tensors", inputs) if not (t.dim() == 1 and t.numel() == 0)]
    if not tensors:
        return None
    first, dim = tensors[0], bound.get("dim", 0)
    shape = list(first.shape)
    if stacks:
        shape.insert(dim % (first.dim() + 1), len(tensors))
    else:
        shape[dim % first.dim()] = sum(t.shape[dim % first.dim()] for t in tensors)
    return shape


def _picked_rows(bound: dict[str, Any], inputs: list) -> Any:
    shape = list(bound["self"].shape)
    if shape:
        shape[bound["dim"] % len(shape)] = bound["index"].numel()
    return shape


def _indexed(bound: dict[str, Any], inputs: list) -> Any:
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in bound["indices"]):
        return KNOWN_AFTER  # a mask picks as many elements as it holds True values
    picks = [t for t in bound["indices"] if t is not None]
    rest = bound["self"].shape[len(bound["indices"]):]
    picked = torch.broadcast_shapes(*(t.shape for t in picks)) if picks else ()
    return (*picked, *rest)


def _arange_shape(bound: dict[str, Any], inputs: list) -> Any:
    start, end, step = bound.get("start", 0), bound.get("end", 0), bound.get("step", 1)
    return (max(0, math.ceil((end - start) / step)),)


# Output shapes on meta (the tracer's shortcut, tracer._fast_meta) from the call's tensors and arguments.
def _broadcast_meta(tensors: list, args: tuple, kwargs: dict) -> Any:
    first = tuple(tensors[0].shape)
    if all(tuple(t.shape) == first for t in tensors):
        return (first,)
    return (tuple(torch.broadcast_shapes(*(t.shape for t in tensors))),)


def _first_meta(tensors: list, args: tuple, kwargs: dict) -> Any:
    return (tuple(tensors[0].shape),)


def _normalized_meta(tensors: list, args: tuple, kwargs: dict) -> Any:
    first = tuple(tensors[0].shape)  # the output, then the mean and rstd with the normalized dims kept as 1
    kept = len(first) - len(args[1])
    stats = (*first[:kept], *(1,) * (len(first) - kept))
    return first, stats, stats


def _joined_meta(tensors: list, args: tuple, kwargs: dict) -> Any:
    first = tuple(tensors[0].shape)
    if not (isinstance(args[0], (list, tuple)) and all(t.dim() == len(first) for t in args[0])):
        return None
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(first)
    return ((*first[:dim], sum(t.shape[dim] for t in args[0]), *first[dim + 1:]),)


def _reduced_meta(tensors: list, args: tuple, kwargs: dict) -> Any:
    first = tuple(tensors[0].shape)
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if not (isinstance(dims, (list, tuple)) and dims and first):
        return None  # a reduction over every dim, or one dim: as any other call
    keep = bool(kwargs.get("keepdim", args[2] if len(args) > 2 else False))
    reduced = {d % len(first) for d in dims}
    return (tuple(1 if i in reduced else n for i, n in enumerate(first) if keep or i not in reduced),)


def _grouped_mm_meta(args: tuple) -> Any:
    return (*args[0].shape[:-1], args[1].shape[-1])  # (S, K) x (E, K, N) -> (S, N)


# What mpsimpact knows of an op beyond its family: by name (overload and in-place "_" dropped) or by
# "name.overload" where one overload alone is meant. The fields are OpEntry's.
_WRAPS = dict(wraps=True)  # 2.13.0 returns the reduction of numel mod 2**32 elements (emulator.wrapped_reduction)
_DIMS = dict(meta=_reduced_meta)


def _each(names: str, **fields: Any) -> dict[str, dict[str, Any]]:
    return {name: dict(fields) for name in names.split()}


_KNOWN: dict[str, dict[str, Any]] = {
    # The bmm/mm kernels, and their operands' places in their arguments.
    "bmm.default": dict(operands=("bmm", 0, 1)), "baddbmm.default": dict(operands=("bmm", 1, 2)),
    "mm.default": dict(operands=("mm", 0, 1)), "addmm.default": dict(operands=("mm", 1, 2)),
    # CompositeImplicitAutograd products that reach a dispatch mode whole under torch.inference_mode():
    # decomposed to expose their bmm/mm, unless their entry point's bound (`decomposed`) is below every limit.
    # Every other composite op (softmax.int, layer_norm, dropout) is decomposed too where a tensor passes
    # DIM_MAX, so that a mode sees the kernels MPS runs, named as a trace under no_grad names them.
    "matmul.default": dict(decomposed="matmul"), "einsum.default": dict(decomposed="einsum"),
    "linear.default": dict(decomposed="linear", nested_as="linear"),
    "_scaled_dot_product_attention_math.default": dict(decomposed="sdpa"),
    "tensordot.default": dict(decomposed=""), "bilinear.default": dict(decomposed=""),  # always decomposed
    "cat.default": dict(nested_as="cat"),
    # SDPA's own kernels, as a call that bypassed its entry point reaches the dispatch mode.
    **{f"{name}.default": dict(fused_sdpa=True) for name in """_scaled_dot_product_flash_attention_for_cpu
        _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
        _scaled_dot_product_cudnn_attention _scaled_dot_product_fused_attention_overrideable
        _scaled_dot_product_attention_math_for_mps""".split()},
    # Its meta kernel accepts bf16 alone; an MoE model in fp32 runs it on MPS and the CPU.
    "_grouped_mm.default": dict(shape_only=_grouped_mm_meta),
    # Lookups and the ops whose output size their values decide.
    "arange": dict(output=_arange_shape), "index_select": dict(output=_picked_rows),
    "index": dict(output=_indexed),
    "embedding": dict(output=lambda b, i: (*b["indices"].shape, b["weight"].shape[-1]), split=LOOKUP),
    **_each("gather take", output=lambda b, i: tuple(b["index"].shape)),
    **_each("nonzero masked_select unique repeat_interleave", output=KNOWN_AFTER),
    "embedding_dense_backward": dict(weight_gradient=True),
    "cat": dict(meta=_joined_meta), "stack": dict(output=lambda b, i: _laid_end_to_end(b, i, True), stacks=True),
    # Rows, softmaxes and triangles: their first tensor's shape on meta.
    "native_layer_norm": dict(split=ROWS, meta=_normalized_meta),
    **_each("softmax _softmax _safe_softmax log_softmax _log_softmax tril triu", meta=_first_meta),
    # Fills: of a tensor in place, or of a new one with a value (full's: its fill_value, as given).
    **_each("fill zero", split=IN_PLACE_FILL),
    **_each("ones ones_like new_ones", split=FILL, fill=1),
    **_each("zeros zeros_like new_zeros", split=FILL, fill=0),
    **_each("full full_like new_full", split=FILL),
    # Reductions whose pieces combine exactly.
    **_each("nansum count_nonzero", split=REDUCE, combine=ADDED, **_WRAPS),
    "sum": dict(split=REDUCE, combine=ADDED, **_WRAPS, **_DIMS),
    "mean": dict(split=REDUCE, combine=WEIGHTED, **_WRAPS, **_DIMS),
    "amax": dict(split=REDUCE, combine=LARGEST, **_WRAPS, **_DIMS),
    "amin": dict(split=REDUCE, combine=SMALLEST, **_WRAPS, **_DIMS),
    "prod": dict(split=REDUCE, combine=MULTIPLIED, **_WRAPS),
    "max": dict(split=REDUCE_WHOLE, combine=LARGEST, **_WRAPS),
    "min": dict(split=REDUCE_WHOLE, combine=SMALLEST, **_WRAPS),
    "any": dict(split=REDUCE, combine=EITHER, **_WRAPS), "all": dict(split=REDUCE, combine=BOTH, **_WRAPS),
    "argmax": dict(split=REDUCE, combine=LARGEST_AT), "argmin": dict(split=REDUCE, combine=SMALLEST_AT),
}
# Families whose calls have no kernel or are decided elsewhere (the products: on_matmul and the SDPA entry);
# families whose output can have more elements than every input; the pointwise families' splits.
_SKIPPED = frozenset({"view", "bmm", "mm", "sdpa"})
_GROWING = frozenset({"creation", "random", "indexing", "cat"})
_FAMILY_SPLITS = {"elementwise": POINTWISE, "masked_fill": POINTWISE, "copy": POINTWISE, "softmax": SOFTMAX_ROWS}


@dataclasses.dataclass(frozen=True, eq=False)
class OpEntry:
    """What the modes know of one aten op overload (See the module's docstring). `name` is the op as records
    name it ("add_"); `run` calls it (its C++ op, one Python frame less than the overload's __call__)."""

    op: Any
    name: str
    family: str
    route: str
    hot: str
    sizing: str
    run: Callable[..., Any]
    operands: tuple[str, int, int] | None = None  # MATMUL: (family, index of a, index of b) in its arguments
    bound_by: EntryKind | None = None  # PRODUCT: the entry point whose bound says whether it can meet a rule
    nested_as: EntryKind | None = None  # the entry point a nested tensor's call of it is judged as
    output: Any = None  # GROWN: its output shape from its bound arguments and inputs, or KNOWN_AFTER
    weight_gradient: bool = False  # its output is a parameter's gradient (a weight's size whatever the batch)
    split: str | None = None  # how the guard splits it (None: it does not)
    combine: str | None = None  # a reduction's pieces, combined
    fill: Any = None  # a fill's value (None: its fill_value argument)
    stacks: bool = False  # a cat that stacks its inputs along a new dim
    wraps: bool = False  # a reduction whose result wraps past INT_MAX on 2.13.0 (emulated)
    fused_sdpa: bool = False  # one of SDPA's own kernels, reached past its entry
    meta: Callable[..., Any] | None = None  # its output shapes on meta from its tensors and arguments
    shape_only: Callable[[tuple], Any] | None = None  # its output shape where its meta kernel refuses
    in_place: bool = False
    allocates: bool = False  # allocates a buffer without a kernel (engine.release.allocates)


OP_ENTRIES: dict[int, OpEntry] = {}  # by id(op): an OpOverload's __hash__ is Python; the entry keeps its op alive
_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


def op_entry(func: Any) -> OpEntry:
    """The table's entry for an aten op overload, made on first sight and kept."""
    found = OP_ENTRIES.get(id(func))
    if found is None:
        found = OP_ENTRIES[id(func)] = _entry_for(func)
    return found


def _is_composite(func: Any) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT)
    except RuntimeError:  # an op the dispatcher does not hold (prim::device, seen under torch.export)
        return False


def _entry_for(func: Any) -> OpEntry:
    overload = func.__name__
    name = overload.split(".")[0]
    base = name.rstrip("_")
    known = {**_KNOWN.get(base, {}), **_KNOWN.get(overload, {})}
    family = family_of(func)
    decomposed = known.pop("decomposed", None)
    route = (PRODUCT if decomposed is not None else COMPOSITE if _is_composite(func)
             else MATMUL if "operands" in known else OTHER)
    bound_by = ENTRY_KINDS.get(decomposed) if decomposed else None
    sizing = (SKIP if family in _SKIPPED else BROADCAST if family == "elementwise"
              else GROWN if family in _GROWING else AFTER if family == "other" else INPUTS)
    if route is PRODUCT:
        hot = QUICK if bound_by is not None and bound_by.quick else FULL
    elif route is MATMUL:
        hot = FULL
    elif sizing is SKIP:  # a composite view (reshape) or SDPA: the full route runs one whole below DIM_MAX
        hot = NO_KERNEL if route is OTHER else INPUTS
    elif sizing is GROWN and name.endswith("_"):  # fill_, uniform_, index_put_: it writes into its input
        hot = INPUTS
    else:
        hot = sizing
    if sizing is GROWN and "output" not in known:
        known["output"] = (_laid_end_to_end if family == "cat" else _size_argument
                           if family in ("creation", "random") else None)
    nested = known.pop("nested_as", "matmul" if route in (PRODUCT, MATMUL) else None)
    run = func._op if type(func) is torch._ops.OpOverload else func
    return OpEntry(
        func, name, family, route, hot, sizing, run, bound_by=bound_by,
        nested_as=ENTRY_KINDS[nested] if nested else None,
        split=known.pop("split", _FAMILY_SPLITS.get(family)),
        meta=known.pop("meta", _broadcast_meta if family == "elementwise" else None),
        in_place=name.endswith("_"), allocates=allocates(func), **known)


def split_named(op: str, family: str) -> str | None:
    """How the guard splits a recorded call of op `op` (a record's name) and family `family` (None: it does
    not): for plans and check's advice, which see names and shapes only."""
    return _KNOWN.get(op.rstrip("_"), {}).get("split", _FAMILY_SPLITS.get(family))


_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)  # a call's tensor lists (cat's)


def within(items: Any, most: int) -> bool:
    """Whether every tensor among `items` (lists opened one level) has at most `most` elements (Note [Strict's hot
    path] in modes/guard_dispatch.py)."""
    for item in items:
        if isinstance(item, _Tensor):
            if item.numel() > most:
                return False
        elif type(item) in _SEQUENCES and not all(t.numel() <= most for t in item if isinstance(t, _Tensor)):
            return False
    return True


def broadcast_within(args: tuple, kwargs: dict, most: int) -> bool:
    """Whether an elementwise call's tensors (lists opened one level) have at most `most` elements each, none is
    empty, and they share a shape or their sizes' product is at most `most`, the most their broadcast can have."""
    product, shape, same = 1, None, True
    for arg in (*args, *kwargs.values()) if kwargs else args:
        for t in arg if type(arg) in _SEQUENCES else (arg,):
            if isinstance(t, _Tensor):
                n = t.numel()
                if n > most or not n:
                    return False
                product *= n
                if shape is None:
                    shape = t.shape
                elif same and t.shape != shape:
                    same = False
    return same or product <= most


_DEFAULT_DISPATCH = torch.Tensor.__torch_dispatch__  # a tensor type that does not override dispatch


def plain_types(types: tuple) -> bool:
    """Whether a dispatch's tensor types are all plain (torch.Tensor, nn.Parameter: no __torch_dispatch__ of their
    own), so that a hot path may answer the call; a subclass that dispatches (FakeTensor, nested) takes the route."""
    return all(t.__torch_dispatch__ is _DEFAULT_DISPATCH for t in types)
