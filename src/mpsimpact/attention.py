"""`mps_safe_eager`: eager attention computed in batch chunks that never cross MPS's index limits,
registered with transformers' AttentionInterface, so a model opts in without a dispatch mode."""

from __future__ import annotations

import torch

from mpsimpact.modes.base import active_emulator
from mpsimpact.modes.chunking import pieces
from mpsimpact.engine.faults import MPS_INDEX_BITS, TensorSpec, largest_safe_batch

NAME = "mps_safe_eager"


def _index_bits() -> int:
    active = active_emulator()
    return active.index_bits if active is not None and active.plan is None else MPS_INDEX_BITS


def safe_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """Rows of batch*heads per chunk such that Q K^T and P V of a chunk are "ok" under the fault rules.

    Chunks are slices, hence views, so every operand is held below VIEW_LIMIT. Fewer rows than
    heads means one text is split over its heads (long sequences).
    """
    batch, heads, length, dim = query.shape
    spec, rows, k_len, bits = TensorSpec.contiguous, batch * heads, key.shape[2], _index_bits()
    scores = largest_safe_batch(spec((rows, length, dim)), spec((rows, dim, k_len)), index_bits=bits,
                                as_slices=True)
    output = largest_safe_batch(spec((rows, length, k_len)), spec((rows, k_len, value.shape[-1])),
                                index_bits=bits, as_slices=True)
    return min(scores, output)


def mps_safe_eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """Eager attention (as transformers' `eager_attention_forward`) over safe chunks of texts, or of
    one text's heads when a whole text is too big.

    Returns (attn_output (B, L, H, D), None): attention weights are not kept, since the full
    weights tensor is the very thing that crosses the limit.
    """
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    batch, heads = query.shape[0], query.shape[1]
    out = query.new_empty(batch, query.shape[2], heads, value.shape[-1])  # (B, L, H, D)
    for texts, head in pieces(batch, heads, safe_rows(query, key, value)):
        q, k = query[texts][:, head], key[texts][:, head]  # (b, h, L, D), (b, h, Lk, D)
        scores = torch.matmul(q, k.transpose(2, 3)) * scaling  # (b, h, L, Lk)
        if attention_mask is not None:
            mask = attention_mask[texts] if attention_mask.shape[0] == batch else attention_mask
            scores = scores + (mask[:, head] if mask.shape[1] == heads else mask)
        probs = torch.nn.functional.softmax(scores, dim=-1)
        probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
        # Written into place: torch.cat above 2**31 elements is itself wrong on MPS 2.13.0.
        out[texts, :, head] = torch.matmul(probs, value[texts][:, head]).transpose(1, 2)  # (b, L, h, D)
    return out, None


def register() -> str:
    """Registers `mps_safe_eager` with transformers; returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, mps_safe_eager_attention)
    AttentionMaskInterface.register(NAME, eager_mask)  # additive float masks, as eager expects
    return NAME
