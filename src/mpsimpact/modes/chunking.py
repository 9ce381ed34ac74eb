"""Splitting a call that would fault on MPS into pieces that do not: bmm/mm along the leading dim, and
where one batch alone would still fault, a bmm along its output rows and columns; SDPA over batch and
heads, then along query rows (a causal mask placed at each block's offset); cat by copying into
place. Each result equals the unsplit correct one; a call no split makes safe is refused, never
computed."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mpsimpact.modes.base import active_emulator, flat_arguments, sdpa_arguments, sdpa_operands
from mpsimpact.modes.op_table import CONTRACTED, JOINED, SCORES, WEIGHTED_ROWS, EntryKind, op_entry
from mpsimpact.engine.faults import MPS_INDEX_BITS, TensorSpec, rows_per_safe_chunk, limits


def _piece(x: torch.Tensor, copy: bool) -> torch.Tensor:
    # A slice keeps its storage offset; releases that count it (2.5.1 .. 2.9.1) need a fresh copy.
    return x.clone(memory_format=torch.contiguous_format) if copy and x.storage_offset() else x


@dataclasses.dataclass(frozen=True)
class Split:
    """How one bmm/mm is cut: `batches` leading-dim rows a piece; where one batch alone would still
    fault, each batch is cut into blocks of `rows` output rows and `cols` output columns."""

    batches: int
    rows: int | None = None
    cols: int | None = None


def split_bmm(a: TensorSpec, b: TensorSpec, index_bits: int, family: str = "bmm") -> Split | None:
    """The pieces of a bmm (or mm) that every release computes correctly: whole batches where one batch
    is safe as a slice (every operand a view below VIEW_LIMIT, the output at most LIMIT); otherwise
    contiguous copies of blocks of rows of `a` and columns of `b`, each below VIEW_LIMIT, whose output
    block is too. None when even one row of `a` times one column block crosses a limit."""
    limit, view_limit = limits(index_bits)
    cap = view_limit - 1
    if family == "mm":
        return Split(rows_per_safe_chunk(a, b, index_bits=index_bits, op="mm"))
    m, k, n = a.shape[1], a.shape[2], b.shape[2]
    if max(m * k, k * n) <= cap and m * n <= limit:
        return Split(rows_per_safe_chunk(a, b, index_bits=index_bits, as_slices=True))
    cols = n if k * n <= cap else cap // k
    rows = min(m, cap // k, cap // max(cols, 1))
    return Split(1, rows, cols) if rows >= 1 and cols >= 1 else None


def run_in_pieces(func, family: str, args: tuple, kwargs: dict, split: Split, copy: bool = False) -> torch.Tensor:
    """Computes one bmm/baddbmm/mm/addmm piece by piece (see `split_bmm`) into one output."""
    _, ia, ib = op_entry(func).operands
    if not args[ia].numel() or not args[ib].numel():  # nothing to read: the plain call makes its empty result
        return func(*args, **kwargs)
    if split.rows is not None:
        return _run_in_blocks(func, args, kwargs, split)
    return _run_chunked(func, family, args, kwargs, split.batches, copy)


def _run_in_blocks(func, args: tuple, kwargs: dict, split: Split) -> torch.Tensor:
    # One batch at a time, in (rows x cols) output blocks; every operand a contiguous copy, so no
    # piece is a view and no layout the study did not measure reaches MPS.
    _, ia, ib = op_entry(func).operands
    a, b = args[ia], args[ib]
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]), dtype=torch.result_type(a, b))
    base = args[0].expand(out.shape) if ia == 1 else None  # baddbmm: its input, broadcast (a view)
    for i in range(a.shape[0]):
        for r in range(0, a.shape[1], split.rows):
            rows = slice(r, r + split.rows)
            a_block = a[i:i + 1, rows].contiguous()
            for c in range(0, b.shape[2], split.cols):
                cols = slice(c, c + split.cols)
                part = list(args)
                part[ia], part[ib] = a_block, b[i:i + 1, :, cols].contiguous()
                if base is not None:
                    part[0] = base[i:i + 1, rows, cols]
                out[i:i + 1, rows, cols] = func(*part, **kwargs)
    return out


def _run_chunked(func, family: str, args: tuple, kwargs: dict, chunk: int, copy: bool = False) -> torch.Tensor:
    """Computes one bmm/baddbmm/mm/addmm in leading-dim chunks of at most `chunk`."""
    _, ia, ib = op_entry(func).operands
    a, b = args[ia], args[ib]
    rows = a.shape[0]
    out = None
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        part = list(args)
        part[ia] = _piece(a[start:stop], copy)
        if family == "bmm":
            part[ib] = _piece(b[start:stop], copy)
        if ia == 1:  # baddbmm/addmm: slice the added input where it has this leading dim
            base = args[0]
            if base.dim() == a.dim() and base.shape[0] == rows:
                part[0] = base[start:stop]
        piece = func(*part, **kwargs)
        if out is None:
            out = torch.empty((rows, *piece.shape[1:]), dtype=piece.dtype, device=a.device)
        out[start:stop].copy_(piece)
    return out


@dataclasses.dataclass(frozen=True)
class SdpaSplit:
    """SDPA pieces: `rows` of batch*heads a piece, each over `block` query rows."""

    rows: int
    block: int


def split_sdpa(query_shape: tuple[int, ...], key_shape: tuple[int, ...], value_dim: int,
               index_bits: int, causal: bool = False, full_mask: bool = False,
               scores: int | None = None) -> SdpaSplit | None:
    """Pieces whose scores stay at or below LIMIT and whose operands (slices, so views) stay below
    VIEW_LIMIT on every release: whole batch-head rows where one row fits, else one row over blocks of
    query rows (`causal`: each block's mask, made for it, also at most DIM_MAX elements, which no op
    family faults on; `full_mask`: a mask with a row per query and batch row, sliced like the scores, so
    below VIEW_LIMIT too). None when one key or value head alone crosses the view limit.

    With `scores` (the most score elements a piece may hold, from the memory budget, see Note [Attention
    memory budget]), fewer rows a piece, then fewer query rows (at least one), never more than the limits
    allow."""
    split = _split_sdpa_by_limits(query_shape, key_shape, value_dim, index_bits, causal, full_mask)
    if split is None or scores is None or split.rows * split.block * key_shape[-2] <= scores:
        return split
    lk = key_shape[-2]
    if split.block * lk <= scores:
        return SdpaSplit(scores // (split.block * lk), split.block)
    return SdpaSplit(1, max(1, min(split.block, scores // lk)))


def _split_sdpa_by_limits(query_shape: tuple[int, ...], key_shape: tuple[int, ...], value_dim: int,
                          index_bits: int, causal: bool, full_mask: bool) -> SdpaSplit | None:
    limit, view_limit = limits(index_bits)
    lq, d = query_shape[-2], query_shape[-1]
    lk = key_shape[-2]
    if max(lk * d, lk * value_dim) >= view_limit:
        return None
    per_row_view = max(lq * d, lk * d, lk * value_dim, lq * value_dim, lq * lk if full_mask else 0)
    rows = min(limit // (lq * lk), (view_limit - 1) // per_row_view)
    if rows >= 1:
        return SdpaSplit(rows, lq if not causal or lq * lk < view_limit else (view_limit - 1) // lk)
    block = min(limit // lk, (view_limit - 1) // max(d, value_dim))
    return SdpaSplit(1, min(block, (view_limit - 1) // lk) if causal or full_mask else block)


def run_sdpa_chunked(proceed: Callable[..., torch.Tensor], args: tuple, kwargs: dict, split: SdpaSplit,
                     copy: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention over pieces of at most `split.rows` rows of its (broadcast) batch and
    `split.block` query rows, each piece computed by `proceed` (the plain call) and written into one
    output: the plain call's value for every argument it accepts (any number of batch dims,
    broadcasting, boolean or float masks, `is_causal` as the mask torch makes of it at each block's
    offset, `scale`, `enable_gqa` with key/value heads read per group, never copied per query head).
    Not for dropout_p > 0: no split reproduces the plain call's random mask (the guard stops such a call).
    """
    bound = sdpa_arguments(args, kwargs)
    query, key, value = bound.pop("query"), bound.pop("key"), bound.pop("value")
    mask, causal = bound.pop("attn_mask", None), bound.pop("is_causal", False)
    if mask is not None and causal:
        return proceed(*args, **kwargs)  # torch's own error for a mask with is_causal
    groups = query.shape[-3] // key.shape[-3] if bound.get("enable_gqa") and key.dim() > 2 else 1
    batch = _sdpa_batch(query, key, value, mask, groups)
    lq, lk = query.shape[-2], key.shape[-2]
    out = query.new_empty((*batch, lq, value.shape[-1]))  # (*batch, Lq, Dv)
    for index in batch_blocks(batch, split.rows, groups):
        k, v = (_piece(_batch_part(x, index, batch, groups), copy) for x in (key, value))
        q_rows = _batch_part(query, index, batch)
        mask_rows = _batch_part(mask, index, batch) if isinstance(mask, torch.Tensor) and mask.dim() > 2 else mask
        for start in range(0, lq, split.block):
            rows = slice(start, min(lq, start + split.block))
            if causal:  # rows `rows` of tril(ones(Lq, Lk)): torch's top-left causal mask, at this offset
                piece_mask = torch.ones(rows.stop - start, lk, dtype=torch.bool, device=query.device).tril(start)
            elif isinstance(mask_rows, torch.Tensor) and mask_rows.dim() > 1 and mask_rows.shape[-2] > 1:
                piece_mask = mask_rows[..., rows, :]
            else:
                piece_mask = mask_rows
            out[(*index, rows)] = proceed(_piece(q_rows[..., rows, :], copy), k, v, piece_mask, **bound)
    return out


def _sdpa_batch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
                groups: int) -> tuple[int, ...]:
    """The output's batch dims: the operands' (and the mask's) batch dims broadcast, with grouped
    key/value heads counted as the query heads they serve."""
    shapes = [query.shape[:-2]]
    for x in (key, value):
        shape = list(x.shape[:-2])
        if shape and groups > 1:
            shape[-1] *= groups
        shapes.append(tuple(shape))
    if isinstance(mask, torch.Tensor) and mask.dim() > 2:
        shapes.append(mask.shape[:-2])
    return tuple(torch.broadcast_shapes(*shapes))


def batch_blocks(batch: tuple[int, ...], rows: int, groups: int = 1) -> Iterator[tuple[slice, ...]]:
    """Blocks of at most `rows` rows of the batch, in row-major order: the first dim whose trailing dims
    fit is stepped, every dim before it one index at a time; on the head dim (the last) a step covers
    whole groups of query heads or lies within one."""
    if not batch:
        yield ()
        return
    dim = next(d for d in range(len(batch)) if math.prod(batch[d + 1:]) <= rows)
    step = max(1, min(batch[dim], rows // max(math.prod(batch[dim + 1:]), 1)))
    if dim == len(batch) - 1 and groups > 1:
        step = step - step % groups if step >= groups else max(d for d in range(1, step + 1) if groups % d == 0)
    whole = (slice(None),) * (len(batch) - dim - 1)
    for lead in itertools.product(*(range(n) for n in batch[:dim])):
        for start in range(0, batch[dim], step):
            yield (*(slice(i, i + 1) for i in lead), slice(start, min(batch[dim], start + step)), *whole)


def _batch_part(x: torch.Tensor, index: tuple[slice, ...], batch: tuple[int, ...], groups: int = 1) -> torch.Tensor:
    """The part of a (broadcast) operand that a block of the batch reads: a view. A dim of size 1 that
    broadcasts is kept whole; on the head dim of grouped keys/values, the key/value heads of the block's
    query heads."""
    parts = []
    offset = len(batch) - (x.dim() - 2)
    for j in range(x.dim() - 2):
        at = j + offset
        if at < 0 or (x.shape[j] == 1 and batch[at] != 1):
            parts.append(slice(None))
        elif groups > 1 and at == len(batch) - 1:
            start, stop, _ = index[at].indices(batch[at])
            parts.append(slice(start // groups, (stop - 1) // groups + 1))
        else:
            parts.append(index[at])
    return x[tuple(parts)]


def cat_in_place(func: Any, args: tuple, kwargs: dict, most: int | None = None) -> torch.Tensor:
    """torch.cat (or stack, concat, their `out=` forms) computed by copying each piece into a preallocated
    output (no cat kernel); with `most`, each copy in blocks of at most `most` elements along the dim (a
    1-D input past the per-dimension limit is copied in pieces too)."""
    bound = dict(zip(("tensors", "dim"), args)) | kwargs
    tensors, dim, out = list(bound["tensors"]), bound.get("dim", 0), bound.get("out")
    if op_entry(func).stacks:
        tensors = [t.unsqueeze(dim) for t in tensors]  # stack = cat of the inputs, each one index along dim
    else:
        tensors = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]  # cat's legacy empty rule
    if not tensors:
        return func(*args, **kwargs)
    first = tensors[0]
    dim = dim % first.dim()
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    target = out.resize_(shape) if out is not None else first.new_empty(shape, dtype=dtype)
    offset = 0
    for t in tensors:
        per = max(1, t.numel() // max(t.shape[dim], 1))  # elements of one index along dim
        step = t.shape[dim] if most is None else max(1, most // per)
        for start in range(0, t.shape[dim], step):
            size = min(step, t.shape[dim] - start)
            target.narrow(dim, offset + start, size).copy_(t.narrow(dim, start, size))
        offset += t.shape[dim]
    return target


def entry_bound(kind: EntryKind, args: tuple, kwargs: dict) -> float:
    """The largest element count that decides whether an entry-point call of this kind could meet any rule:
    every tensor's storage extent, and the logical operands and output of the matrix product (broadcast
    batch; SDPA's scores too). On the guard's hot path: plain arithmetic, no pytree, no broadcast_shapes."""
    rule = kind.bound
    if kwargs or rule is JOINED or rule is CONTRACTED:
        tensors = [x for x in flat_arguments(args, kwargs) if isinstance(x, torch.Tensor)]
    else:
        tensors = [x for x in args if isinstance(x, torch.Tensor)]
    # The rules read a slice's storage extent (offset + numel: exact for dense views) or a view's numel;
    # neither exceeds this.
    bound = max((t.storage_offset() + t.numel() for t in tensors), default=0)
    if rule is JOINED:
        return max(bound, sum(t.numel() for t in tensors))
    if rule is CONTRACTED:
        return max(bound, einsum_elements(args))
    if len(tensors) < 2:
        return math.inf  # not a product this reads: look closer
    if rule is WEIGHTED_ROWS:
        x, w = tensors[0], tensors[1]
        return max(bound, x.numel() // max(x.shape[-1], 1) * w.shape[0])
    a, b = tensors[-2], tensors[-1]  # the two matrix operands (baddbmm/addmm: after the input)
    bound = max(bound, product_elements(a.shape, b.shape))
    if rule is SCORES:  # SDPA's scores, (*batch, Lq, Lk): as many as its query's rows times its keys
        query, key, _ = sdpa_operands(args, kwargs)
        bound = max(bound, query.numel() // max(query.shape[-1], 1) * key.shape[-2])
    return bound


def einsum_elements(args: tuple) -> float:
    """The most elements any tensor of an einsum's contraction holds past its operands: the product of every
    subscript's size (each pairwise intermediate, bmm operand and output of torch's contraction is indexed by
    some of the subscripts, an ellipsis by the broadcast dims). inf where the call is not (equation,
    *operands) with one subscript per dim (the sublist form, a malformed call: torch says what is wrong)."""
    operands = args[1:] if len(args) != 2 or not isinstance(args[1], (list, tuple)) else args[1]
    if not args or not isinstance(args[0], str) or not all(isinstance(t, torch.Tensor) for t in operands):
        return math.inf
    subscripts = args[0].replace(" ", "").split("->")[0].split(",")
    if len(subscripts) != len(operands):
        return math.inf
    sizes: dict[str, int] = {}
    ellipses: list[tuple[int, ...]] = []
    for letters, operand in zip(subscripts, operands):
        head, dots, tail = letters.partition("...")
        dims = operand.dim() - len(head) - len(tail)
        if dims < 0 or (not dots and dims):
            return math.inf
        shape = tuple(operand.shape)
        ellipses.append(shape[len(head):len(head) + dims])
        for letter, size in zip(head + tail, shape[:len(head)] + shape[len(head) + dims:]):
            sizes[letter] = max(sizes.get(letter, 1), size)
    broadcast = (max(sizes_at) for sizes_at in itertools.zip_longest(*map(reversed, ellipses), fillvalue=1))
    return math.prod(sizes.values()) * math.prod(broadcast)


def product_elements(sa: tuple[int, ...], sb: tuple[int, ...]) -> int:
    """The largest logical element count of a matrix product of shapes `sa` @ `sb` as bmm sees it: either
    operand broadcast to the batch, or the output."""
    m, k = (sa[-2], sa[-1]) if len(sa) > 1 else (1, sa[-1])
    n = sb[-1] if len(sb) > 1 else 1
    batch = 1
    for x, y in itertools.zip_longest(reversed(sa[:-2]), reversed(sb[:-2]), fillvalue=1):
        batch *= max(x, y)
    return batch * max(m * k, k * n, m * n)


def emulated_index_bits() -> int:
    """The index width of the emulator running (its rules scale with it; a replayed plan runs at 32 bits)."""
    active = active_emulator()
    return active.index_bits if active is not None and active.plan is None else MPS_INDEX_BITS


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Pieces of one attention call: `rows` of batch * key/value heads a piece (each with its group of
    query heads), over `block` query rows; with `key_block`, over blocks of that many keys with an
    online softmax (None: every key at once, a whole-row softmax as eager's)."""

    rows: int
    block: int
    key_block: int | None = None


def attention_blocks(batch: int, kv_heads: int, groups: int, length: int, keys: int, dim: int,
                     value_dim: int, index_bits: int | None = None, scores: int | None = None) -> Blocks | None:
    """The largest pieces whose two products, Q K^T (n, G*r, D) @ (n, D, Lk) and P V (n, G*r, Lk) @
    (n, Lk, Dv), keep every operand (a slice, so a view) below VIEW_LIMIT and the output at most LIMIT
    on every release: whole query rows where a sample-and-head fits, else blocks of r query rows.
    None when one query row of a group already crosses a limit (keys past VIEW_LIMIT / G).

    With `scores` (the most score elements one piece may hold, from the memory budget), the pieces are
    made smaller still where they hold more: fewer rows, then fewer query rows, then key blocks.
    """
    limit, view_limit = limits(emulated_index_bits() if index_bits is None else index_bits)
    cap = min(limit, view_limit - 1)
    widest = max(keys, dim, value_dim)  # per query row of the folded group: scores, Q and output
    per_row = groups * length * widest
    if max(keys * dim, keys * value_dim) <= cap and per_row <= cap:
        blocks = Blocks(min(batch * kv_heads, cap // per_row), length)
    else:
        block = cap // (groups * widest)
        blocks = Blocks(1, block) if block >= 1 and max(keys * dim, keys * value_dim) <= cap else None
    return blocks if blocks is None or scores is None else _within(blocks, groups, length, keys, scores)


def _within(blocks: Blocks, groups: int, length: int, keys: int, scores: int) -> Blocks:
    """`blocks` made small enough that one piece holds at most `scores` score elements (at least one query
    row and one key). See Note [Attention memory budget]."""
    if blocks.block == length and blocks.rows * groups * length * keys <= scores:
        return blocks
    if blocks.block == length and groups * length * keys <= scores:
        return Blocks(scores // (groups * length * keys), length)
    block = min(blocks.block, scores // (groups * keys))
    if block >= 1:  # whole rows of keys: the whole-row softmax, as eager's
        return Blocks(1, block)
    # Not one query row of the group over all keys fits: key blocks. The number of (query block, key
    # block) steps is about G * L * Lk / scores whatever their shape, so make them square-ish (products
    # of r x D and D x kb, not one query row against many keys).
    block = max(1, min(blocks.block, length, math.isqrt(scores // groups)))
    return Blocks(1, block, max(1, min(keys - 1, scores // (groups * block))))
