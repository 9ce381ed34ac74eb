"""What `run` concludes, as one typed value: `RunReport` (report.json) and its parts, written by the runner and read
back by compare through the same class (output.record.Record), which checks each field's type, the closed sets, and
that the numbers agree (counts within the batch, fractions with counts, sizes with the geometry's)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from mpsimpact.output.record import ABSENT, Record, shown
from mpsimpact.prediction.outcome import PredictionBlock, ReleaseBlock
from mpsimpact.prediction.version_table import VersionRow
from mpsimpact.runs.kind import SCHEMA_VERSION, condition_key

Status = Literal["completed", "stopped_by_guard", "error", "not_emulated", "skipped_predicted_abort"]
FaultKind = Literal["ok", "error", "wrong_all", "wrong_tail", "abort", "truncated", "wrong_other", "undecided"]
_record = dataclasses.dataclass(frozen=True, eq=False)


@_record
class RunConfigBlock(Record):
    """report.json's "config": what `run` was asked (config.RunConfig), with the sizes it ran at."""

    scenario: str
    batch_size: int = ABSENT
    steps: int = ABSENT
    lr: float = ABSENT
    max_length: int = ABSENT
    device: str | None = ABSENT
    emulate: bool | None = ABSENT
    guard: str = ABSENT
    out: str | None = ABSENT
    seed: int = ABSENT
    expect: str | None = ABSENT
    model: str | None = ABSENT
    dataset: str | None = ABSENT
    threshold: float = ABSENT
    reference_device: str | None = ABSENT
    run_length: int | None = ABSENT
    index_bits: int = ABSENT
    torch_profile: str | None = ABSENT
    attention: str = ABSENT
    dtype: str = ABSENT
    memory: str | None = ABSENT
    quick_sizes: list[str] | None = ABSENT


@_record
class EnvironmentBlock(Record):
    """report.json's "environment": the software and machine a run ran on (runs.environment)."""

    mpsimpact: str | None = ABSENT
    python: str | None = ABSENT
    torch: str | None = ABSENT
    transformers: str | None = ABSENT
    machine: str | None = ABSENT
    fault_profile: str | None = ABSENT


@_record
class GeometryBlock(Record):
    """report.json's "geometry": where and at what size the passes ran (runs.device_pass.Geometry)."""

    device: str
    batch_size: int
    max_length: int
    emulated: bool | None = ABSENT
    run_length: int | None = ABSENT
    index_bits: int | None = ABSENT
    profile: str | None = ABSENT
    attention: str = ABSENT
    dtype: str = ABSENT
    attentions: list[str] = ABSENT
    substituted: str = ABSENT
    replayed: bool = ABSENT
    mode: str | None = ABSENT

    def problem(self) -> str | None:
        if self.batch_size < 1 or self.max_length < 1:
            return f"batch_size and max_length are {self.batch_size} and {self.max_length}, not whole numbers >= 1"
        return None


@_record
class FaultBlock(Record):
    kind: FaultKind
    rule: str = ABSENT
    message: str | None = ABSENT


@_record
class AlteredCall(Record):
    """One call a condition's emulator or guard altered (engine.call.CallRecord.to_json), as compare reads it."""

    fault: FaultBlock
    op: str = ABSENT


@_record
class StopBlock(Record):
    """What stopped a condition (runs.device_pass.stop_facts): the guard or MPS, what MPS would do or did, its first wrong
    sample and the safe chunk in the caller's samples (the call's rows beside them), the index width judged at and
    torch's own text; what the console's plain words are made from."""

    by: Literal["guard", "mps"]
    kind: FaultKind
    release: str = ABSENT
    phase: str = ABSENT
    torch_text: str | None = ABSENT
    unmeasured: bool = ABSENT
    rows_per_sample: int = ABSENT
    first_wrong_row: int | None = ABSENT
    first_wrong_sample: int | None = ABSENT
    safe_rows: int | None = ABSENT
    safe_samples: int | None = ABSENT
    whole_rows: int | None = ABSENT
    whole_samples: int | None = ABSENT
    index_bits: int = ABSENT

    def problem(self) -> str | None:
        per = self.rows_per_sample
        if per is not ABSENT and per < 1:
            return f"rows_per_sample is {shown(per)}, not a whole number >= 1"
        for rows, samples in (("first_wrong_row", "first_wrong_sample"), ("safe_rows", "safe_samples"),
                              ("whole_rows", "whole_samples")):  # each count of samples is its rows' (stop_facts)
            counted, said = self.get(rows), self.get(samples)
            if type(counted) is int and type(said) is int and per is not ABSENT and said != counted // per:
                return f"{samples} is {said}, not {rows} // rows_per_sample = {counted} // {per} = {counted // per}"
        return None


@_record
class Condition(Record):
    """One guard condition's result: what every kind writes, and the counts and fractions compare reads (the kind's
    own numbers, beyond these, are kept as written)."""

    guard: str
    status: Status
    message: str | None = ABSENT
    attention: str = ABSENT
    phase: str | None = ABSENT
    wall_s: float = ABSENT
    where: str | None = ABSENT
    unmeasured: bool = ABSENT
    buffer_refused: str | None = ABSENT
    stop: StopBlock | None = ABSENT
    altered_calls: list[AlteredCall] | None = ABSENT
    wrong_values_before_stop: int = ABSENT
    predicted_first_corrupted_index: int | None = ABSENT
    corrupted_count: int | None = ABSENT
    corrupted_fraction: float | None = ABSENT
    first_corrupted_index: int | None = ABSENT
    corrupted_contiguous_to_end: bool | None = ABSENT
    non_finite_count: int = ABSENT

    @property
    def key(self) -> str:
        return condition_key(self.attention or None, self.guard)

    def problem(self) -> str | None:
        if self.wall_s is not ABSENT and self.wall_s < 0:
            return f"wall_s is {shown(self.wall_s)}, not a time >= 0"
        return None

    def disagreement(self, batch: int, kind: Any) -> str | None:
        """What makes this condition's numbers disagree with a batch of `batch` and its kind, or None."""
        for name in (*kind.counts, "wrong_values_before_stop", "non_finite_count"):
            value = self.get(name)
            if value is not None and not (type(value) is int and 0 <= value <= (batch if name in kind.counts else
                                                                                math.inf)):
                return f"{name} is {shown(value)}, not a count of at most {batch}"
        for name in kind.fractions:
            value = self.get(name)
            if value is not None and not (type(value) in (int, float) and 0 <= value <= 1):
                return f"{name} is {shown(value)}, not a number between 0 and 1"
        count, first, fraction = self.get("corrupted_count"), self.get("first_corrupted_index"), \
            self.get("corrupted_fraction")
        if count is not None and fraction is not None and not math.isclose(fraction, count / batch, abs_tol=1e-9):
            return f"corrupted_fraction is {shown(fraction)}, not corrupted_count / batch = {count}/{batch}"
        for name in ("first_corrupted_index", "predicted_first_corrupted_index"):
            value = self.get(name)
            if value is not None and not 0 <= value < batch:
                return f"{name} is {shown(value)}, not a position below {batch}"
        if count and first is None and self.status == "completed":
            return f"it corrupted {count} texts but has no first_corrupted_index"
        if first is not None and count is not None and not 1 <= count <= batch - first:
            return f"corrupted_count {count} cannot start at first_corrupted_index {first} in a batch of {batch}"
        return None


@_record
class RunReport(Record):
    """A run folder's report.json (schema 2: schema 1 plus "columns"; every schema-1 field keeps its name, place and
    meaning). Written by the runner (`to_json`), read by compare (`from_json`)."""

    schema_version: int
    config: RunConfigBlock
    geometry: GeometryBlock
    conditions: list[Condition]
    kind: str = ABSENT  # reports before the field: inference
    environment: EnvironmentBlock = ABSENT
    model: str | None = ABSENT
    label_names: list[str] = ABSENT
    data_source: str | None = ABSENT
    prediction: PredictionBlock = ABSENT
    predictions: dict[str, PredictionBlock] = ABSENT
    versions: list[VersionRow] = ABSENT
    repeated_texts: int = ABSENT
    tokens: dict[str, Any] = ABSENT
    reference: dict[str, Any] = ABSENT
    backward_prediction: PredictionBlock = ABSENT
    release: ReleaseBlock = ABSENT
    mac: dict[str, Any] = ABSENT
    columns: list[tuple[str, str]] = ABSENT
    notes: list[str] = ABSENT
    figures: list[str] = ABSENT
    silent_sizes: dict[str, Any] = ABSENT
    guard_advice: list[str] = ABSENT

    @property
    def batch(self) -> int:
        return self.geometry.batch_size

    @property
    def run_kind(self) -> Any:
        from mpsimpact.runs.kinds import KINDS

        return KINDS[self.kind or "inference"]

    def problem(self) -> str | None:
        from mpsimpact.runs.kinds import KINDS

        if not 1 <= self.schema_version <= SCHEMA_VERSION:  # a newer one is said by `read` before this
            return f"schema_version is {self.schema_version}, not one of 1..{SCHEMA_VERSION}"
        if self.kind is not ABSENT and self.kind not in KINDS:
            return f"kind is {shown(self.kind)}, not one of {', '.join(KINDS)}"
        for name in ("batch_size", "max_length"):
            asked, ran = self.config.get(name), self.geometry[name]
            if asked is not None and asked != ran:
                return f"config.{name} is {asked}, geometry.{name} {ran}: two runs' files"
        known = {"attention", *(key for key, _ in self.run_kind.columns)}  # an older writer's may be fewer
        if self.columns and not {key for key, _ in self.columns} <= known:
            return f"columns are not those of a run of kind {self.kind or 'inference'}"
        return self._conditions_problem() or self._prediction_problem()

    def _conditions_problem(self) -> str | None:
        seen: set[str] = set()
        for number, condition in enumerate(self.conditions):
            if condition.key in seen:
                return f"conditions.{number} (guard {condition.guard}) appears twice"
            seen.add(condition.key)
            problem = condition.disagreement(self.batch, self.run_kind)
            if problem is not None:
                return f"conditions.{number}.{problem}"
        return None

    def _prediction_problem(self) -> str | None:
        for name, block in [("prediction", self.prediction), *((f"predictions.{a}", b) for a, b in
                                                               (self.predictions or {}).items())]:
            problem = block.disagreement(self.batch) if block is not ABSENT else None
            if problem is not None:
                return f"{name}.{problem}"
        return None

    def positions_problem(self, corrupted: dict[str, frozenset[int]]) -> str | None:
        """What makes a positions file's corrupted sets (by condition_key) disagree with this report, in words, or
        None: a condition it does not have, or a completed condition's set other than the one it counts."""
        conditions = {c.key: c for c in self.conditions}
        for key, positions in corrupted.items():
            condition = conditions.get(key)
            if condition is None:
                return f"it holds guard {key}, a condition report.json does not have"
            count, first = condition.get("corrupted_count"), condition.get("first_corrupted_index")
            if condition.status == "completed" and count is not None and (
                    len(positions) != count or min(positions, default=None) != first):
                return (f"guard {condition.guard} has {len(positions)} corrupted texts from position "
                        f"{min(positions, default=None)}; report.json says {count} from {first}")
        missing = [c.guard for key, c in conditions.items() if c.status == "completed" and key not in corrupted
                   and key == c.guard and c.get("corrupted_count") is not None]
        return f"it has no texts of guard {missing[0]}, which completed" if corrupted and missing else None

