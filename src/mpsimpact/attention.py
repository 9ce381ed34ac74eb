"""`mps_safe_eager`: eager attention computed in pieces that never cross MPS's index limits (samples,
key/value heads, then blocks of query rows at long context), registered with transformers'
AttentionInterface, so any model that uses it opts in without a dispatch mode."""

from __future__ import annotations

import dataclasses

import torch

from mpsimpact.engine.faults import MPS_INDEX_BITS, limits
from mpsimpact.errors import OversizedOpError
from mpsimpact.modes.base import active_emulator
from mpsimpact.modes.chunking import pieces

NAME = "mps_safe_eager"


def _index_bits() -> int:
    active = active_emulator()
    return active.index_bits if active is not None and active.plan is None else MPS_INDEX_BITS


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Pieces of one attention call: `rows` of batch * key/value heads a piece (each with its group of
    query heads), over `block` query rows."""

    rows: int
    block: int


def attention_blocks(batch: int, kv_heads: int, groups: int, length: int, keys: int, dim: int,
                     value_dim: int, index_bits: int | None = None) -> Blocks | None:
    """The largest pieces whose two products, Q K^T (n, G*r, D) @ (n, D, Lk) and P V (n, G*r, Lk) @
    (n, Lk, Dv), keep every operand (a slice, so a view) below VIEW_LIMIT and the output at most LIMIT
    on every release: whole query rows where a sample-and-head fits, else blocks of r query rows.
    None when one query row of a group already crosses a limit (keys past VIEW_LIMIT / G)."""
    limit, view_limit = limits(_index_bits() if index_bits is None else index_bits)
    cap = min(limit, view_limit - 1)
    widest = max(keys, dim, value_dim)  # per query row of the folded group: scores, Q and output
    per_row = groups * length * widest
    if max(keys * dim, keys * value_dim) <= cap and per_row <= cap:
        return Blocks(min(batch * kv_heads, cap // per_row), length)
    block = cap // (groups * widest)
    return Blocks(1, block) if block >= 1 and max(keys * dim, keys * value_dim) <= cap else None


def safe_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Rows of batch*heads (query heads) per piece when whole query rows fit; 1 with query blocks."""
    blocks = _blocks_of(query, key, value)
    if blocks is None:
        return 0
    return blocks.rows * (query.shape[1] // key.shape[1]) if blocks.block == query.shape[2] else 1


def _blocks_of(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Blocks | None:
    batch, heads, length, dim = query.shape
    return attention_blocks(batch, key.shape[1], heads // key.shape[1], length, key.shape[2], dim,
                            value.shape[-1])


def mps_safe_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Eager attention (as transformers' `eager_attention_forward`) in pieces of samples and key/value
    heads, and blocks of query rows when one head is too big. Grouped key/value heads are read, never
    copied per query head: the G query heads of a key/value head are stacked as G*r rows of one
    product. Causal and sliding-window masks come in `attention_mask` (transformers' eager mask) and
    are sliced like the queries.

    Returns (attn_output (B, L, H, Dv), None): attention weights are not kept, since the full
    weights tensor is the very thing that crosses the limit.

    Raises:
        OversizedOpError: when no piece is safe (one query row of a group crosses a limit).
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    blocks = _blocks_of(query, key, value)
    if blocks is None:
        raise OversizedOpError(f"mps_safe_eager: {keys} keys x {groups} query heads per key/value head cross "
                               "MPS's index limits even one query row at a time; shorten the sequence.")
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :keys]
    out = query.new_empty(batch, length, heads, value.shape[-1])  # (B, L, H, Dv)
    for texts, kv in pieces(batch, kv_heads, blocks.rows):
        for start in range(0, length, blocks.block):
            rows = slice(start, min(length, start + blocks.block))
            heads_of_kv = slice((kv.start or 0) * groups, (kv_heads if kv.stop is None else kv.stop) * groups)
            out[texts, rows, heads_of_kv] = _piece(module, query, key, value, attention_mask, scaling, dropout,
                                                   texts, kv, rows, heads_of_kv)
    return out, None


def _piece(module, query, key, value, mask, scaling, dropout, texts, kv, rows, heads) -> torch.Tensor:
    """One piece's output (b, r, h, Dv): query rows `rows` of query heads `heads` (those of `kv`)."""
    groups = query.shape[1] // key.shape[1]
    q = query[texts, heads, rows]  # (b, h, r, D)
    b, h, r, d = q.shape
    n = h // groups
    q = q.reshape(b, n, groups * r, d)  # each key/value head's G query heads as G*r rows (a small copy)
    k, v = key[texts, kv], value[texts, kv]  # (b, n, Lk, D): views, no copy
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # (b, n, G*r, Lk)
    scores = scores.view(b, n, groups, r, -1)
    if mask is not None:
        part = mask[texts] if mask.shape[0] == query.shape[0] else mask
        part = part[:, :, rows] if part.shape[2] > 1 else part
        if part.shape[1] > 1:  # a mask per query head: this piece's heads, grouped like the scores
            part = part[:, heads].reshape(part.shape[0], n, groups, *part.shape[2:])
        else:
            part = part.unsqueeze(1)
        scores = scores + part
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs.view(b, n, groups * r, -1), v)  # (b, n, G*r, Dv)
    return output.view(b, h, r, -1).transpose(1, 2)  # (b, r, h, Dv)


def register() -> str:
    """Registers `mps_safe_eager` with transformers; returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, mps_safe_eager_attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # additive float masks, as eager expects
    return NAME
