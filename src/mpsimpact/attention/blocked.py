"""`blocked_eager`: eager attention for the demo on a small Mac. It keeps eager's one oversized call,
`matmul(P, V)` of the whole batch with P contiguous (B, H, L, Lk) as eager gives it, so that MPS gets it
wrong exactly as it gets eager's wrong; everything else runs a block of samples at a time. It shows the
fault (`mps_safe_eager`, the room's face, prevents it)."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from mpsimpact.errors import MpsImpactError

NAME = "blocked_eager"
REASON = "the same P V call eager attention makes; scores computed in blocks to fit a smaller Mac"
# Score elements per block of samples: 2**26 (eight blocks' worth of eager's 2**29-element scores at 512
# tokens); the block's scores and softmax (two such tensors at once) stay below the product's own output.
SCORE_BLOCK = 1 << 26

# Note [Blocked layers]
# ~~~~~~~~~~~~~~~~~~~~~
# Only P V needs the whole batch at once. A layer run whole keeps its input, Q, K, V, eager's copy of V and
# the scores beside P (P + 6 hidden-state-sized tensors at P V); `use_blocks` runs each layer over blocks
# of samples instead, in three steps:
#   1. fill: the layer's forward on each block up to its attention call, which writes the block's softmax
#      into P and the block's V into a contiguous (B, H, Lk, Dv) buffer, then raises _Filled: the rest of
#      the layer waits for the product.
#   2. one torch.matmul(P, V) of the whole batch: bmm of (B*H, L, Lk) @ (B*H, Lk, Dv), both contiguous,
#      which is eager's call (eager's matmul copies its transposed V into the same contiguous layout).
#   3. emit: the layer's forward on each block again; its attention call returns the block's rows of the
#      product, and the block's output is written over the block's input, so that the layers (and the
#      caller's embedding output) share one hidden-state buffer.
# At the product P, V, its output and the hidden states are alive: P + 3 (B, L, D) tensors
# (prediction.memory.blocked_peak_bytes). The emit pass computes the block's Q, K and V projections again
# (about a fifth more arithmetic at 512 tokens). It runs only without gradients, one attention call per
# layer, on layers whose samples meet nowhere but in attention (encoders); elsewhere a layer runs whole.
# The padding mask is kept as one (B, 1, 1, Lk) row per sample (`blocked_eager_mask`): eager's
# (B, 1, L, Lk) mask repeats that row for every query and would cost L times more.


def samples_per_block(heads: int, length: int, keys: int | None = None) -> int:
    """Samples whose scores (heads x length x keys each) take about SCORE_BLOCK elements; at least one."""
    return max(1, SCORE_BLOCK // (heads * length * (length if keys is None else keys)))


def _probs(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
           scaling: float, dropout: float) -> torch.Tensor:
    """P of one block as BERT-family eager attention computes it (softmax in the model's dtype)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (b, H, L, Lk)
    if mask is not None:
        scores = scores + mask
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return torch.nn.functional.dropout(probs, p=dropout, training=module.training)


def _rows(mask: torch.Tensor | None, rows: slice, batch: int) -> torch.Tensor | None:
    """The mask of samples `rows`; a mask shared by the batch (first dim 1) as it is."""
    return mask[rows] if mask is not None and mask.shape[0] == batch else mask


def blocked_eager_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """BERT-family eager attention with P filled a block of samples at a time and eager's one
    `matmul(P, V)`. Inside a blocked layer (`use_blocks`) one step of Note [Blocked layers]; else P is
    filled in blocks of this call's own samples.

    Returns (attn_output (B, L, H, Dv), None): the weights are not returned (P is the oversized tensor).
    """
    if key.shape[1] != query.shape[1]:
        raise MpsImpactError(f"{NAME} needs as many key/value heads as query heads ({query.shape[1]}); got "
                             f"{key.shape[1]}.")
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    layer = _LAYER.get()
    if layer is not None:
        return layer.attend(module, query, key, value, attention_mask, scaling, dropout), None
    batch, heads, length, _ = query.shape
    step = samples_per_block(heads, length, key.shape[2])
    probs = query.new_empty(batch, heads, length, key.shape[2])  # P (B, H, L, Lk)
    for start in range(0, batch, step):
        rows = slice(start, start + step)
        probs[rows] = _probs(module, query[rows], key[rows], _rows(attention_mask, rows, batch), scaling, dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None  # eager's P V; (B, L, H, Dv)


class _Filled(Exception):
    """Raised by a fill step's attention call: the rest of the layer waits for the product."""


@dataclasses.dataclass
class _LayerPass:
    """One layer's run over blocks of samples (Note [Blocked layers])."""

    batch: int
    rows: slice | None = None  # the current block of samples
    attended: bool = False  # the current block's attention call came
    probs: torch.Tensor | None = None  # P (B, H, L, Lk)
    values: torch.Tensor | None = None  # V (B, H, Lk, Dv), contiguous
    output: torch.Tensor | None = None  # the product (B, L, H, Dv), once made

    def attend(self, module, query, key, value, mask, scaling: float, dropout: float) -> torch.Tensor:
        if self.attended:
            raise MpsImpactError(f"{NAME} blocks layers with one attention call each; this layer made a "
                                 "second one (cross-attention?). Use eager attention for this model.")
        self.attended = True
        if self.output is not None:
            return self.output[self.rows]
        if self.probs is None:
            self.probs = query.new_empty(self.batch, *query.shape[1:3], key.shape[2])  # (B, H, L, Lk)
            self.values = value.new_empty(self.batch, *value.shape[1:])  # (B, H, Lk, Dv)
        self.probs[self.rows] = _probs(module, query, key, mask, scaling, dropout)
        self.values[self.rows] = value
        raise _Filled

    def multiply(self) -> None:
        """Eager's P V of the whole batch; P and V are let go before the output is transposed."""
        output = torch.matmul(self.probs, self.values)  # (B, H, L, Dv)
        self.probs = self.values = None
        self.output = output.transpose(1, 2).contiguous()  # (B, L, H, Dv), as eager returns it


_LAYER: contextvars.ContextVar[_LayerPass | None] = contextvars.ContextVar("blocked_layer", default=None)


def transformer_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the model's largest ModuleList (its transformer layers)."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len, default=[]))


def use_blocks(model: torch.nn.Module, samples: int | None = None) -> None:
    """Runs each of `model`'s transformer layers over blocks of `samples` samples when its attention is
    `blocked_eager` (Note [Blocked layers]). None: blocks of SCORE_BLOCK scores at each call's length;
    give the number when a run replays a plan traced at another length, so that both make the same calls."""
    heads = next((m.config.num_attention_heads for m in model.modules()
                  if hasattr(getattr(m, "config", None), "num_attention_heads")), None)
    for layer in transformer_layers(model):
        layer.forward = _blocked_forward(type(layer).forward.__get__(layer), samples, heads)


def remove_blocks(model: torch.nn.Module) -> None:
    """Undoes `use_blocks`: every layer runs whole again."""
    for layer in transformer_layers(model):
        layer.__dict__.pop("forward", None)


def _blocked_forward(forward: Callable[..., Any], samples: int | None, heads: int | None) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not _blockable(hidden_states, kwargs) or (samples is None and heads is None):
            return forward(hidden_states, *args, **kwargs)
        batch, length = hidden_states.shape[:2]
        step = samples or samples_per_block(heads, length)
        blocks = [slice(start, start + step) for start in range(0, batch, step)]
        layer = _LayerPass(batch)
        token = _LAYER.set(layer)
        try:
            for rows in blocks:
                _step(layer, rows, forward, hidden_states, args, kwargs)
            layer.multiply()
            for rows in blocks:
                result = _step(layer, rows, forward, hidden_states, args, kwargs)
                hidden_states[rows] = result if isinstance(result, torch.Tensor) else result[0]
        finally:
            _LAYER.reset(token)
        return hidden_states if isinstance(result, torch.Tensor) else (hidden_states, *result[1:])

    return run


def _blockable(hidden_states: Any, kwargs: dict[str, Any]) -> bool:
    """Inference on (B, L, D) hidden states without a cache: the layer's output may overwrite its input."""
    cache = kwargs.get("cache", kwargs.get("past_key_values", kwargs.get("past_key_value")))
    return (isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3 and cache is None
            and not (torch.is_grad_enabled() and hidden_states.requires_grad))


def _step(layer: _LayerPass, rows: slice, forward, hidden_states, args: tuple, kwargs: dict) -> Any:
    """The layer's forward on samples `rows` (every argument with the batch's first dim sliced): a fill
    step (None) until the product is made, then an emit step (the block's output)."""
    layer.rows, layer.attended = rows, False
    batch = hidden_states.shape[0]

    def cut(value: Any) -> Any:
        return value[rows] if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch else value

    try:
        result = forward(hidden_states[rows], *map(cut, args), **{k: cut(v) for k, v in kwargs.items()})
    except _Filled:
        return None
    if not layer.attended:
        raise MpsImpactError(f"A layer run in blocks for {NAME} made no attention call; load the model with "
                             f"attn_implementation='{NAME}' (see mpsimpact.attention.blocked.register).")
    return result


def blocked_eager_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' eager mask, but a bidirectional (encoder) mask as one (B, 1, 1, Lk) row per sample:
    its query rows are all alike, and scores + mask broadcasts the row to the same values."""
    from transformers.masking_utils import bidirectional_mask_function, eager_mask

    if not args and kwargs.get("mask_function") is bidirectional_mask_function:
        kwargs["q_length"] = 1
    return eager_mask(*args, **kwargs)


def register() -> str:
    """Registers `blocked_eager` and its mask with transformers; returns the name to pass as
    attn_implementation. A model loaded with it fills P in blocks; `use_blocks` runs its layers in blocks
    too."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, blocked_eager_attention)
    AttentionMaskInterface.register(NAME, blocked_eager_mask)
    return NAME
