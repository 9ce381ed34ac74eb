"""How big a run may be: the largest safe batch (calls traced at 2 and 4 samples, rescaled by
arithmetic) and the longest safe sequence length at a batch size (calls traced at three lengths, every
shape, stride and offset fitted as a quadratic in the length, each length decided by arithmetic, the
answer checked by tracing at the boundary; bisection over traces if that fails)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mpsimpact.engine.call import CallRecord, out_elements
from mpsimpact.engine.faults import MPS_INDEX_BITS, limits, TensorSpec
from mpsimpact.engine.fault_plan import FaultPlan, decide, runs_on_mps
from mpsimpact.engine.mac_memory import MacMemory, call_bytes
from mpsimpact.engine.release import FaultProfile
from mpsimpact.errors import UsageError
from mpsimpact.prediction.meta_model import trace_meta
from mpsimpact.prediction.outcome import predict


# (c0, c1, c2, den): the entry at length L is (c0 + c1*L + c2*L*L) / den, exactly.
Fit = tuple[int, int, int, int]
MAX_FIT_LENGTH = 64  # the fit's lengths are n, 2n and a third (see fit_lengths), n at most this


class _Unscalable(ValueError):
    """The traces do not fit quadratics in the length (another structure, or a step in a shape)."""


def _fit(points: list[tuple[int, int]]) -> Fit:
    """The quadratic through three (length, value) points, as integers over one denominator."""
    (x0, y0), (x1, y1), (x2, y2) = points
    d0, d1, d2 = (x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)
    den = d0 * d1 * d2
    w0, w1, w2 = y0 * d1 * d2, y1 * d0 * d2, y2 * d0 * d1  # y_i / d_i, over the common den
    c2 = w0 + w1 + w2
    c1 = -(w0 * (x1 + x2) + w1 * (x0 + x2) + w2 * (x0 + x1))
    c0 = w0 * x1 * x2 + w1 * x0 * x2 + w2 * x0 * x1
    return (c0, c1, c2, den) if den > 0 else (-c0, -c1, -c2, -den)


def _value(fit: Fit, length: int) -> int:
    c0, c1, c2, den = fit
    value, rest = divmod(c0 + c1 * length + c2 * length * length, den)
    if rest:
        raise _Unscalable(f"a traced entry is not a whole number at length {length}")
    return value


def _flat(spec: TensorSpec) -> tuple[int, ...]:
    return (*spec.shape, *spec.stride, spec.storage_offset)


def _unflat(values: list[int], like: TensorSpec) -> TensorSpec:
    """The spec whose `_flat` is `values`, of `like`'s rank and dtype."""
    ndim = len(like.shape)
    return TensorSpec(tuple(values[:ndim]), tuple(values[ndim:2 * ndim]), values[-1], like.dtype)


@dataclasses.dataclass(frozen=True)
class LengthFittedCall:
    """One traced call with each entry of its operands' shapes, strides and offsets fitted in L."""

    call: CallRecord
    a: tuple[Fit, ...]
    b: tuple[Fit, ...]

    def at(self, length: int) -> CallRecord:
        """The call at `length` (its fault not yet decided)."""
        a, b = (_unflat([_value(fit, length) for fit in fits], spec)
                for spec, fits in ((self.call.a, self.a), (self.call.b, self.b)))
        return self.call.resized(a, b)


def fit_calls(plans: list[FaultPlan], lengths: tuple[int, ...]) -> list[LengthFittedCall]:
    """Fits every call of three traces (at `lengths`) entry by entry; raises _Unscalable when the
    traces do not line up call for call."""
    traces = [plan.trace or plan.calls for plan in plans]
    if len({len(trace) for trace in traces}) != 1:
        raise _Unscalable("the number of calls changes with the length")
    fitted = []
    for calls in zip(*traces):
        if len({(c.op, c.phase, c.module, c.within, len(c.a.shape), len(c.b.shape)) for c in calls}) != 1:
            raise _Unscalable("the calls differ between lengths")
        a, b = (tuple(_fit(list(zip(lengths, entries))) for entries in zip(*(_flat(s) for s in specs)))
                for specs in ([c.a for c in calls], [c.b for c in calls]))
        fitted.append(LengthFittedCall(calls[0], a, b))
    return fitted


def _distinct_runs(calls: list[LengthFittedCall], profile: FaultProfile) -> list[LengthFittedCall]:
    """The fitted calls MPS runs under `profile` (FaultPlan.from_trace keeps the same), one per distinct
    op and operand fits: a model's layers repeat their calls, and equal fits give equal calls at any length."""
    distinct = {}
    for fitted in runs_on_mps(calls, profile):
        distinct.setdefault((fitted.call.op, fitted.call.family, fitted.a, fitted.b), fitted)
    return list(distinct.values())


def is_clean(plan: FaultPlan) -> bool:
    """Every call MPS makes computes correctly."""
    return not plan.faults


def _quantities(call: CallRecord) -> tuple[int, ...]:
    """Every element count a rule compares with a limit (see Note [MPS 32-bit index faults]); the last
    two are where a wrap's first bad row enters the batch: first < rows iff limit <= per * (rows - 1)."""
    a, b = call.a, call.b
    wraps = (a.per_batch * (a.shape[0] - 1), b.per_batch * (b.shape[0] - 1)) if call.family == "bmm" else ()
    dims = () if call.is_product else (max(a.shape, default=0), max(b.shape, default=0))  # the per-dim check
    return (a.numel, b.numel, a.extent, b.extent, call.out_numel, *wraps, *dims)


def _first_where(holds: Callable[[int], bool], high: int) -> int | None:
    """The smallest length in 1..high where `holds` (which, once true, stays true as the length grows)."""
    if not holds(high):
        return None
    low, top = 1, high
    while low < top:
        mid = (low + top) // 2
        low, top = (low, mid) if holds(mid) else (mid + 1, top)
    return low


def candidate_lengths(calls: list[LengthFittedCall], high: int,
                      index_bits: int = MPS_INDEX_BITS, mac: MacMemory | None = None) -> list[int]:
    """The lengths where some rule's condition can change: every count reaching 2**(bits-1) or 2**bits
    (>=) or passing it (>), and on `mac` a call's bytes reaching its largest buffer. Between two candidates
    every call's outcome stays the same."""
    limit, view_limit = limits(index_bits)
    found = {1}
    for fitted in {(f.call.family, f.a, f.b): f for f in calls}.values():  # one per distinct call
        for i in range(len(_quantities(fitted.at(high)))):
            found |= {_first_where(lambda n, i=i, b=bound: _quantities(fitted.at(n))[i] >= b, high)
                      for bound in (view_limit, view_limit + 1, limit, limit + 1)}
        if mac is not None:
            found.add(_first_where(lambda n, f=fitted: mac.refuses(call_bytes(f.at(n)), index_bits), high))
    return sorted(found - {None})


@dataclasses.dataclass(frozen=True)
class BoundarySearch:
    """The largest n (a length, or a batch size) such that every n' in 1..n is clean, searched in
    1..high, and how it was found (0: even 1 is not clean)."""

    largest_safe: int | None  # None: not searched (a trace the search needed failed; `basis` says which)
    high: int
    basis: str
    ceiling: bool = False  # `high` is the search's own bound, not the model's: reaching it says "at least"

    @property
    def at_least(self) -> bool:
        """Whether the answer is only a lower bound: every n up to the search's own ceiling is clean."""
        return self.ceiling and self.largest_safe is not None and self.largest_safe >= self.high

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"at_least": self.at_least}


def fit_lengths(high: int, known: int | None = None) -> tuple[int, int, int]:
    """Three lengths to fit at: n, 2n, and `known` (a length traced anyway) or 3n."""
    n = max(1, min(MAX_FIT_LENGTH, high // 3))
    return n, 2 * n, known if known is not None and 2 * n < known <= high else 3 * n


def longest_safe_length(trace_at: Callable[[int], FaultPlan], high: int, index_bits: int, profile: FaultProfile,
                        known: int | None = None, mac: MacMemory | None = None,
                        fits: Callable[[Any, int], bool] | None = None) -> BoundarySearch:
    """Searches 1..high. `trace_at(L)` traces the model at length L (same batch, rules and workload, and decided
    on `mac` where one is given); `known` is a length already traced (reused as a fit point); `fits(calls, L)`:
    whether a run of these calls at length L fits the Mac (prediction.memory; None: no Mac limits it), the answer
    cut to the longest that does.

    Three traces fit every call; the candidate lengths are decided by arithmetic; the boundary found
    is checked by tracing at L and L + 1. If the fit or the check fails, bisection over traces decides
    (assuming that a length is clean whenever a longer one is).
    """
    lengths = fit_lengths(high, known)
    try:
        calls = fit_calls([trace_at(n) for n in lengths], lengths)
    except _Unscalable as error:
        return cut_to_fit(bisect_clean(trace_at, high, f"the calls do not scale as quadratics in the length: {error}"),
                          fits and (lambda n: fits(trace_at(n).calls, n)), "length")
    search = _fitted_search(calls, trace_at, high, index_bits, profile, lengths, mac)
    return cut_to_fit(search, fits and (lambda n: fits(_calls_at_length(calls, trace_at, n), n)), "length")


def _calls_at_length(calls: list[LengthFittedCall], trace_at: Callable[[int], FaultPlan], length: int) -> Any:
    """The calls at `length` by arithmetic on the fitted ones, or traced where the fit does not hold there."""
    try:
        return [f.at(length) for f in calls]
    except _Unscalable:
        return trace_at(length).calls


def cut_to_fit(search: BoundarySearch, fits_at: Callable[[int], bool] | None, what: str) -> BoundarySearch:
    """`search` (free of faults up to its answer) cut to the largest n whose run fits the Mac (`fits_at(n)`, which
    once false stays false as n grows; None: nothing limits it): a safe size is free of faults and fits (Note
    [What fits a Mac] in prediction/memory.py)."""
    found = search.largest_safe
    if fits_at is None or not found or fits_at(found):
        return search
    largest = (_first_where(lambda n: not fits_at(n), found) or found + 1) - 1
    return dataclasses.replace(search, largest_safe=largest, ceiling=False, basis=(
        f"{search.basis}; cut to the {what} whose estimated peak the Mac still holds, {largest}"))


def _fitted_search(calls: list[LengthFittedCall], trace_at: Callable[[int], FaultPlan], high: int, index_bits: int,
                   profile: FaultProfile, lengths: tuple[int, int, int], mac: MacMemory | None) -> BoundarySearch:
    """The longest clean length by arithmetic on the fitted calls, checked by tracing at the boundary (bisection
    over traces where the check fails)."""
    try:
        kept = _distinct_runs(calls, profile)  # whether each length is clean, by arithmetic on them alone
        first_bad = next((L for L in candidate_lengths(calls, high, index_bits, mac)
                          if any(not decide(f.at(L), index_bits, profile, mac).is_ok for f in kept)), None)
    except _Unscalable as error:
        return bisect_clean(trace_at, high, f"the calls do not scale as quadratics in the length: {error}")
    answer = high if first_bad is None else first_bad - 1
    checks = [L for L in (answer, answer + 1) if 1 <= L <= high]
    for length in checks:
        try:  # the fault plan at `length`, rebuilt from the fitted calls by arithmetic alone (as `plan_at`)
            expected = FaultPlan.from_trace(tuple(f.at(length) for f in calls), index_bits, profile, mac)
        except _Unscalable:
            return bisect_clean(trace_at, high, f"the fit does not hold at length {length}")
        traced = trace_at(length)
        if plan_signature(traced) != plan_signature(expected) or is_clean(expected) != (length == answer):
            return bisect_clean(trace_at, high, f"a trace at length {length} differs from the fit")
    basis = (f"arithmetic on calls traced at lengths {', '.join(map(str, lengths))} (each shape, stride and "
             f"offset a quadratic in the length), checked by tracing at {' and '.join(map(str, checks))}")
    return BoundarySearch(answer, high, basis)


def plan_signature(plan: FaultPlan) -> list[tuple[Any, ...]]:
    """What two plans must share to be the same: each call's op, operands and fault."""
    return [(c.op, c.a, c.b, c.fault) for c in plan.calls]


def bisect_clean(trace_at: Callable[[int], FaultPlan], high: int, why: str) -> BoundarySearch:
    """Bisection over traces in 1..high, assuming n is clean whenever a larger n is; `why` says why
    nothing cheaper was possible."""
    if is_clean(trace_at(high)):
        return BoundarySearch(high, high, f"a trace at {high}, the top of the range, is clean ({why})")
    good, bad, traces = 0, high, 1
    while bad - good > 1:
        mid = (good + bad) // 2
        traces += 1
        good, bad = (mid, bad) if is_clean(trace_at(mid)) else (good, mid)
    return BoundarySearch(good, high,
                          f"bisection over {traces} traces, assuming smaller is never worse ({why})")


@dataclasses.dataclass(frozen=True)
class PerTextCall:
    """A call traced at 2 and 4 texts, each entry of its operands' shapes, strides and offsets linear in the
    batch: constant, or growing with it (a leading batch dim, the B*L columns of a weight gradient's
    transposed activations, the stride that steps over them).

    Two, not one: at one text torch.matmul can fold a transposed view without copying, so its
    layout differs from every larger batch.
    """

    call: CallRecord
    a4: TensorSpec  # the operands at 2 * TRACE_TEXTS texts
    b4: TensorSpec

    @property
    def a_scales(self) -> bool:
        return self.a4 != self.call.a

    @property
    def b_scales(self) -> bool:
        return self.b4 != self.call.b

    def at(self, batch: int) -> tuple[Any, Any]:
        return _scaled(self.call.a, self.a4, batch), _scaled(self.call.b, self.b4, batch)

    def bytes_at(self, batch: int, float_bytes: int | None = None) -> int:
        """The call's largest allocation at `batch` texts (engine.mac_memory.call_bytes; `float_bytes`: its
        floating tensors counted at that size)."""
        a, b = self.at(batch)
        return call_bytes(self.call.evolve(a=a, b=b), float_bytes)


def _scaled(two: TensorSpec, four: TensorSpec, batch: int) -> TensorSpec:
    if two == four:
        return two
    return _unflat([x + (y - x) // TRACE_TEXTS * (batch - TRACE_TEXTS) for x, y in zip(_flat(two), _flat(four))],
                   two)


TRACE_TEXTS = 2


def per_text_calls(meta_module: Any, length: int, *, backward: bool = False, allocations: bool = False,
                   profile: FaultProfile | None = None) -> list[PerTextCall]:
    """Traces at 2 and 4 texts, whose calls give each operand entry's growth per text. Every call of the
    trace is kept (SDPA and its math path, and every op but views, whatever its size: the same calls at
    every batch): `plan_at` picks those a release makes (`profile` decides the traces: None, the installed)."""
    two, four = (trace_meta(meta_module, texts, length, backward=backward, every_op=True, allocations=allocations,
                            profile=profile) for texts in (TRACE_TEXTS, 2 * TRACE_TEXTS))
    return per_text(two, four)


class PerTextTraces:
    """`per_text_calls` of one meta module at any length, each length traced once, when first asked: the
    lengths plan, --quick and the silent sizes look at (prediction.demo_size)."""

    def __init__(self, meta_module: Any, *, backward: bool = False, allocations: bool = False,
                 profile: FaultProfile | None = None) -> None:
        self.meta_module, self.profile = meta_module, profile
        self.options = {"backward": backward, "allocations": allocations, "profile": profile}
        self._traced: dict[int, list[PerTextCall]] = {}

    def __call__(self, length: int) -> list[PerTextCall]:
        if length not in self._traced:
            self._traced[length] = per_text_calls(self.meta_module, length, **self.options)
        return self._traced[length]


def per_text(two: FaultPlan, four: FaultPlan) -> list[PerTextCall]:
    """The calls of traces at 2 and 4 texts, each with its operands at both (to rescale it).

    Raises:
        UsageError: the traces cannot be scaled (`scalable`): the model's calls depend on the batch size.
    """
    if not scalable(two, four):
        raise UsageError(f"The model's calls at {TRACE_TEXTS} texts and at {2 * TRACE_TEXTS} differ in more than "
                         "sizes that grow with the batch (its ops depend on the batch size), so they cannot be "
                         "scaled by arithmetic; trace it at the batch size you need (mpsimpact.trace_module).")
    return [PerTextCall(c2, c4.a, c4.b) for c2, c4 in zip(two.trace, four.trace)]


def scalable(two: FaultPlan, four: FaultPlan) -> bool:
    """Whether traces at 2 and 4 texts make the same calls in the same order (ops, phases, ranks, dtypes)
    whose every shape, stride and offset grows by a whole amount per text."""
    def kind(c: CallRecord) -> tuple[Any, ...]:
        return c.op, c.phase, c.within, len(c.a.shape), len(c.b.shape), c.a.dtype, c.b.dtype

    return len(two.trace) == len(four.trace) and all(
        kind(c2) == kind(c4) and not any((y - x) % TRACE_TEXTS for s2, s4 in ((c2.a, c4.a), (c2.b, c4.b))
                                         for x, y in zip(_flat(s2), _flat(s4)))
        for c2, c4 in zip(two.trace, four.trace))


def largest_safe_batch(calls: list[PerTextCall], heads: int, index_bits: int, profile: FaultProfile,
                       ceiling: int = 1 << 24, mac: MacMemory | None = None) -> int:
    """The largest batch B such that every batch up to B is safe, checked at `batch_candidates` alone."""
    for batch in batch_candidates(calls, index_bits, ceiling, mac):
        if plan_at(calls, batch, index_bits, profile, mac).faults:  # pure arithmetic on rescaled shapes
            return batch - 1
    return ceiling


def batch_candidates(calls: list[PerTextCall], index_bits: int, ceiling: int,
                     mac: MacMemory | None = None) -> list[int]:
    """The batches in 1..ceiling, in order, where some call's outcome can change: the rules change outcome only
    where a numel crosses 2**(bits-1) or 2**bits, or a wrap start enters the batch (on `mac`, where a call's
    bytes reach its largest buffer). Between two of them (and from the last to `ceiling`) every call's fault
    stays the same, so one plan at each start decides the whole stretch."""
    limit, view_limit = limits(index_bits)
    candidates = set(_buffer_batches(calls, mac.buffer_at(index_bits))) if mac is not None else set()
    for p in calls:
        a, b = p.at(1)  # per-text shapes (only used for element counts)
        out = out_elements(p.call.family, a, b)
        for per_text in filter(None, (a.numel if p.a_scales else 0, b.numel if p.b_scales else 0, out)):
            for bound in (view_limit, limit):
                candidates.update({bound // per_text, bound // per_text + 1, -(-bound // per_text)})
        if p.call.family == "bmm":  # where the first wrapped row enters the batch
            for spec in (a, b):
                candidates.add(-(-limit // spec.per_batch) // a.shape[0] + 1)
    return sorted(c for c in candidates | {1} if 1 <= c <= ceiling)


def distinct_calls(calls: list[PerTextCall]) -> list[PerTextCall]:
    """The calls less each that repeats an earlier one's op and operands at every batch (a later layer's), SDPA's
    calls and their math paths' kept whole: the forward's outcome, its first wrong text and where it first stops
    are the same at every batch (outcome.predict reads the first of each), for a fraction of the arithmetic."""
    seen, kept = set(), []
    for p in calls:
        c = p.call
        if c.within is None and c.family != "sdpa":
            key = (c.op, c.phase, c.needs_grad, c.a, c.b, p.a4, p.b4)
            if key in seen:
                continue
            seen.add(key)
        kept.append(p)
    return kept


def silent_batches(calls: list[PerTextCall], heads: int, index_bits: int, profile: FaultProfile,
                   ceiling: int = 1 << 24, mac: MacMemory | None = None) -> list[tuple[int, int]]:
    """The stretches (first, last) of batches in 1..ceiling whose forward pass is silently wrong with the wrong
    texts known (outcome.Prediction.outcome "wrong": nothing stops, nothing uncharacterised alone): where a run
    shows the silent effect. Decided once per stretch of `batch_candidates`."""
    calls = distinct_calls(calls)
    starts = batch_candidates(calls, index_bits, ceiling, mac)
    stretches: list[tuple[int, int]] = []
    for start, end in zip(starts, [*starts[1:], ceiling + 1]):
        if predict(plan_at(calls, start, index_bits, profile, mac), start, heads).outcome != "wrong":
            continue
        if stretches and stretches[-1][1] == start - 1:
            start = stretches.pop()[0]
        stretches.append((start, end - 1))
    return stretches


def _buffer_batches(calls: list[PerTextCall], buffer: int) -> set[int]:
    """The batches where a call's bytes reach `buffer` (its bytes grow by a whole amount per text), and the
    batch before each."""
    found = set()
    for p in calls:
        one, two = p.bytes_at(1), p.bytes_at(2)
        if two > one:  # bytes(B) = one + (two - one) * (B - 1)
            first = 1 + max(0, -(-(buffer - one) // (two - one)))
            found.update({first - 1, first})
    return found


def plan_at(calls: list[PerTextCall], batch: int, index_bits: int, profile: FaultProfile,
            mac: MacMemory | None = None) -> FaultPlan:
    """The fault plan at `batch` texts under a release (on `mac`, with its largest buffer), rebuilt from
    per-text calls by arithmetic alone: from_trace decides each call MPS runs (its `trace` keeps the rebuilt
    records, read for their operands)."""
    return FaultPlan.from_trace(calls_at(calls, batch), index_bits, profile, mac)


def calls_at(calls: list[PerTextCall], batch: int) -> tuple[CallRecord, ...]:
    """The per-text calls rebuilt at `batch` texts by arithmetic, their faults not decided again."""
    return tuple(p.call.resized(a, b) for p in calls for a, b in [p.at(batch)])
