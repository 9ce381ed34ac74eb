"""From a traced fault plan to what a user cares about: which texts go wrong, where the run stops,
the largest safe batch, and how much memory a real run needs. `run` and `plan` both use it, so
their predictions cannot disagree."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mpsimpact.calls import CallRecord
from mpsimpact.tracer import FaultPlan, trace_module


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the plan predicts for one batch of `batch` texts with `heads` attention heads."""

    batch: int
    heads: int
    first_corrupted_text: int | None
    first_corrupted_head: int | None
    stop: CallRecord | None
    silent: tuple[CallRecord, ...]

    @property
    def corrupted_count(self) -> int:
        if self.stop is not None or self.first_corrupted_text is None:
            return 0
        return self.batch - self.first_corrupted_text

    @property
    def is_clean(self) -> bool:
        return self.stop is None and not self.silent

    def to_json(self) -> dict[str, Any]:
        return {
            "first_corrupted_text": self.first_corrupted_text,
            "first_corrupted_head": self.first_corrupted_head,
            "corrupted_count": self.corrupted_count,
            "corrupted_fraction": self.corrupted_count / self.batch,
            "stops": None if self.stop is None else {"call": self.stop.to_json(), "kind": self.stop.fault.kind, "message": self.stop.fault.message},
            "silent_faults": [call.to_json() for call in self.silent],
        }


def predict(plan: FaultPlan, batch: int, heads: int, phase: str = "forward") -> Prediction:
    """Translates a plan's faults into texts: a bmm over batch*heads rows wrong from row j
    corrupts texts j // heads onwards (attention mixes tokens within a text only)."""
    calls = [c for c in plan.calls if c.phase == phase or phase == "all"]
    stop = next((c for c in calls if c.fault.kind in ("error", "abort")), None)
    silent = tuple(c for c in calls if c.fault.is_silent and (stop is None or c.index < stop.index))
    rows = [_first_bad_text(c, batch, heads) for c in silent]
    first = min(rows, default=None, key=lambda r: r[0] * heads + r[1])
    return Prediction(batch, heads, first[0] if first else None, first[1] if first else None, stop, silent)


def _first_bad_text(call: CallRecord, batch: int, heads: int) -> tuple[int, int]:
    rows = call.a.shape[0]
    first = call.fault.first_bad_batch or 0
    if rows == batch * heads:
        return divmod(first, heads)
    per_text = max(rows // batch, 1)
    return first // per_text, 0


def trace_classifier(meta_module: torch.nn.Module, batch: int, length: int, *, backward: bool = False, index_bits: int = 32) -> FaultPlan:
    """Traces a classifier (built on meta) on a batch of `batch` texts of `length` tokens."""
    ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
    return trace_module(meta_module, {"input_ids": ids}, backward=backward, index_bits=index_bits)


def estimate_peak_bytes(config: Any, batch: int, length: int, dtype_bytes: int = 4) -> int:
    """Peak memory of one eager forward pass (inference): parameters, the live attention tensors
    of one layer (scores, probabilities, the additive mask), and the feed-forward activations."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    inter = getattr(config, "intermediate_size", 4 * hidden)
    params = (config.vocab_size + length) * hidden + config.num_hidden_layers * (4 * hidden * hidden + 2 * hidden * inter)
    attention = 3 * batch * heads * length * length + batch * length * length
    activations = batch * length * (6 * hidden + 2 * inter)
    return dtype_bytes * (params + attention + activations)
