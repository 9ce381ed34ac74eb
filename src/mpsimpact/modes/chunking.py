"""Splitting a call that would fault on MPS into pieces that do not: bmm/mm along the leading dim, and
where one batch alone would still fault, a bmm along its output rows and columns; SDPA over batch and
heads, then along query rows (a causal mask placed at each block's offset); cat by copying into
place. Each result equals the unsplit correct one; a call no split makes safe is refused, never
computed. Also: running a call with its backward pass under a dispatch mode (for the guard's big calls)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpsimpact.modes.base import MATMUL_OPS, sdpa_operands
from mpsimpact.engine.faults import TensorSpec, rows_per_safe_chunk, limits


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

    @property
    def size(self) -> int:
        """The pieces' size in the unit the guard reports (batches, or output rows of one batch)."""
        return self.batches if self.rows is None else self.rows


def split_bmm(a: TensorSpec, b: TensorSpec, index_bits: int, op: str = "bmm") -> Split | None:
    """The pieces of a bmm (or mm) that every release computes correctly: whole batches where one batch
    is safe as a slice (every operand a view below VIEW_LIMIT, the output at most LIMIT); otherwise
    contiguous copies of blocks of rows of `a` and columns of `b`, each below VIEW_LIMIT, whose output
    block is too. None when even one row of `a` times one column block crosses a limit."""
    limit, view_limit = limits(index_bits)
    cap = view_limit - 1
    if op == "mm":
        return Split(rows_per_safe_chunk(a, b, index_bits=index_bits, op="mm"))
    m, k, n = a.shape[1], a.shape[2], b.shape[2]
    if max(m * k, k * n) <= cap and m * n <= limit:
        return Split(rows_per_safe_chunk(a, b, index_bits=index_bits, as_slices=True))
    cols = n if k * n <= cap else cap // k
    rows = min(m, cap // k, cap // max(cols, 1))
    return Split(1, rows, cols) if rows >= 1 and cols >= 1 else None


def run_in_pieces(func, family: str, args: tuple, kwargs: dict, split: Split, copy: bool = False) -> torch.Tensor:
    """Computes one bmm/baddbmm/mm/addmm piece by piece (see `split_bmm`) into one output."""
    if split.rows is not None:
        return _run_in_blocks(func, args, kwargs, split)
    return _run_chunked(func, family, args, kwargs, split.batches, copy)


def _run_in_blocks(func, args: tuple, kwargs: dict, split: Split) -> torch.Tensor:
    # One batch at a time, in (rows x cols) output blocks; every operand a contiguous copy, so no
    # piece is a view and no layout the study did not measure reaches MPS.
    _, ia, ib = MATMUL_OPS[func]
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
    _, ia, ib = MATMUL_OPS[func]
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
               index_bits: int, causal: bool = False) -> SdpaSplit | None:
    """Pieces whose scores stay at or below LIMIT and whose operands (slices, so views) stay below
    VIEW_LIMIT on every release: whole batch-head rows where one row fits, else one row over blocks of
    query rows (`causal`: each block's mask, made for it, also at most DIM_MAX elements, which no op
    family faults on). None when one key or value head alone crosses the view limit."""
    limit, view_limit = limits(index_bits)
    lq, d = query_shape[-2], query_shape[-1]
    lk = key_shape[-2]
    if max(lk * d, lk * value_dim) >= view_limit:
        return None
    per_row_view = max(lq * d, lk * d, lk * value_dim, lq * value_dim)
    rows = min(limit // (lq * lk), (view_limit - 1) // per_row_view)
    if rows >= 1:
        return SdpaSplit(rows, lq if not causal or lq * lk < view_limit else (view_limit - 1) // lk)
    block = min(limit // lk, (view_limit - 1) // max(d, value_dim))
    return SdpaSplit(1, min(block, (view_limit - 1) // lk) if causal else block)


def pieces(batch: int, heads: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(batch slice, head slice) pieces of at most `rows` rows of batch*heads, in order."""
    if rows >= heads:
        texts = rows // heads
        for start in range(0, batch, texts):
            yield slice(start, min(batch, start + texts)), slice(None)
        return
    for text in range(batch):
        for start in range(0, heads, rows):
            yield slice(text, text + 1), slice(start, min(heads, start + rows))


def _mask_piece(mask: Any, texts: slice, heads: slice, batch: int, num_heads: int, queries: slice) -> Any:
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        return mask
    rows = mask[..., queries, :] if mask.shape[-2] > 1 else mask  # a (.., 1, Lk) mask broadcasts
    if mask.dim() == 2:
        return rows
    if mask.dim() == 3:  # (H or 1, Lq, Lk), broadcast over the batch
        return rows[heads] if mask.shape[0] == num_heads else rows
    rows = rows[texts] if mask.shape[0] == batch else rows
    return rows[:, heads] if mask.shape[1] == num_heads else rows


def run_sdpa_chunked(proceed: Callable[..., torch.Tensor], args: tuple, kwargs: dict, split: SdpaSplit,
                     copy: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention over pieces of at most `split.rows` (batch, head) rows and
    `split.block` query rows, written into one output. Queries, keys and values are (B, H, L, D) (4-D,
    as transformers passes them); grouped key/value heads are read, never copied per query head."""
    query, key, value = sdpa_operands(args, kwargs)
    batch, heads, lq = query.shape[0], query.shape[1], query.shape[2]
    groups = heads // key.shape[1]
    rows = split.rows if groups == 1 else (max(split.rows // groups, 1) * groups if split.rows >= groups else 1)
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    rest = dict(zip(names, args[3:])) | {k: v for k, v in kwargs.items() if k not in ("query", "key", "value")}
    mask, causal = rest.pop("attn_mask", None), rest.pop("is_causal", False)
    if rows < groups:
        rest.pop("enable_gqa", None)  # one query head and its own key/value head a piece
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # (B, H, Lq, Dv)
    for texts, head in pieces(batch, heads, rows):
        kv = head if groups == 1 else _kv_heads(head, groups, heads)
        for start in range(0, lq, split.block):
            queries = slice(start, min(lq, start + split.block))
            q, k, v = (_piece(x[texts][:, h], copy) for x, h in ((query, head), (key, kv), (value, kv)))
            piece_mask = _mask_piece(mask, texts, head, batch, heads, queries)
            if causal:  # rows `queries` of tril(ones(Lq, Lk)): torch's top-left causal mask, at this offset
                piece_mask = torch.ones(queries.stop - start, key.shape[2], dtype=torch.bool,
                                        device=query.device).tril(diagonal=start)
            out[texts, head, queries] = proceed(_piece(q[:, :, queries], copy), k, v, piece_mask, **rest)
    return out


def _kv_heads(head: slice, groups: int, heads: int) -> slice:
    """The key/value heads of a piece of query heads: whole groups, or the one head a single query reads."""
    start, stop = head.start or 0, heads if head.stop is None else head.stop
    return slice(start // groups, (stop - 1) // groups + 1)


def cat_in_place(tensors: Any, dim: int = 0, most: int | None = None) -> torch.Tensor:
    """torch.cat computed by copying each piece into a preallocated output (no cat kernel); with `most`,
    each copy in blocks of at most `most` elements along `dim` (a 1-D input past the per-dimension limit
    is copied in pieces too)."""
    tensors = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]  # cat's legacy empty rule
    first = tensors[0]
    dim = dim % first.dim()
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = first.new_empty(shape, dtype=torch.result_type(*tensors) if len(tensors) > 1 else first.dtype)
    offset = 0
    for t in tensors:
        per = max(1, t.numel() // max(t.shape[dim], 1))  # elements of one index along dim
        step = t.shape[dim] if most is None else max(1, most // per)
        for start in range(0, t.shape[dim], step):
            size = min(step, t.shape[dim] - start)
            out.narrow(dim, offset + start, size).copy_(t.narrow(dim, start, size))
        offset += t.shape[dim]
    return out


def entry_bound(name: str, args: tuple, kwargs: dict) -> float:
    """The largest element count that decides whether an entry-point call could meet any rule: every
    tensor's storage extent, and the logical operands and output of the matrix product (broadcast
    batch). On the guard's hot path: plain arithmetic, no pytree, no broadcast_shapes."""
    if kwargs or name in ("cat", "einsum"):
        tensors = [x for x in flat_arguments(args, kwargs) if isinstance(x, torch.Tensor)]
    else:
        tensors = [x for x in args if isinstance(x, torch.Tensor)]
    bound = max(map(_extent, tensors), default=0)
    if name == "cat":
        return max(bound, sum(t.numel() for t in tensors))
    if name == "einsum" or len(tensors) < 2:
        return math.inf  # its bmm operands are not known here: always look closer
    if name == "linear":
        x, w = tensors[0], tensors[1]
        return max(bound, x.numel() // max(x.shape[-1], 1) * w.shape[0])
    a, b = tensors[-2], tensors[-1]  # the two matrix operands (baddbmm/addmm: after the input)
    sa, sb = a.shape, b.shape
    m, k = (sa[-2], sa[-1]) if len(sa) > 1 else (1, sa[-1])
    n = sb[-1] if len(sb) > 1 else 1
    batch = 1
    for x, y in itertools.zip_longest(reversed(sa[:-2]), reversed(sb[:-2]), fillvalue=1):
        batch *= max(x, y)
    return max(bound, batch * max(m * k, k * n, m * n))


def flat_arguments(args: tuple, kwargs: dict) -> Iterator[Any]:
    """Positional and keyword arguments, lists and tuples opened one level (cat, einsum); not `out`."""
    for arg in (*args, *(v for k, v in kwargs.items() if k != "out")):
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg


def _extent(t: torch.Tensor) -> int:
    # The rules read a slice's storage extent (offset + numel: exact for dense views) or a view's
    # numel; neither exceeds this.
    return t.storage_offset() + t.numel()


def run_with_backward_under(mode: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` under the dispatch `mode`, and its backward pass under `mode` too (autograd
    runs backward from C++, past every Python entry point): a nested graph whose gradients are
    taken under the mode."""
    leaves, spec = tree_flatten((args, kwargs))
    grad_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]

    def inner(*grad_leaves: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, tensor in zip(grad_at, grad_leaves):
            filled[i] = tensor
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return fn(*call_args, **call_kwargs)

    return _UnderMode.apply(mode, inner, *[leaves[i] for i in grad_at])


class _UnderMode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mode, inner, *inputs):
        detached = [x.detach().requires_grad_() for x in inputs]
        with torch.enable_grad(), mode:
            out = inner(*detached)
        ctx.mode, ctx.inputs, ctx.out = mode, detached, out
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        with ctx.mode:
            grads = torch.autograd.grad(ctx.out, ctx.inputs, grad, allow_unused=True)
        del ctx.out, ctx.inputs
        return (None, None, *grads)
