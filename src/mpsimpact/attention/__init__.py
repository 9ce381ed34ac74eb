"""`mps_safe_eager`: eager attention computed in pieces that never cross MPS's index limits (samples,
key/value heads, then blocks of query rows at long context) and stay within a memory budget (blocks of
keys with an online softmax where one row of scores would not fit), registered with transformers'
AttentionInterface, so any model that uses it opts in without a dispatch mode."""

from __future__ import annotations

import functools

import torch

from mpsimpact.modes.budget import budget_scores
from mpsimpact.engine.faults import limits
from mpsimpact.errors import OversizedOpError
from mpsimpact.attention.lazy_mask import LazyEagerMask, lazy_eager_mask
from mpsimpact.modes.chunking import Blocks, attention_blocks, batch_blocks, emulated_index_bits

NAME = "mps_safe_eager"


def safe_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Rows of batch*heads (query heads) per piece when whole query rows fit; 1 with query blocks."""
    blocks = _blocks_of(query, key, value)
    if blocks is None:
        return 0
    return blocks.rows * (query.shape[1] // key.shape[1]) if blocks.block == query.shape[2] else 1


def _blocks_of(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Blocks | None:
    batch, heads, length, dim = query.shape
    return attention_blocks(batch, key.shape[1], heads // key.shape[1], length, key.shape[2], dim,
                            value.shape[-1], scores=budget_scores(query))


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
    product. Causal and sliding-window masks come in `attention_mask` (transformers' eager mask, or
    the lazy one `register` asks for, made per block of query rows: Note [Lazy eager mask]) and are
    sliced like the queries. Pieces also stay within the memory budget (Note [Attention memory
    budget]): where one query row over all keys would not fit, over blocks of keys with an online
    softmax (Note [Online softmax over key blocks]).

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
    if attention_mask is not None and not isinstance(attention_mask, LazyEagerMask):
        attention_mask = attention_mask[:, :, :, :keys]
    out = query.new_empty(batch, length, heads, value.shape[-1])  # (B, L, H, Dv)
    piece = _piece if blocks.key_block is None else functools.partial(_online_piece, key_block=blocks.key_block)
    for start in range(0, length, blocks.block):  # rows outermost: a lazy mask makes each block's rows once
        rows = slice(start, min(length, start + blocks.block))
        for texts, kv in batch_blocks((batch, kv_heads), blocks.rows):
            heads_of_kv = slice((kv.start or 0) * groups, (kv_heads if kv.stop is None else kv.stop) * groups)
            out[texts, rows, heads_of_kv] = piece(module, query, key, value, attention_mask, scaling, dropout,
                                                  texts, kv, rows, heads_of_kv)
    return out, None


def _grouped_query(query, groups, texts, rows, heads) -> torch.Tensor:
    """The piece's queries, each key/value head's G query heads as G*r rows (a small copy)."""
    q = query[texts, heads, rows]  # (b, h, r, D)
    b, h, r, d = q.shape
    return q.reshape(b, h // groups, groups * r, d)  # (b, n, G*r, D)


def _mask_part(mask, batch, keys, texts, rows, heads, n, groups) -> torch.Tensor | None:
    """The piece's slice of the additive mask, shaped to add to scores viewed as (b, n, G, r, Lk)."""
    if isinstance(mask, LazyEagerMask):  # this piece's rows only; see Note [Lazy eager mask]
        mask = mask.rows(rows.start, rows.stop, keys)
        rows = slice(None)
    if mask is None:
        return None
    part = mask[texts] if mask.shape[0] == batch else mask
    part = part[:, :, rows] if part.shape[2] > 1 else part
    if part.shape[1] > 1:  # a mask per query head: this piece's heads, grouped like the scores
        return part[:, heads].reshape(part.shape[0], n, groups, *part.shape[2:])
    return part.unsqueeze(1)


def _piece(module, query, key, value, mask, scaling, dropout, texts, kv, rows, heads) -> torch.Tensor:
    """One piece's output (b, r, h, Dv): query rows `rows` of query heads `heads` (those of `kv`)."""
    groups = query.shape[1] // key.shape[1]
    q = _grouped_query(query, groups, texts, rows, heads)  # (b, n, G*r, D)
    b, n, _, _ = q.shape
    r = rows.stop - rows.start
    k, v = key[texts, kv], value[texts, kv]  # (b, n, Lk, D): views, no copy
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # (b, n, G*r, Lk)
    scores = scores.view(b, n, groups, r, -1)  # (b, n, G, r, Lk)
    part = _mask_part(mask, query.shape[0], key.shape[2], texts, rows, heads, n, groups)
    if part is not None:
        scores = scores + part
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs.view(b, n, groups * r, -1), v)  # (b, n, G*r, Dv)
    return output.view(b, n * groups, r, -1).transpose(1, 2)  # (b, r, h, Dv)


# Note [Online softmax over key blocks]
# Where one query row block's scores over all keys exceed the memory budget, the keys are taken in
# blocks with FlashAttention's recurrence, in float32: a running max m, a running sum l of exp(s - m)
# and an accumulator of exp(s - m) @ V, both rescaled by exp(m_old - m_new) when the max grows; the
# output is acc / l cast to the query dtype. The scores of each block are made exactly as eager makes
# them (product, scale, mask in the query dtype); only the softmax's rounding differs: fp32 agrees with
# eager to ~1e-6 relative, bf16/fp16 to their rounding (eager rounds the probabilities to the query dtype
# before P V; this path keeps them in float32). Dropout is applied to exp(s - m) before P V, which is the
# same as to the normalized probabilities (the normalization is a division per row).


def _online_piece(module, query, key, value, mask, scaling, dropout, texts, kv, rows, heads,
                  key_block: int) -> torch.Tensor:
    """One piece's output (b, r, h, Dv), as `_piece`, over blocks of `key_block` keys.
    See Note [Online softmax over key blocks]."""
    groups = query.shape[1] // key.shape[1]
    q = _grouped_query(query, groups, texts, rows, heads)  # (b, n, G*r, D)
    b, n, gr, _ = q.shape
    k, v = key[texts, kv], value[texts, kv]  # (b, n, Lk, D): views
    part = _mask_part(mask, query.shape[0], key.shape[2], texts, rows, heads, n, groups)
    lowest = torch.finfo(torch.float32).min  # a fully masked block keeps exp(-inf - lowest) = 0
    top = q.new_full((b, n, gr, 1), lowest, dtype=torch.float32)  # running max
    total = q.new_zeros((b, n, gr, 1), dtype=torch.float32)  # running sum of exp(s - top)
    acc = q.new_zeros((b, n, gr, v.shape[-1]), dtype=torch.float32)  # (b, n, G*r, Dv)
    for start in range(0, k.shape[2], key_block):
        cols = slice(start, min(k.shape[2], start + key_block))
        scores = torch.matmul(q, k[:, :, cols].transpose(2, 3)) * scaling  # (b, n, G*r, kb)
        if part is not None:
            scores = (scores.view(b, n, groups, gr // groups, -1) + part[..., cols]).view(b, n, gr, -1)
        scores = scores.float()
        new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True)).clamp(min=lowest)
        weights = torch.exp(scores - new_top)  # (b, n, G*r, kb), float32
        shrink = torch.exp(top - new_top)
        total = total * shrink + weights.sum(dim=-1, keepdim=True)
        weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
        acc = acc * shrink + torch.matmul(weights, v[:, :, cols].float())  # (b, n, G*r, Dv)
        top = new_top
    output = (acc / total).to(query.dtype)  # (b, n, G*r, Dv)
    return output.view(b, n * groups, gr // groups, -1).transpose(1, 2)  # (b, r, h, Dv)


def _mask(**arguments) -> torch.Tensor | LazyEagerMask | None:
    """transformers' eager mask, lazy from LAZY_FROM elements or from the index width's view limit, where
    the whole mask's own creation would cross it (an emulated narrow width)."""
    return lazy_eager_mask(limits(emulated_index_bits())[1], **arguments)


def register() -> str:
    """Registers `mps_safe_eager` with transformers; returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, mps_safe_eager_attention)
    AttentionMaskInterface.register(NAME, _mask)  # eager's additive masks, made by row blocks
    return NAME
