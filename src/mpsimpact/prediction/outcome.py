"""From a traced fault plan to what a user cares about: which samples go wrong (one computation of the
first bad sample and head), where the run stops, each faulting call as a row (one JSON vocabulary),
and which guard makes the run safe. `run`, `plan` and `check` all use it, so they cannot disagree."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

from mpsimpact.modes.chunking import attention_blocks, split_bmm, split_sdpa
from mpsimpact.modes.budget import bytes_per_score_of, target_budget
from mpsimpact.prediction.memory import in_gib, traced_peak_bytes
from mpsimpact.engine.call import CallRecord, op_cell
from mpsimpact.engine.fault_plan import FaultPlan
from mpsimpact.engine.mac_memory import BUFFER_RULE, MAC_RULES, WATERMARK_RULE
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.engine.release import allocates, torch_words
from mpsimpact.modes.piecewise import has_split
from mpsimpact.output.record import ABSENT, Record


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
        """Silent faults whose wrong values (and so which texts) nobody characterised (unmeasured ones too)."""
        return tuple(c for c in self.silent if c.fault.kind == "wrong_other")

    @property
    def unmeasured(self) -> tuple[CallRecord, ...]:
        """Calls nobody measured on MPS (judged conservatively as wrong_other)."""
        return tuple(c for c in self.silent if c.fault.is_unmeasured)

    @property
    def is_clean(self) -> bool:
        return self.stop is None and not self.silent

    @property
    def outcome(self) -> str:
        """One word: clean, wrong (texts known), wrong_other (not characterised), unmeasured (nobody
        measured what these calls do: judged conservatively), error or abort."""
        if self.stop is not None:
            return self.stop.fault.kind
        if self.first_corrupted_text is not None:
            return "wrong"
        if self.uncharacterised:
            return "unmeasured" if len(self.unmeasured) == len(self.uncharacterised) else "wrong_other"
        return "clean"

    def describe(self) -> str:
        """The outcome in words, for tables and slides."""
        if self.stop is not None:
            fault = self.stop.fault
            rule = f"rule {fault.rule}" + (", inferred" if fault.inferred else "")
            said = f"process abort: {fault.message}" if fault.kind == "abort" else f"error, {torch_words(fault.message)}"
            return f"{said} (at {self.stop.describe()}, {self.stop.phase}; {rule})"
        if self.first_corrupted_text is not None:
            return f"{self.corrupted_count} texts wrong from text {self.first_corrupted_text}"
        if self.outcome == "unmeasured":
            calls = unmeasured_calls(self.unmeasured)
            return f"cannot tell ({calls}: nobody measured them on MPS; judged conservatively)"
        if self.uncharacterised:
            return "wrong (values and texts not characterised)"
        return "clean"

    def to_json(self) -> dict[str, Any]:
        stop = self.stop
        return {
            "outcome": self.outcome, "first_corrupted_text": self.first_corrupted_text,
            "first_corrupted_head": self.first_corrupted_head, "corrupted_count": self.corrupted_count,
            "corrupted_fraction": self.corrupted_count / self.batch,
            "uncharacterised_faults": len(self.uncharacterised), "unmeasured_faults": len(self.unmeasured),
            "stops": None if stop is None else {"call": stop.to_json(), "kind": stop.fault.kind,
                                                "message": stop.fault.message},
            "silent_faults": [call.to_json() for call in self.silent],
        }


@dataclasses.dataclass(frozen=True, eq=False)
class PredictionBlock(Record):
    """A prediction as files hold it, one vocabulary for run, plan and check: the outcome in a word and in words,
    the first wrong sample and head, how many samples go wrong and what fraction, the calls nobody characterised or
    measured, and where MPS stops. report.json's block keeps its schema-1 fields (first_corrupted_text, ...; "stops":
    the first stop) and adds plan's and check's ("stops" there: every stopping call's row)."""

    outcome: str
    first_corrupted_text: int | None = ABSENT
    first_corrupted_head: int | None = ABSENT
    corrupted_count: int = ABSENT
    corrupted_fraction: float = ABSENT
    uncharacterised_faults: int = ABSENT
    unmeasured_faults: int = ABSENT
    stops: dict[str, Any] | list[dict[str, Any]] | None = ABSENT
    silent_faults: list[dict[str, Any]] = ABSENT
    describe: str = ABSENT
    first_wrong_sample: int | None = ABSENT
    first_wrong_head: int | None = ABSENT
    wrong_samples: int | None = ABSENT
    wrong_fraction: float | None = ABSENT
    uncharacterised_calls: int = ABSENT
    unmeasured_calls: int = ABSENT
    note: str = ABSENT

    def disagreement(self, batch: int) -> str | None:
        """What makes its numbers disagree with a batch of `batch`, in words, or None."""
        for count, fraction, first in (("corrupted_count", "corrupted_fraction", "first_corrupted_text"),
                                       ("wrong_samples", "wrong_fraction", "first_wrong_sample")):
            n, share, at = self.get(count), self.get(fraction), self.get(first)
            if n is not None and not 0 <= n <= batch:
                return f"{count} is {n}, not a count of at most {batch}"
            if n is not None and share is not None and abs(share - n / batch) > 1e-9:
                return f"{fraction} is {share}, not {count} / batch = {n}/{batch}"
            if at is not None and not 0 <= at < batch:
                return f"{first} is {at}, not a position below {batch}"
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class CallRow(Record):
    """One faulting call as plan.json and check.json hold it (`call_row`): the call, its layouts and sizes, what MPS
    does with it and by which rule, and the first wrong batch of its rows, sample and head."""

    index: int
    op: str
    kind: str
    phase: str = ABSENT
    module: str = ABSENT
    a: list[int] = ABSENT
    b: list[int] = ABSENT
    a_layout: str = ABSENT
    b_layout: str = ABSENT
    a_numel: int = ABSENT
    b_numel: int = ABSENT
    out_numel: int = ABSENT
    rule: str = ABSENT
    inferred: bool = ABSENT
    first_bad_batch: int | None = ABSENT
    first_bad_sample: int | None = ABSENT
    first_bad_head: int | None = ABSENT
    message: str = ABSENT


@dataclasses.dataclass(frozen=True, eq=False)
class ReleaseBlock(Record):
    """Which release a command judged and why (engine.release.JudgedRelease.to_json), and what the installed torch
    would do on a Mac ("on_a_mac"; None where it is the one judged): report.json's, plan.json's and check.json's
    "release"."""

    judged: str
    release: str
    label: str = ABSENT
    measured: bool = ABSENT
    why: str = ABSENT
    installed: str = ABSENT
    sentence: str = ABSENT
    on_a_mac: str | None = ABSENT


def unmeasured_calls(calls: tuple[CallRecord, ...]) -> str:
    """'3 calls (_softmax, add)': the unmeasured calls, by op."""
    ops = ", ".join(dict.fromkeys(c.op for c in calls))
    return f"{len(calls)} call{'s' if len(calls) != 1 else ''} ({ops})"


def predict(plan: FaultPlan, batch: int, heads: int, phase: str = "forward") -> Prediction:
    """Translates a plan's faults into texts: a bmm over batch*heads rows wrong from row j
    corrupts texts j // heads onwards (attention mixes tokens within a text only)."""
    calls = [c for c in plan.calls if c.phase == phase or phase == "all"]
    stop = next((c for c in calls if c.fault.is_stop), None)
    silent = tuple(c for c in calls if c.fault.is_silent and (stop is None or c.index < stop.index))
    # A wrapped call whose rows are not whole samples could start anywhere: sample 0, conservatively.
    rows = [first_bad_row(c, batch, heads) or (0, None) for c in silent if c.fault.first_bad_batch is not None]
    first = min(rows, default=None, key=lambda r: (r[0], r[1] or 0))
    return Prediction(batch, heads, first[0] if first else None, first[1] if first else None, stop, silent)


def first_bad_row(call: CallRecord, batch: int, heads: int) -> tuple[int, int | None] | None:
    """(sample, head) of a call's first wrong row: a bmm over rows = batch * r wrong from row j reads
    sample j // r, and head j % r when r is the head count (attention); None where the rows are not
    whole samples, or the call's kind does not say which rows are wrong."""
    first = call.fault.first_bad_batch
    if first is None or call.family != "bmm" or call.a.shape[0] % batch:
        return None
    per_sample = call.a.shape[0] // batch
    return first // per_sample, (first % per_sample if per_sample == heads else None)


def call_row(call: CallRecord, batch: int, heads: int) -> dict[str, Any]:
    """One faulting call as a table row / JSON object (the words plan, check and run all use)."""
    row = first_bad_row(call, batch, heads)
    return {
        "index": call.index, "phase": call.phase, "module": call.module, "op": call.op,
        "a": list(call.a.shape), "b": list(call.b.shape), "a_layout": call.a.layout, "b_layout": call.b.layout,
        "a_numel": call.a.numel, "b_numel": call.b.numel, "out_numel": call.out_numel,
        "kind": call.fault.kind, "rule": call.fault.rule, "inferred": call.fault.inferred,
        "first_bad_batch": call.fault.first_bad_batch, "first_bad_sample": row[0] if row else None,
        "first_bad_head": row[1] if row else None, "message": call.fault.message,
    }


def splits_safely(call: CallRecord, index_bits: int) -> bool:
    """Whether guard 'chunk' can make this call safe: the split it would make exists (modes.chunking;
    down to blocks of rows and columns of one batch, or of query rows of one head for SDPA; cat by
    copying into place; the other families by modes.piecewise)."""
    if call.family == "sdpa":
        return split_sdpa(call.a.shape, call.b.shape, call.a.shape[-1], index_bits) is not None
    if call.family == "cat":
        return True
    if not call.is_product:
        return has_split(call.op, call.family, call.a, call.b, index_bits)
    return split_bmm(call.a, call.b, index_bits, call.family) is not None


def needs_strict(call: CallRecord) -> bool:
    """A call the guard's fast path (the entry points: products, Linear, SDPA, cat) leaves to strict mode."""
    return not call.is_product and call.family != "cat"


def is_attention_call(call: CallRecord, batch: int, heads: int) -> bool:
    """An SDPA call, a bmm over batch*heads rows, or an op on (batch, heads, L, Lk) scores."""
    if call.family == "sdpa" or (call.family == "bmm" and call.a.shape[0] == batch * heads):
        return True
    return not call.is_product and len(call.a.shape) == 4 and call.a.shape[:2] == (batch, heads)


def attention_geometry(calls: list[CallRecord]) -> tuple[int, int, int]:
    """(query rows, keys, head dim) of attention calls at their largest."""
    length = keys = dim = 0
    for call in calls:
        if call.family == "sdpa":  # a = query (B, H, L, D), b = key (B, Hkv, Lk, D)
            inner, outer = call.a.shape[-1], call.b.shape[-2]
        elif not call.is_product:  # the scale, mask or softmax on the scores (B, H, L, Lk)
            inner, outer = 1, call.a.shape[-1]
        else:  # Q K^T: (L, D) @ (D, Lk); P V: (L, Lk) @ (Lk, Dv): the keys are the wider of the two
            inner, outer = sorted((call.a.shape[-1], call.b.shape[-1]))
        length, keys, dim = max(length, call.a.shape[-2]), max(keys, outer), max(dim, inner)
    return length, keys, dim


@dataclasses.dataclass(frozen=True)
class Subject:
    """What the advice and the peak memory need to know about the model beyond its calls."""

    heads: int
    model_class: str = ""
    supports_attention_interface: bool = True
    parameters: int = 0
    hidden: int = 0
    dtype: Any = None  # the model's torch.dtype
    training: bool = False  # one training step (forward and backward), not one forward pass
    unit: str = "sample"  # what one entry of the input's first dimension is called to its user: "text" in `plan`

    @classmethod
    def of_module(cls, module: Any, heads: int, hidden: int, *, backward: bool, unit: str = "sample") -> "Subject":
        """The subject of a model as built on the meta device (as plan and run build it; a scenario's wrapper has
        no config of its own, so its width is given): its class, size and dtype read from the module."""
        parameters = list(module.parameters())
        return cls(heads, type(module).__name__, parameters=sum(p.numel() for p in parameters), hidden=hidden,
                   dtype=parameters[0].dtype if parameters else None, training=backward, unit=unit)


def guard_advice(plan: FaultPlan, batch: int, subject: Subject) -> list[str]:
    """Which guard makes this run safe, in plain words (first line: the one to use)."""
    faults = plan.faults
    if not faults:
        return ["Nothing crosses a limit: no guard needed."]
    if refused := [c for c in faults if c.fault.rule in MAC_RULES]:
        return _refused_advice(faults, refused, plan, batch, subject)
    stuck = [c for c in faults if not splits_safely(c, plan.index_bits)]
    strict = [c for c in faults if needs_strict(c)]
    if stuck and not stuck[0].is_product:
        lines = [f"guard 'chunk' cannot make call {stuck[0].index} safe: no split is known for {stuck[0].op} "
                 f"({stuck[0].family}); lower the batch size (see the largest safe batch)."]
    elif stuck:
        lines = [f"guard 'chunk' cannot make call {stuck[0].index} safe: one row of it ({stuck[0].describe()}) "
                 "already crosses a limit; shorten the sequence (see the longest safe length)."]
    elif strict:
        lines = [f"guard 'chunk' with strict=True (`with mpsimpact.guard('chunk', strict=True):`) makes "
                 f"{_all_calls(faults)} safe: {len(strict)} of them are other op families "
                 f"({', '.join(dict.fromkeys(c.op for c in strict))}), which the guard's fast path leaves to "
                 "strict mode; it splits each into pieces below the limits; the result equals the correct "
                 "one."]
    else:
        lines = [f"guard 'chunk' (`with mpsimpact.guard('chunk'):`) makes {_all_calls(faults)} safe: it splits "
                 f"{'each' if len(faults) > 1 else 'it'} along its first dimension (the batch, or a 2-D product's "
                 "rows) into pieces below the limits; the result equals the correct one."]
    first, stop = faults[0], plan.first_stop
    how = " (with strict=True)" if needs_strict(first) else ""
    lines.append(f"guard 'raise'{how} stops before call {first.index} ({first.op} in "
                 f"{first.module or first.phase}) with OversizedOpError instead of "
                 + ("an MPS error or a crash." if stop is first else "wrong values."))
    lines.append(_safe_eager_advice(faults, plan.index_bits, batch, subject))
    if any(c.fault.rule == "sdpa-fused" for c in faults):
        lines.append(_upgrade_advice(plan, batch, subject.heads))
    return lines


# The first release whose fused SDPA is correct past 2^32 scores (docs/fault-model.md, "Per-release differences").
SDPA_FIXED_IN = "2.13.0"


def _upgrade_advice(plan: FaultPlan, batch: int, heads: int) -> str:
    """What upgrading to the release that fixed fused SDPA does to this run, decided by that release's rules (where
    they meet a call nobody measured, nobody can tell, as the line about the installed torch says)."""
    from mpsimpact.engine.release import profile_for

    fixed = SDPA_FIXED_IN
    after = predict(plan.under(profile_for(fixed)), batch, heads, "all")
    shows = f"(--torch-profile {fixed} shows it)"
    if after.is_clean:
        return (f"Upgrading torch fixes this run: torch {fixed} and later compute the fused SDPA calls correctly, "
                f"and on torch {fixed} nothing else crosses a limit {shows}.")
    unknown = undecided_at(profile_for(fixed), after)
    then = (f"nobody measured what it does at {site(unknown)}, so nobody can tell whether the run is then safe"
            if unknown is not None else f"the run then {spoken(after)}")
    return f"Upgrading torch fixes the fused SDPA calls (correct from torch {fixed}), but on torch {fixed} {then} {shows}."


def _all_calls(faults: list[CallRecord]) -> str:
    return "the faulting call" if len(faults) == 1 else f"all {len(faults)} faulting calls"


def _refused_advice(faults: list[CallRecord], refused: list[CallRecord], plan: FaultPlan, batch: int,
                    subject: Subject) -> list[str]:
    """Where the Mac refuses an allocation, no guard mode helps (it splits a computation, never one tensor);
    mps_safe_eager does where every refused tensor is attention's scores, which it never holds whole."""
    first, mac = refused[0], plan.mac
    if first.fault.rule == WATERMARK_RULE:  # the run's total, not one tensor
        on = f"on {mac.label}" if mac is not None else "on this Mac"
        lines = [f"No guard mode makes the run fit {on}: it needs more memory in all than MPS lets one process hold "
                 f"('{first.fault.message}'), and a guard splits a computation, it does not shrink the model. Lower "
                 "the batch size or the length (see the largest safe sizes)."]
        return lines + ([_safe_eager_advice(faults, plan.index_bits, batch, subject)]
                        if is_attention_call(first, batch, subject.heads) else [])
    on = f"on {mac.label} ({mac.buffer_words()})" if mac is not None else "on this Mac"
    lines = [f"No guard mode makes call {first.index} ({first.op} in {first.module or first.phase}) run {on}: "
             f"MPS refuses to allocate its tensor ('{first.fault.message}') before the call runs, and a guard "
             "splits a computation, not one tensor. Lower the batch size or the length (see the largest safe "
             "sizes)."]
    if all(is_attention_call(c, batch, subject.heads) for c in refused):
        lines.append(_safe_eager_advice(faults, plan.index_bits, batch, subject))
    return lines


def _safe_eager_advice(faults: list[CallRecord], index_bits: int, batch: int, subject: Subject) -> str:
    name = "attn_implementation='mps_safe_eager' (name = mpsimpact.attention.register())"
    if not subject.supports_attention_interface:
        return (f"{subject.model_class} does not support transformers' attention interface: {name} is not an "
                "option; use the guard.")
    heads = subject.heads
    attention = [c for c in faults if is_attention_call(c, batch, heads)]
    others = [c for c in faults if c not in attention]
    if not attention:
        return f"{name} does not help: no faulting call is in attention."
    per_score, budget = bytes_per_score_of(attention[0].a.dtype), target_budget("mps")
    # The pieces mps_safe_eager (mpsimpact.attention) would use: its own `attention_blocks` at the calls' largest
    # geometry (grouped heads counted as copied, as eager does), within the memory budget (Note [Attention memory
    # budget]).
    length, keys, dim = attention_geometry(attention)
    blocks = attention_blocks(batch, heads, 1, length, keys, dim, dim, index_bits, max(1, budget // per_score))
    if blocks is None:
        return f"{name} cannot make them safe: one query row of a head already crosses a limit."
    one, plural = subject.unit, lambda n, word: f"{n} {word}{'s' if n != 1 else ''}"
    unit = (f"blocks of {plural(blocks.block, 'query row')} of one head" if blocks.block < length else
            plural(blocks.rows // heads, one) if blocks.rows >= heads else f"{plural(blocks.rows, 'head')} of one {one}")
    if blocks.key_block is not None:
        unit += f" over blocks of {blocks.key_block} keys (online softmax)"
    rows = blocks.rows - blocks.rows % heads if blocks.rows >= heads else blocks.rows  # whole samples a piece
    piece = per_score * rows * blocks.block * (blocks.key_block or keys)
    tail = (f"; the {len(others)} other faulting calls (e.g. {others[0].op} in {others[0].module}) still need "
            "the guard") if others else ""
    calls = "the attention call" if len(attention) == 1 else f"the {len(attention)} attention calls"
    return (f"{name} makes {calls} safe in chunks of {unit}, with no guard around "
            f"the model; a piece's scores, mask and softmax take about {in_gib(piece):.1f} GiB on top of "
            f"the model (memory budget {in_gib(budget):.1f} GiB: mpsimpact.modes.budget.set_memory_budget or "
            f"MPSIMPACT_ATTENTION_BUDGET){tail}.")


def step_outcome(forward: Prediction, whole: Prediction | None, describe: Callable[[Prediction], str],
                 outputs: str = "") -> tuple[str, str]:
    """(outcome, words) of an inference pass (`whole` None) or of a training step (`whole`: both phases):
    the forward pass's, then what its backward pass adds (a stop, or gradient products silently wrong).
    `describe` puts a prediction in words; `outputs`, if given, names what the forward pass returns."""
    stop = (whole or forward).stop
    outcome, words = (stop.fault.kind if stop is not None else forward.outcome), describe(forward)
    said = f"{words} ({outputs})" if outputs else words
    if whole is None:
        return outcome, words
    if stop is not None and stop.phase == "backward" and forward.outcome != "clean":
        if stop.fault.kind == "abort":
            return outcome, f"{said}, then a process abort in backward: {stop.fault.message}"
        return outcome, f"{said}, then an error in backward, {torch_words(stop.fault.message)}"
    if stop is not None:
        return outcome, describe(whole)
    if wrong := [c for c in whole.silent if c.phase == "backward"]:
        outcome = "wrong" if outcome == "clean" else outcome
        return outcome, f"{said}; {len(wrong)} gradient products silently wrong in backward"
    return outcome, words


def summarise(plan: FaultPlan, batch: int, heads: int, *, training: bool = False,
              prediction: Prediction | None = None, unit: str = "sample") -> dict[str, Any]:
    """The first wrong (sample, head) of the outputs, the fraction of the batch that goes wrong (None where
    nobody characterised which samples), the outcome in words (for a training step, with what its backward
    pass adds: step_outcome; counted in `unit`s), and the calls where MPS stops the run."""
    prediction = prediction or predict(plan, batch, heads, "forward")  # the forward pass's, where made already
    whole = predict(plan, batch, heads, "all") if training else None
    outcome, words = step_outcome(prediction, whole, functools.partial(_describe, unit=unit))
    profile = plan.profile
    if profile is not None and (unknown := undecided_at(profile, whole or prediction)) is not None:
        words = (f"cannot tell: {cannot_tell(profile.release, unknown)}; judged as the worst measured release would "
                 f"be: {words}")
    first, wrong = prediction.first_corrupted_text, prediction.corrupted_count
    unknown = bool(prediction.uncharacterised) and prediction.stop is None
    if prediction.stop is not None:  # the run ends there: no output, right or wrong
        first = None
    elif unknown and first is None:  # wrong_other alone: some sample is wrong, which is not known...
        first, wrong = (0, 1) if batch == 1 else (None, None)  # ...unless there is only one
    return {
        "outcome": outcome, "describe": words,
        "first_wrong_sample": first,
        "first_wrong_head": prediction.first_corrupted_head if first is not None else None,
        "wrong_samples": wrong, "wrong_fraction": None if wrong is None else wrong / batch,
        "uncharacterised_calls": len((whole or prediction).uncharacterised),
        "unmeasured_calls": len((whole or prediction).unmeasured),
        "note": _note(prediction) if unknown else "",
        "stops": [call_row(c, batch, heads) for c in plan.calls if c.fault.is_stop],
    }


def _note(prediction: Prediction) -> str:
    if prediction.outcome == "unmeasured":
        return (f"{unmeasured_calls(prediction.unmeasured)} past the limits in a case nobody measured on "
                "MPS: judged conservatively; the guard stops them")
    return "some calls return wrong values in a pattern nobody characterised"


def _describe(prediction: Prediction, unit: str = "sample") -> str:
    if prediction.stop is not None:
        what = "aborts the process" if prediction.stop.fault.kind == "abort" else "raises"
        stop = prediction.stop
        # whether calls before it already went wrong: then the stop is not "before any wrong value"
        wrong = len(prediction.silent)
        before = (f", after {wrong} call{'s' if wrong != 1 else ''} already returned wrong values"
                  if wrong else ", before any wrong value")
        if stop.fault.rule == WATERMARK_RULE:
            return (f"MPS stops the run with '{stop.fault.message}' at call {stop.index} ({stop.describe()}, "
                    f"{stop.phase}): the run needs more memory than the Mac lets one process hold{before}")
        if stop.fault.rule == BUFFER_RULE:
            return (f"MPS raises '{stop.fault.message}' at call {stop.index} ({stop.describe()}, {stop.phase}): "
                    f"the Mac cannot allocate that tensor{before}")
        return f"MPS {what} at call {stop.index} ({stop.describe()}, {stop.phase})"
    if prediction.first_corrupted_text is not None:
        return (f"{prediction.corrupted_count} of {prediction.batch} {unit}s silently wrong, from {unit} "
                f"{prediction.first_corrupted_text} (head {prediction.first_corrupted_head})")
    if prediction.outcome == "unmeasured":
        return f"cannot tell: {unmeasured_calls(prediction.unmeasured)} nobody measured on MPS (judged conservatively)"
    if prediction.uncharacterised:
        which = f"the one {unit}" if prediction.batch == 1 else f"which {unit}s is not characterised: any may be"
        return f"silently wrong ({which})"
    return "clean"


# An op on attention scores, by what it does there (for the words a speaker reads out).
_ON_SCORES = {"mul": "scaling", "div": "scaling", "_softmax": "softmax", "_safe_softmax": "softmax",
              "softmax": "softmax", "add": "masking", "masked_fill": "masking", "masked_fill_": "masking",
              "where": "masking", "exp": "softmax", "native_dropout": "dropout", "clone": "copying",
              "copy_": "copying", "_to_copy": "copying"}


# Eager attention's two products, in a talk's words (the glossary's): P V, and Q K^T.
WEIGHTED_VALUES, SCORES_PRODUCT = "attention's weighted sum of the values", "the attention scores (queries times keys)"


def site(call: CallRecord, shapes: bool = False) -> str:
    """Where a call is, in a talk's words: 'the scaling of the attention scores', "attention's weighted sum of the
    values" (eager attention's P V product), 'gelu in encoder.layer.0'; with `shapes`, the op and its shapes after
    them in brackets ('... (mul on 16x12x256x256)'), for --verbose and the files."""
    if allocates(call.op):  # an empty tensor made whole (blocked_eager's P): where a Mac's buffer refuses it
        square = len(call.b.shape) == 4 and call.b.shape[-1] == call.b.shape[-2]
        words = f"{'the attention probabilities P' if square else 'a tensor'}, allocated whole"
        return f"{words} ({call.op} of {'x'.join(map(str, call.b.shape))})" if shapes else words
    a = call.a.shape
    square = len(a) >= 3 and a[-1] == a[-2]
    if call.family == "sdpa":
        words = "fused attention (SDPA)"
    elif call.family == "bmm" and square and call.b.shape[-2] == a[-1] and call.b.shape[-1] < a[-1]:
        words = WEIGHTED_VALUES
    elif call.family == "bmm" and call.out_numel == a[0] * a[-2] * call.b.shape[-1] and call.b.shape[-1] == a[-2]:
        words = SCORES_PRODUCT
    elif not call.is_product and square and call.op in _ON_SCORES:
        words = f"the {_ON_SCORES[call.op]} of the attention scores"
    elif (node := re.fullmatch(r"(\w+?)Backward\d*", call.module or "")) is not None:  # autograd's node
        words = f"the {call.op} in the backward pass of {_BACKWARD_OF.get(node[1], 'an op')}"
    else:
        words = f"{call.op} in {call.module}" if call.module else call.op
    return f"{words} ({op_cell(call.op, list(a), list(call.b.shape))})" if shapes else words


# An autograd node's forward op (a backward call's module: "AddmmBackward0"), in a talk's words.
_BACKWARD_OF = {"Addmm": "a linear layer", "Linear": "a linear layer", "Mm": "a matrix product",
                "Bmm": "a batched matrix product", "Matmul": "a matrix product", "Softmax": "a softmax"}


def spoken(prediction: Prediction) -> str:
    """What a release does to the run, as a speaker says it: 'silently returns wrong outputs for 6 of 16
    texts, from text 10', 'kills the process at the scaling of the attention scores', 'raises ...'."""
    if prediction.stop is not None:
        stop = prediction.stop
        if stop.fault.kind == "abort":
            return f"kills the process at {site(stop)}"
        return f"raises '{stop.fault.message}' at {site(stop)}"
    if prediction.first_corrupted_text is not None:
        return (f"silently returns wrong outputs for {prediction.corrupted_count} of {prediction.batch} texts, "
                f"from text {prediction.first_corrupted_text}")
    if prediction.uncharacterised:
        return f"silently returns wrong values nobody characterised, first at {site(prediction.uncharacterised[0])}"
    return "runs clean: nothing crosses a limit"


def undecided_at(profile: Any, prediction: Prediction) -> CallRecord | None:
    """The call whose outcome nobody measured and on which the run's outcome turns, or None: on a release
    nobody measured (`profile.conservative`) its first faulting call; else a stop nobody measured, or, where
    no text is known to go wrong and nothing stops, the first call nobody measured."""
    calls = sorted((*prediction.silent, *([prediction.stop] if prediction.stop else ())), key=lambda c: c.index)
    if profile.conservative:
        return calls[0] if calls else None
    if prediction.stop is not None:
        return prediction.stop if prediction.stop.fault.nobody_measured else None
    if prediction.first_corrupted_text is not None:
        return None
    return next((c for c in calls if c.fault.nobody_measured), None)


def cannot_tell(release: str, call: CallRecord) -> str:
    """The words for what nobody measured: which call, that nobody measured it, what measures it."""
    return (f"nobody measured torch {release} on MPS at {site(call)}, so nobody can tell what it does there; "
            "`mpsimpact sweep` on a Mac measures it")


def on_a_mac(judged: Any, installed: Prediction, as_judged: Prediction,
             index_bits: int = MPS_INDEX_BITS) -> str | None:
    """What the installed torch would do to this run on a Mac, with the flag that shows it; None when the
    installed release is the one judged (`judged`: engine.release.JudgedRelease). `as_judged`: the run under the
    judged release (on the same Mac), whose outcome the installed one's is told against ("instead", or the same);
    a narrowed `index_bits` is said: the sizes are an emulated stand-in for a batch that much larger."""
    if judged.is_installed:
        return None
    profile = judged.installed
    narrowed = index_bits != MPS_INDEX_BITS
    mac = f"On a Mac, at the size this {index_bits}-bit run stands for" if narrowed else "On a Mac"
    unknown = undecided_at(profile, installed)
    if unknown is not None:
        return f"{mac}{',' * narrowed} with the installed torch: {cannot_tell(profile.release, unknown)}."
    outcome = spoken(installed)
    if outcome == spoken(as_judged) and not judged.profile.conservative:  # an unmeasured release's is a guess
        return (f"{mac}, the installed torch {profile.label} does the same as torch {judged.profile.label} "
                f"(--torch-profile {profile.release} shows it).")
    return f"{mac}, the installed torch {profile.label} {outcome} instead (--torch-profile {profile.release} shows it)."


@dataclasses.dataclass(frozen=True)
class PredictionSection:
    """One traced geometry under the judged release, as run, plan and check report it: the release and what
    the installed torch would do on a Mac, the forward pass's prediction (made once), the faulting calls, the
    safe sizes the caller searched, the peak memory of a real run and the guard advice."""

    release: Any  # engine.release.JudgedRelease
    plan: FaultPlan
    batch: int
    length: int
    subject: Subject

    @functools.cached_property
    def decided(self) -> FaultPlan:
        """The plan as the Mac declared meets it: with MPS's out-of-memory stop where the run's peak passes its high
        watermark (memory.decided_on_memory; Note [What fits a Mac])."""
        from mpsimpact.prediction.memory import decided_on_memory

        return decided_on_memory(self.plan, self.subject, self.batch, self.length)

    @functools.cached_property
    def prediction(self) -> Prediction:
        return predict(self.decided, self.batch, self.subject.heads)

    def prediction_json(self) -> dict[str, Any]:
        """The prediction block as run's report.json holds it (a PredictionBlock): schema 1's fields first
        (Prediction.to_json), then those of plan's and check's block that it lacks (`summarise`), in one vocabulary."""
        block = self.prediction.to_json()
        said = summarise(self.decided, self.batch, self.subject.heads, training=self.subject.training,
                         prediction=self.prediction)
        return block | {key: value for key, value in said.items() if key not in block}

    def release_json(self) -> dict[str, Any]:
        """The judged release and why, with what the installed torch would do to this run on a Mac, and the flag
        that shows it (None where the installed release is the one judged)."""
        judged = self.release
        if judged.is_installed:
            return judged.to_json() | {"on_a_mac": None}
        plan, heads = self.plan.on_mac(None), self.subject.heads
        as_judged = self.prediction if plan is self.plan else predict(plan, self.batch, heads)
        installed = predict(plan.under(judged.installed), self.batch, heads)
        return judged.to_json() | {"on_a_mac": on_a_mac(judged, installed, as_judged, plan.index_bits)}

    def to_json(self, safe: dict[str, Any]) -> dict[str, Any]:
        """The words of plan and check: the calls traced, the faulting ones, the outcome, `safe` (the largest
        safe sizes, as the caller searched them), the peak memory of a real run and the guard advice."""
        plan, batch, subject, heads = self.decided, self.batch, self.subject, self.subject.heads
        peak, basis = traced_peak_bytes(plan, subject.parameters, batch, self.length, subject.hidden, heads,
                                        subject.dtype, subject.training)
        return {"calls_traced": len(plan.products), "ops_traced": len(plan.calls),
                "faulting_calls": [call_row(c, batch, heads) for c in plan.faults],
                "prediction": summarise(plan, batch, heads, training=subject.training), **safe,
                "estimated_peak_gib": in_gib(peak), "estimated_peak_basis": basis,
                "guard_advice": guard_advice(plan, batch, subject)}
