"""Splitting a call that would fault on MPS into pieces that do not: bmm/mm along the leading dim,
SDPA over batch and heads, cat by copying into place. Each result equals the unsplit correct one.
Also: running a call with its backward pass under a dispatch mode (for the guard's big calls)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpsimpact.modes.base import MATMUL_OPS, sdpa_operands
from mpsimpact.engine.faults import limits


def _piece(x: torch.Tensor, copy: bool) -> torch.Tensor:
    # A slice keeps its storage offset; releases that count it (2.5.1 .. 2.9.1) need a fresh copy.
    return x.clone(memory_format=torch.contiguous_format) if copy and x.storage_offset() else x


def run_chunked(func, family: str, args: tuple, kwargs: dict, chunk: int, copy: bool = False) -> torch.Tensor:
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


def sdpa_chunk(query_shape: tuple[int, ...], key_shape: tuple[int, ...], value_dim: int,
               index_bits: int) -> int:
    """Rows of batch*heads per piece such that a piece's scores stay at or below LIMIT and its
    operands (slices, so views) below VIEW_LIMIT on every release."""
    limit, view_limit = limits(index_bits)
    lq, d, lk = query_shape[-2], query_shape[-1], key_shape[-2]
    per_row_view = max(lq * d, lk * d, lk * value_dim, lq * value_dim)
    return max(1, min(limit // (lq * lk), (view_limit - 1) // per_row_view))


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


def _mask_piece(mask: Any, texts: slice, heads: slice, batch: int, num_heads: int) -> Any:
    if not isinstance(mask, torch.Tensor) or mask.dim() < 3:
        return mask
    if mask.dim() == 3:  # (H or 1, Lq, Lk), broadcast over the batch
        return mask[heads] if mask.shape[0] == num_heads else mask
    mask = mask[texts] if mask.shape[0] == batch else mask
    return mask[:, heads] if mask.shape[1] == num_heads else mask


def run_sdpa_chunked(proceed: Callable[..., torch.Tensor], args: tuple, kwargs: dict, rows: int,
                     copy: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention over pieces of at most `rows` (batch, head) rows, written into one
    output. Queries, keys and values are (B, H, L, D) (4-D, as transformers passes them)."""
    query, key, value = sdpa_operands(args, kwargs)
    batch, heads = query.shape[0], query.shape[1]
    if key.shape[1] != heads:
        rows = max(rows, heads)  # grouped-query attention: split over the batch only
    rest = {k: v for k, v in kwargs.items() if k not in ("query", "key", "value", "attn_mask")}
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))  # (B, H, Lq, Dv)
    for texts, head in pieces(batch, heads, rows):
        kv = head if key.shape[1] == heads else slice(None)
        q, k, v = (_piece(x[texts][:, h], copy) for x, h in ((query, head), (key, kv), (value, kv)))
        out[texts, head] = proceed(q, k, v, _mask_piece(mask, texts, head, batch, heads), *args[4:], **rest)
    return out


def cat_in_place(tensors: Any, dim: int = 0) -> torch.Tensor:
    """torch.cat computed by copying each piece into a preallocated output (no cat kernel)."""
    tensors = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]  # cat's legacy empty rule
    first = tensors[0]
    dim = dim % first.dim()
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = first.new_empty(shape, dtype=torch.result_type(*tensors) if len(tensors) > 1 else first.dtype)
    offset = 0
    for t in tensors:
        out.narrow(dim, offset, t.shape[dim]).copy_(t)
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
