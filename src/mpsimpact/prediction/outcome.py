"""From a traced fault plan to what a user cares about: which texts go wrong, where the run stops,
the largest safe batch, and how much memory a real run needs. `run` and `plan` both use it, so
their predictions cannot disagree."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mpsimpact.modes.base import CallRecord, classify_call
from mpsimpact.engine.faults import Profile
from mpsimpact.modes.tracer import FaultPlan, trace_module


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
    def uncharacterised(self) -> tuple[CallRecord, ...]:
        """Silent faults whose wrong values (and so which texts) nobody characterised."""
        return tuple(c for c in self.silent if c.fault.kind == "wrong_other")

    @property
    def is_clean(self) -> bool:
        return self.stop is None and not self.silent

    @property
    def outcome(self) -> str:
        """One word: clean, wrong (texts known), wrong_other (not characterised), error or abort."""
        if self.stop is not None:
            return self.stop.fault.kind
        if self.first_corrupted_text is not None:
            return "wrong"
        return "wrong_other" if self.uncharacterised else "clean"

    def describe(self) -> str:
        """The outcome in words, for tables and slides."""
        if self.stop is not None:
            what = "process abort" if self.stop.fault.kind == "abort" else f"error: {self.stop.fault.message}"
            return f"{what} (at {self.stop.describe()}, {self.stop.phase})"
        if self.first_corrupted_text is not None:
            return f"{self.corrupted_count} texts wrong from text {self.first_corrupted_text}"
        if self.uncharacterised:
            return "wrong (values and texts not characterised)"
        return "clean"

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "first_corrupted_text": self.first_corrupted_text,
            "first_corrupted_head": self.first_corrupted_head,
            "corrupted_count": self.corrupted_count,
            "corrupted_fraction": self.corrupted_count / self.batch,
            "uncharacterised_faults": len(self.uncharacterised),
            "stops": None if self.stop is None else {"call": self.stop.to_json(), "kind": self.stop.fault.kind, "message": self.stop.fault.message},
            "silent_faults": [call.to_json() for call in self.silent],
        }


def predict(plan: FaultPlan, batch: int, heads: int, phase: str = "forward") -> Prediction:
    """Translates a plan's faults into texts: a bmm over batch*heads rows wrong from row j
    corrupts texts j // heads onwards (attention mixes tokens within a text only)."""
    calls = [c for c in plan.calls if c.phase == phase or phase == "all"]
    stop = next((c for c in calls if c.fault.is_stop), None)
    silent = tuple(c for c in calls if c.fault.is_silent and (stop is None or c.index < stop.index))
    rows = [_first_bad_text(c, batch, heads) for c in silent if c.fault.first_bad_batch is not None]
    first = min(rows, default=None, key=lambda r: r[0] * heads + r[1])
    return Prediction(batch, heads, first[0] if first else None, first[1] if first else None, stop, silent)


def _first_bad_text(call: CallRecord, batch: int, heads: int) -> tuple[int, int]:
    rows = call.a.shape[0]
    first = call.fault.first_bad_batch or 0
    if rows == batch * heads:
        return divmod(first, heads)
    per_text = max(rows // batch, 1)
    return first // per_text, 0


def trace_classifier(meta_module: torch.nn.Module, batch: int, length: int, *, backward: bool = False, index_bits: int = 32,
                     profile: Profile = None) -> FaultPlan:
    """Traces a classifier (built on meta) on a batch of `batch` texts of `length` tokens."""
    ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
    return trace_module(meta_module, {"input_ids": ids}, backward=backward, index_bits=index_bits, profile=profile)


from mpsimpact.prediction.memory import estimate_peak_bytes  # noqa: F401


@dataclasses.dataclass(frozen=True)
class PerTextCall:
    """A call traced at two texts, with which operands grow with the batch (to rescale it).

    Two, not one: at one text torch.matmul can fold a transposed view without copying, so its
    layout differs from every larger batch.
    """

    call: CallRecord
    a_scales: bool
    b_scales: bool

    def at(self, batch: int) -> tuple[Any, Any]:
        return _scaled(self.call.a, batch, self.a_scales), _scaled(self.call.b, batch, self.b_scales)


def _scaled(spec, batch: int, scales: bool):
    # Strides of dims > 0 and the batch stride do not depend on the batch size (batch-major).
    if not scales:
        return spec
    return dataclasses.replace(spec, shape=(spec.shape[0] // TRACE_TEXTS * batch, *spec.shape[1:]))


TRACE_TEXTS = 2


def per_text_calls(meta_module: torch.nn.Module, length: int, *, backward: bool = False) -> list[PerTextCall]:
    """Traces at 2 and 4 texts; an operand scales when its leading dim doubles. Every call of the
    trace is kept (SDPA and its math path): `plan_at` picks those a release makes."""
    two = trace_classifier(meta_module, TRACE_TEXTS, length, backward=backward)
    four = trace_classifier(meta_module, 2 * TRACE_TEXTS, length, backward=backward)
    return [
        PerTextCall(c2, c4.a.shape[0] == 2 * c2.a.shape[0], c4.b.shape[0] == 2 * c2.b.shape[0])
        for c2, c4 in zip(two.trace, four.trace)
    ]


def is_safe(calls: list[PerTextCall], batch: int, index_bits: int = 32, profile: Profile = None) -> bool:
    """Whether every call MPS makes is "ok" at `batch` texts (pure arithmetic on rescaled shapes)."""
    return all(call.fault.is_ok for call in plan_at(calls, batch, index_bits, profile).calls)


def largest_safe_batch(calls: list[PerTextCall], heads: int, index_bits: int = 32, ceiling: int = 1 << 24,
                       profile: Profile = None) -> int:
    """The largest batch B such that every batch up to B is safe. The rules change outcome only
    where a numel crosses 2**(bits-1) or 2**bits, or a wrap start enters the batch, so only those
    candidate sizes are checked."""
    limits_ = (1 << (index_bits - 1), 1 << index_bits)
    candidates = set()
    for p in calls:
        a, b = p.at(1)  # per-text shapes (only used for element counts)
        if p.call.family == "sdpa":
            out = a.numel // a.shape[-1] * b.shape[-2]  # score elements
        else:
            out = a.shape[0] * b.shape[-1] * (a.shape[-2] if p.call.family == "bmm" else 1)
        for per_text in (a.numel if p.a_scales else 0, b.numel if p.b_scales else 0, out):
            for limit in limits_:
                if per_text:
                    candidates.update({limit // per_text, limit // per_text + 1, -(-limit // per_text)})
        if p.call.family == "bmm":  # where the first wrapped row enters the batch
            for spec in (a, b):
                candidates.add(-(-limits_[1] // spec.per_batch) // a.shape[0] + 1)
    for batch in sorted(c for c in candidates if 1 <= c <= ceiling):
        if not is_safe(calls, batch, index_bits, profile):
            return batch - 1
    return ceiling


def plan_at(calls: list[PerTextCall], batch: int, index_bits: int = 32, profile: Profile = None) -> FaultPlan:
    """The fault plan at `batch` texts under a release, rebuilt from per-text calls by arithmetic alone."""
    records = []
    for p in calls:
        a, b = p.at(batch)
        records.append(dataclasses.replace(p.call, a=a, b=b, fault=classify_call(p.call.family, a, b, index_bits, profile)))
    return FaultPlan.from_trace(tuple(records), index_bits, profile)
