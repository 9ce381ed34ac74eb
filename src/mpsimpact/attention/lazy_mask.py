"""The attention mask mps_safe_eager asks transformers for: transformers' own eager mask, made one block of
query rows at a time when a piece needs it, never as a whole (B, 1, L, Lk) tensor.
See Note [Lazy eager mask]."""

from __future__ import annotations

from typing import Any

import torch

# Note [Lazy eager mask]
# transformers builds eager attention's additive mask as one (B, 1, L, Lk) tensor before the first layer:
# at 64k tokens in bf16 that is 8 GiB, at 16k in fp32 1 GiB, more than the whole of fused SDPA's peak
# and, past 2**32 elements, a faulting op itself. mps_safe_eager registers `lazy_eager_mask` as its mask
# function instead: it keeps the arguments transformers passes (the mask function, the 2-D padding mask,
# offsets, dtype) and each piece calls transformers' `eager_mask` for its own query rows only
# (q_length = rows, q_offset moved by the block's start): the same index-based mask function, so the
# same values as the whole mask's rows. Anything else that reads the mask (a slice, a torch function)
# gets the whole mask, made once on first use. Masks below LAZY_FROM elements are made whole at once, as
# before, so short contexts (and any model code that expects a tensor there) see what eager sees.

LAZY_FROM = 2**24  # B * L * Lk elements: 64 MiB of float32 mask


class LazyEagerMask:
    """transformers' eager mask, (B, 1, L, Lk) in `dtype`, made by blocks of query rows on request."""

    def __init__(self, arguments: dict[str, Any]):
        self.arguments = arguments
        self._whole: torch.Tensor | None = None
        self._last: tuple[tuple[int, int, int | None], torch.Tensor | None] | None = None  # the latest rows made

    @property
    def shape(self) -> torch.Size:
        a = self.arguments
        return torch.Size((a["batch_size"], 1, a["q_length"], a["kv_length"]))

    @property
    def dtype(self) -> torch.dtype:
        return self.arguments.get("dtype", torch.float32)

    @property
    def device(self) -> torch.device:
        return torch.device(self.arguments.get("device", "cpu"))

    def rows(self, start: int, stop: int, keys: int | None = None) -> torch.Tensor | None:
        """Query rows start..stop of the mask over its first `keys` keys (all: None), (B, 1, stop - start,
        keys); None where transformers skips it."""
        from transformers.masking_utils import eager_mask

        if self._last is not None and self._last[0] == (start, stop, keys):
            return self._last[1]  # the pieces of one block of query rows (every sample, key/value head) share it
        a = dict(self.arguments)
        a["q_offset"] = a.get("q_offset", 0) + start
        a["q_length"] = stop - start
        mask = eager_mask(**a)
        mask = mask if mask is None or keys is None else mask[..., :keys]
        self._last = ((start, stop, keys), mask)
        return mask

    def whole(self) -> torch.Tensor | None:
        """The whole mask, as transformers' eager_mask makes it (once)."""
        if self._whole is None:
            self._whole = self.rows(0, self.arguments["q_length"])
        return self._whole

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.whole()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        args = tuple(a.whole() if isinstance(a, LazyEagerMask) else a for a in args)
        return func(*args, **(kwargs or {}))


def lazy_eager_mask(lazy_from: int | None = None, **arguments: Any) -> LazyEagerMask | None:
    """A mask function for transformers' AttentionMaskInterface: `eager_mask`'s arguments, kept (from
    LAZY_FROM elements, or from `lazy_from` where fewer; below, eager_mask's tensor). Bidirectional masks that transformers may skip are
    skipped (None), as eager_mask does."""
    from transformers.masking_utils import eager_mask

    arguments.pop("allow_is_causal_skip", None)
    elements = arguments["batch_size"] * arguments["q_length"] * arguments["kv_length"]
    if elements < min(lazy_from or LAZY_FROM, LAZY_FROM):
        return eager_mask(**arguments)
    if arguments.get("allow_is_bidirectional_skip") and eager_mask(**{**arguments, "q_length": 1}) is None:
        return None
    return LazyEagerMask(arguments)
