"""`mpsimpact plan`: the shape-only prediction for a scenario's model at a geometry, as a JSON-ready
report; plus the batch-size sweep for talks. (reports.plan prints and writes it.)"""

from __future__ import annotations

import dataclasses
from typing import Any

from mpsimpact.errors import UsageError
from mpsimpact.config import EMBEDDED_MODEL, PlanConfig, batch_ceiling
from mpsimpact.prediction.demo_size import silent_sizes
from mpsimpact.output.record import ABSENT, Record
from mpsimpact.prediction.outcome import CallRow, PredictionBlock, PredictionSection, ReleaseBlock, Subject, predict
from mpsimpact.prediction.version_table import VersionRow, version_table
from mpsimpact.prediction.memory import batch_fits, in_gib
from mpsimpact.prediction.meta_model import trace_meta, usable_positions
from mpsimpact.prediction.safe_size import (BoundarySearch, PerTextTraces, calls_at, cut_to_fit, largest_safe_batch,
                                            plan_at)
from mpsimpact.engine.release import PUBLISHED_DEMO_RELEASE, judge_release, profile_for

SAFE_TABLE_LENGTHS = (128, 256, 384, 512)
ROUND_BATCHES = (256, 512, 1024, 2048, 3072, 4096, 8192, 16384, 32768)
BOUNDARY_LENGTHS = (128, 256, 512)  # lengths whose P V wrap boundary the sweep straddles


def sweep_batches(heads: int, index_bits: int) -> list[int]:
    """Round batch sizes, and each side of where P (B*heads, L, L) passes the limit at each boundary
    length: floor(2**bits / (heads * L * L)) is the last clean batch (1365 at 12 heads and 512)."""
    edges = {2**index_bits // (heads * length * length) for length in BOUNDARY_LENGTHS}
    return sorted({*ROUND_BATCHES, *edges, *(edge + 1 for edge in edges)} - {0})


def build_plan_report(config: PlanConfig, scenario: Any) -> PlanReport:
    """Traces the scenario's model on meta (config only) and predicts everything `plan` prints.

    Args:
        config: what was asked (validated here).
        scenario: the scenario instance (runs.scenario.Scenario) whose model and defaults are planned.
    """
    config.validate()
    judged = judge_release(config.torch_profile)  # once, here: the value travels down
    batch = config.batch_size or scenario.default_batch_size
    length = config.max_length or scenario.default_max_length
    model_config = scenario.load_config()
    positions = usable_positions(model_config)
    if length > positions:
        raise UsageError(f"--max-length {length} exceeds the model's {positions} positions.")
    meta = scenario.meta_module(model_config)
    heads = model_config.num_attention_heads
    profile, mac = judged.profile, config.mac
    traces = PerTextTraces(meta, backward=config.backward, allocations=mac is not None, profile=profile)
    traced = {L: traces(L) for L in {*SAFE_TABLE_LENGTHS, length} if L <= positions}
    ceiling = batch_ceiling(batch)  # an answer there is "at least" (the reports say so)
    safe = {L: largest_safe_batch(c, heads, config.index_bits, profile, ceiling) for L, c in traced.items()}
    subject = Subject.of_module(meta, heads, model_config.hidden_size, backward=config.backward, unit="text")
    safe_here = safe if mac is None else {  # on the Mac: its largest buffer too, and what fits (memory.batch_fits)
        L: safe_on_mac(c, L, subject, config.index_bits, profile, ceiling, mac) for L, c in traced.items()}
    section = PredictionSection(judged, plan_at(traced[length], batch, config.index_bits, profile, mac), batch,
                                length, subject)
    report = {
        "config": dataclasses.asdict(config) | {"batch_size": batch, "max_length": length},
        "release": section.release_json(),
        "profile": profile.to_json(), "model": config.model or EMBEDDED_MODEL, "heads": heads,
        "layers": model_config.num_hidden_layers,
        **section.to_json({"largest_safe_batch": safe_here[length],
                           "largest_safe_batch_by_length": dict(sorted(safe_here.items())),
                           "largest_safe_batch_ceiling": ceiling})}
    if getattr(meta, "padding", ""):  # said as `check` says it: what the trace assumed
        report["padding"] = meta.padding
    if mac is not None:
        report["mac"] = mac.to_json()
    # Where it would be silent instead (on a Mac, --memory's recommendation says it: the demo that fits)
    if section.prediction.stop is not None and not profile.conservative and not config.memory:
        report["silent_sizes"] = silent_sizes(traces, length, positions, heads, config.index_bits, profile, ceiling,
                                              mac)
    if config.backward:
        report["backward_faulting_calls"] = sum(1 for c in section.plan.faults if c.phase == "backward")
    if config.memory:
        report["memory"] = memory_section(config, scenario, traced, model_config, heads, safe, profile, mac)
    if config.versions:
        report["versions"] = version_table(lambda attention: scenario.meta_module(model_config, attention),
                                           batch, length, heads, config.index_bits)
    if config.sweep:
        report["sweep"] = sweep(traced, heads, config.index_bits, profile, mac)
    return PlanReport.of(report)


def safe_on_mac(calls: list, length: int, subject: Subject, index_bits: int, profile: Any, ceiling: int,
                mac: Any) -> int:
    """The largest safe batch at `length` on `mac`: free of faults (its largest buffer among them) and fitting it
    (Note [What fits a Mac] in prediction/memory.py)."""
    found = largest_safe_batch(calls, subject.heads, index_bits, profile, ceiling, mac)
    fits = batch_fits(lambda n: calls_at(calls, n), subject, length, mac, profile, index_bits)
    return cut_to_fit(BoundarySearch(found, ceiling, ""), fits, "batch").largest_safe


@dataclasses.dataclass(frozen=True, eq=False)
class PlanReport(Record):
    """What `plan` concludes (plan.json, and its --json): the release judged, the calls traced and those that fault,
    the prediction, the largest safe batches, the peak memory of a real run and the guard advice; with --memory,
    --versions and --sweep their sections. Made by `build_plan_report`, written by reports.plan."""

    config: dict[str, Any]
    release: ReleaseBlock
    prediction: PredictionBlock
    profile: dict[str, Any] = ABSENT
    model: str = ABSENT
    heads: int = ABSENT
    layers: int = ABSENT
    calls_traced: int = ABSENT
    ops_traced: int = ABSENT
    faulting_calls: list[CallRow] = ABSENT
    largest_safe_batch: int = ABSENT
    largest_safe_batch_by_length: dict[str, int] = ABSENT
    largest_safe_batch_ceiling: int = ABSENT
    estimated_peak_gib: float = ABSENT
    estimated_peak_basis: str = ABSENT
    guard_advice: list[str] = ABSENT
    padding: str = ABSENT
    mac: dict[str, Any] = ABSENT
    silent_sizes: dict[str, Any] = ABSENT
    backward_faulting_calls: int = ABSENT
    memory: dict[str, Any] = ABSENT
    versions: list[VersionRow] = ABSENT
    sweep: dict[str, Any] = ABSENT

    def problem(self) -> str | None:
        batch = self.config.get("batch_size")
        return f"prediction.{said}" if type(batch) is int and (said := self.prediction.disagreement(batch)) else None


def memory_section(config: PlanConfig, scenario: Any, traced: dict, model_config: Any, heads: int,
                   safe: dict, profile: Any, mac: Any) -> dict[str, Any]:
    """--memory: per dtype and length the smallest clearly-visible demo (eager attention, and blocked_eager
    at the longest length), its largest tensor, whether it fits `mac`, the command (or why none, the
    smallest Mac that can, and the emulated run); `safe`: the largest safe batches by the index rules alone."""
    from mpsimpact.attention.blocked import NAME as BLOCKED
    from mpsimpact.prediction.demo_size import (RunAsked, blocked_options, demo_options, mac_table,
                                                product_safe_batch, recommend, working_set_words)

    def trace_blocked(batch: int, length: int) -> Any:
        meta = scenario.meta_module(model_config, BLOCKED)
        return trace_meta(meta, batch, length, index_bits=config.index_bits, profile=profile)

    unmeasured = profile if profile.conservative else None
    if unmeasured is not None:  # nobody can tell what it does: the demo is sized on the published release's rules
        profile = profile_for(PUBLISHED_DEMO_RELEASE)
        safe = {L: largest_safe_batch(c, heads, config.index_bits, profile) for L, c in traced.items()}
    dtypes, takes_blocked = scenario.kind.dtypes, BLOCKED in scenario.kind.attentions  # what `run` takes
    options = demo_options(traced, model_config, heads, safe, config.index_bits, profile, dtypes)
    blocked_safe = 0
    if takes_blocked:
        options += blocked_options(trace_blocked, traced, model_config, heads, config.index_bits, profile, dtypes)
        blocked_safe = product_safe_batch(traced[512], heads, config.index_bits, profile) if 512 in traced else 0
    table = mac_table(model_config, safe.get(512, 0) + 1, traced.get(512, []),
                      blocked_first=blocked_safe + 1 if blocked_safe else None, dtypes=dtypes)
    recommendation = recommend(options, mac, RunAsked(scenario.name, config.model, config.index_bits))
    if unmeasured is not None:
        recommendation["why"] = (
            f"Cannot tell on torch {unmeasured.release}: nobody measured it on MPS, so nobody can tell whether any "
            f"run shows the bug there (`mpsimpact sweep` on a Mac measures it). On torch {PUBLISHED_DEMO_RELEASE}, "
            f"a release measured on Macs where the bug is silent: {recommendation['why']}")
    return {"budget_gib": in_gib(mac.working_set), "basis": working_set_words(mac),
            "largest_buffer_gib": in_gib(mac.largest_buffer), "buffer_basis": mac.source(), "options": options,
            "judged_on": profile.release, "recommendation": recommendation, "mac_table": table}


def sweep(traced: dict, heads: int, index_bits: int, profile: Any, mac=None) -> dict[str, list[dict[str, Any]]]:
    """Predicted corrupted fraction (or stop) over `sweep_batches`, for each table length (on `mac`, with its
    largest buffer)."""
    table = {}
    for length in (L for L in SAFE_TABLE_LENGTHS if L in traced):
        rows = []
        for batch in sweep_batches(heads, index_bits):
            p = predict(plan_at(traced[length], batch, index_bits, profile, mac), batch, heads)
            rows.append({"batch": batch, "corrupted_fraction": p.corrupted_count / batch,
                         "stops": p.stop.fault.kind if p.stop else None})
        table[str(length)] = rows
    return table
