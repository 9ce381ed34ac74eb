"""The runner: turns a RunConfig into the scenario's kind of run (see runs.kind.RunKind), one device
pass per guard condition against a reference, and the report. Scenarios never pick devices; this does."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from typing import Any

import torch

from mpsimpact.attention.blocked import NAME as BLOCKED, REASON
from mpsimpact.runs.device import resolve_device
from mpsimpact.config import RunConfig, batch_ceiling
from mpsimpact.prediction.demo_size import power_lengths, quick_geometry, quick_words, silent_sizes
from mpsimpact.prediction.outcome import PredictionSection, Subject, guard_advice
from mpsimpact.prediction.meta_model import heads_of, trace_meta, usable_positions
from mpsimpact.prediction.safe_size import PerTextTraces
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.engine.release import PUBLISHED_DEMO_RELEASE, STUDY, judge_release, profile_for
from mpsimpact.runs.kind import SCHEMA_VERSION
from mpsimpact.runs.device_pass import Geometry, decide_geometry

def run_scenario(config: RunConfig,
                 progress=lambda description, total: None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs every guard condition of `config` as the scenario's kind of run; returns (report, arrays
    for samples and figures).

    `progress(description, total)` returns a callable that advances that task (or None).
    """
    from mpsimpact.runs.scenario import get_scenario

    device = check_run(config)
    release = judge_release(config.torch_profile)  # once, here: the value travels down
    scenario_cls = get_scenario(config.scenario)
    scenario = scenario_cls(model=config.model, dataset=config.dataset)
    kind = scenario.kind
    mac = run_mac(config, device)
    shapes = ModelShapes(scenario, config.attentions[0], config, kind.backward, mac)
    config, chosen = quick_config(config, shapes, release.profile) if config.quick_sizes else (config, "")
    batch = config.batch_size or scenario_cls.default_batch_size
    max_length = config.max_length or scenario_cls.default_max_length
    torch.manual_seed(config.seed)
    scenario.load()
    model = scenario.model
    geometry = dataclasses.replace(decide_geometry(config, model, device, batch, max_length, kind.backward),
                                   profile=release.profile, dtype=config.dtype, mac=mac)
    # Traced in the run's dtype: the guard names the call as it runs, and 2.4.1's output rule depends on it. On a
    # Mac every op is traced (a tensor of few elements can still reach a small Mac's largest buffer).
    dtype = getattr(torch, config.dtype)
    metas = {a: scenario.meta_module(attention=a).to(dtype) for a in geometry.attentions}
    plans = {a: trace_meta(meta, batch, max_length, index_bits=config.index_bits, backward=kind.backward,
                           profile=release.profile, every_op=mac is not None, allocations=mac is not None).on_mac(mac)
             for a, meta in metas.items()}
    subject = Subject.of_module(metas[geometry.attentions[0]], model.heads, shapes.model_config.hidden_size,
                                backward=kind.backward)  # the model as plan knows it: its peak, its advice
    sections = {a: PredictionSection(release, plan, batch, max_length, subject) for a, plan in plans.items()}
    first = sections[geometry.attentions[0]]
    if geometry.emulated:
        refuse_past_watermark(config, first, batch, max_length)
    body, arrays = kind.run(config, scenario, model, geometry, sections, progress)
    report = report_head(config, scenario, kind.name, geometry, sections, batch, max_length) | body
    report["release"] = first.release_json()
    report["guard_advice"] = guard_advice(first.decided, batch, first.subject)  # as plan's and check's
    if mac is not None:
        report["mac"] = mac.to_json()
    report["columns"] = [list(pair) for pair in kind.table_columns({"conditions": report["conditions"]})]
    said = [chosen] if chosen else []
    if (sizes := where_silent(first, shapes, config, geometry)) is not None:
        report["silent_sizes"] = sizes
        said.append(sizes["sentence"])
    report["notes"] = run_notes(geometry, report["repeated_texts"], report["tokens"], said)
    return report, arrays


def refuse_past_watermark(config: RunConfig, section: PredictionSection, batch: int, length: int) -> None:
    """Refuses, before a tensor is made, an emulated run that the Mac declared would stop past its high watermark
    ("MPS backend out of memory": Note [What fits a Mac]). The emulator holds each tensor to the Mac's largest
    buffer, but it cannot know a Mac's total: only the run's estimated peak does, so the run says what MPS would do
    rather than show values that Mac never returns."""
    from mpsimpact.engine.mac_memory import WATERMARK_RULE
    from mpsimpact.errors import MemoryPreflightError
    from mpsimpact.prediction.memory import run_peak

    plan = section.decided
    stop = next((c for c in plan.calls if c.fault.rule == WATERMARK_RULE), None)
    if stop is None:
        return
    peak = run_peak(plan.calls, section.subject, batch, length)[0]
    mac = plan.mac
    raise MemoryPreflightError(
        f"On {mac.label} this run needs about {peak / 2**30:.1f} GiB in all (an estimate of its peak), more than "
        f"the {mac.high_watermark / 2**30:.1f} GiB MPS lets a process hold there, so MPS would stop it with "
        f"'{stop.fault.message}' at call {stop.index} ({stop.op} in {stop.module or 'the model'}), before any "
        f"output and whatever the guard; nothing was run. Lower --batch-size or --max-length: `"
        f"{config.plan_command('--memory', str(config.memory), '--max-length', str(length))}` shows the largest "
        "batch that fits.")


def check_run(config: RunConfig, given: Any = None) -> str:
    """Everything a run can be refused for before any work (the command calls it before it claims --out;
    `run_scenario` again): each option's value, the options its scenario's kind does not read (`given`: the
    fields the command line gave; see RunKind.check), --run-length against the length the run will have, the
    device and its emulation, and --memory where this Mac's own memory counts. Returns the device.

    Raises:
        UsageError: one line naming the option and why.
    """
    from mpsimpact.config import check_run_length
    from mpsimpact.engine.mac_memory import is_auto
    from mpsimpact.errors import UsageError
    from mpsimpact.runs.device import resolve_emulation
    from mpsimpact.runs.scenario import get_scenario

    config.validate()
    scenario_cls = get_scenario(config.scenario)
    scenario_cls.kind.check(config, given)
    check_run_length(config.run_length, config.max_length or scenario_cls.default_max_length)
    device = resolve_device(config.device)
    emulated = resolve_emulation(config.emulate, device)
    if device == "mps" and not emulated and config.memory is not None and not is_auto(config.memory):
        raise UsageError("--memory declares another Mac for an emulated run; on this Mac's GPU its own memory "
                         "counts (`mpsimpact doctor` measures it). Drop --memory, or add --device cpu.",
                         option="--memory")
    if device != "mps" and not emulated and config.memory is not None:
        raise UsageError(f"--memory emulates a Mac's memory, and this run on {device} is not emulated (--no-emulate): "
                         "nothing would hold a tensor to that Mac's largest buffer. Drop --memory or --no-emulate.",
                         option="--memory")
    return device


def where_silent(section: PredictionSection, shapes: ModelShapes, config: RunConfig,
                 geometry: Geometry) -> dict[str, Any] | None:
    """Where a run predicted to stop (an abort or an error, at any call) would show the silent effect instead
    (demo_size.silent_sizes, at the run's length and index width first); None where it does not stop, or on a
    release nobody measured (nobody can tell where it is silent)."""
    profile = section.release.profile
    if section.prediction.stop is None or profile.conservative:
        return None
    if shapes.attention != geometry.attentions[0]:  # blocked_eager where eager would not fit this Mac
        shapes = ModelShapes(shapes.scenario, geometry.attentions[0], config, shapes.backward, shapes.mac)
    return silent_sizes(shapes.traces(profile), geometry.max_length, shapes.positions, shapes.heads,
                        config.index_bits, profile, batch_ceiling(geometry.batch_size), shapes.mac)


class ModelShapes:
    """The scenario's model as one attention traces it on meta in the run's dtype: its heads, its usable length
    and its per-text calls at any length under a release's rules (each traced when first asked), for --quick's
    geometry and the sizes that show the silent effect (prediction.demo_size). Nothing is read before it is
    asked."""

    def __init__(self, scenario: Any, attention: str, config: RunConfig, backward: bool, mac: Any) -> None:
        self.scenario, self.attention, self.dtype = scenario, attention, getattr(torch, config.dtype)
        self.backward, self.mac = backward, mac
        self._traces: dict[str, PerTextTraces] = {}

    @functools.cached_property
    def model_config(self) -> Any:
        return self.scenario.load_config()

    @property
    def heads(self) -> int:
        return heads_of(self.model_config)

    @property
    def positions(self) -> int:
        return usable_positions(self.model_config)

    def traces(self, profile: Any) -> PerTextTraces:
        """The per-text calls at any length as `profile`'s release makes them (safe_size.PerTextTraces)."""
        if profile.ref not in self._traces:
            meta = self.scenario.meta_module(self.model_config, attention=self.attention).to(self.dtype)
            self._traces[profile.ref] = PerTextTraces(meta, backward=self.backward, allocations=self.mac is not None,
                                                      profile=profile)
        return self._traces[profile.ref]


def quick_config(config: RunConfig, shapes: ModelShapes, judged: Any) -> tuple[RunConfig, str]:
    """--quick for this model: the config with the geometry that shows the silent effect (demo_size.quick_geometry:
    the sizes it set, QUICK's, where they do; else chosen among those not given), and what it chose in words ("" where
    it kept them). Sized on the `judged` release's rules, else (none is silent there, or nobody measured it) on the
    published demo's release, where the bug is silent: the quick runs of one model on two releases compare."""
    if None in (config.batch_size, config.max_length):
        return config, ""
    if config.max_length > shapes.positions:  # a model of fewer positions: at most its own, or refused as given
        if "max_length" not in config.quick_sizes:
            return config, ""  # decide_geometry says so, as for any run
        longest = max(power_lengths(shapes.positions), default=shapes.positions)
        config = dataclasses.replace(config, max_length=longest)
    asked, published = (config.batch_size, config.max_length, config.index_bits), profile_for(PUBLISHED_DEMO_RELEASE)
    rules = [] if judged.conservative else [judged]
    rules += [published] if published.ref != judged.ref else []
    chosen, at_asked, profile = None, None, judged
    for profile in rules:
        chosen, at_asked = quick_geometry(shapes.traces(profile), asked, set(config.quick_sizes), shapes.positions,
                                          shapes.heads, profile, shapes.mac)
        if chosen is not None:
            break
    words = quick_words(asked, chosen, at_asked, judged, profile)
    if chosen is None or chosen == asked:
        return config, words
    batch, length, bits = chosen
    return dataclasses.replace(config, batch_size=batch, max_length=length, index_bits=bits), words


def run_mac(config: RunConfig, device: str) -> Any:
    """The Mac whose largest buffer the run meets (engine.mac_memory.MacMemory), or None: --memory's for an
    emulated run; on a Mac's own GPU, that Mac's (measured by `mpsimpact doctor`, else assumed)."""
    from mpsimpact.engine.mac_memory import this_mac
    from mpsimpact.engine.release import cache_root

    if device == "mps" and not config.emulate:  # --memory other than auto is refused there (check_run)
        return this_mac(cache_root())
    return config.mac


def report_head(config: RunConfig, scenario, kind_name: str, geometry: Geometry, sections: dict, batch: int,
                max_length: int) -> dict[str, Any]:
    """What every run report starts with: config, environment, geometry, model, data and the predictions."""
    from mpsimpact.runs.environment import collect_environment

    model = scenario.model
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind_name,
        "config": dataclasses.asdict(config) | {"batch_size": batch, "max_length": max_length},
        "environment": collect_environment(sections[geometry.attentions[0]].release.installed),
        "geometry": geometry.to_json(),
        "model": model.name,
        "label_names": list(model.label_names),
        "data_source": scenario.data.source,
        "prediction": sections[geometry.attentions[0]].prediction_json(),
        "predictions": {a: section.prediction_json() for a, section in sections.items()},
        "versions": version_rows(scenario, model, batch, max_length, config.index_bits),
    }


def version_rows(scenario, model, batch: int, length: int, index_bits: int) -> list[dict[str, Any]]:
    """The version table at this run's full-scale geometry (see versions.version_table). It follows from the
    scenario's model config and the geometry alone (four meta traces), so a process that runs the same
    scenario and geometry again (a notebook, the tests) reuses it."""
    from mpsimpact.prediction.version_table import version_table

    try:
        key = (scenario.name, model.name, json.dumps(model.config.to_dict(), sort_keys=True, default=str),
               batch, length, model.heads, index_bits)
    except (AttributeError, TypeError):
        key = None
    rows = _VERSION_ROWS.get(key) if key is not None else None
    if rows is None:
        rows = version_table(lambda a: scenario.meta_module(attention=a), batch, length, model.heads, index_bits)
        if key is not None:
            if len(_VERSION_ROWS) >= 8:
                _VERSION_ROWS.pop(next(iter(_VERSION_ROWS)))
            _VERSION_ROWS[key] = rows
    return copy.deepcopy(rows)


_VERSION_ROWS: dict[tuple[Any, ...], list[dict[str, Any]]] = {}


def run_notes(geometry: Geometry, repeats: int, token_stats: dict[str, Any], said: list[str] = ()) -> list[str]:
    """The report's notes: the mode, then `said` (what --quick chose, where the effect would be silent), then how
    the run differs from MPS at full scale."""
    notes = [geometry.mode + ".", *said]
    if geometry.substituted:
        notes.append(f"{geometry.substituted[0].upper()}{geometry.substituted[1:]}.")
    elif BLOCKED in geometry.attentions:
        notes.append(f"{BLOCKED} attention: {REASON}.")
    if geometry.index_bits != MPS_INDEX_BITS:
        notes.append(f"Index width {geometry.index_bits} bits instead of MPS's {MPS_INDEX_BITS}: every threshold "
                     f"scaled by 2^{MPS_INDEX_BITS - geometry.index_bits}.")
    if geometry.mac is not None:
        notes.append(f"{geometry.mac.describe()} A tensor that reaches the buffer stops the run with MPS's "
                     "'Invalid buffer size', whatever the guard.")
    if geometry.emulated:
        profile = geometry.profile
        origin = "the published fault model" if profile.source == STUDY else "a profile measured by a sweep"
        notes.append(f"No Apple GPU was used: MPS's faults were emulated from {origin} for torch "
                     f"{profile.label}.")
    if geometry.replayed:
        notes.append(f"Texts run at {geometry.run_length} tokens, each call faulting as it does at "
                     f"{geometry.max_length} tokens; {truncated_words(token_stats, geometry.run_length)}.")
    if repeats:
        notes.append(f"The data has fewer texts than the batch: {repeats} positions repeat earlier texts.")
    return notes


def truncated_words(token_stats: dict[str, Any], run_length: int, shown: int = 20) -> str:
    """Which texts the reduced length cut, in words: none said as none, a count with its items (the first
    `shown` of them, said so)."""
    reduced = token_stats["truncated_by_reduced_length"]
    if not reduced:
        return f"no text is longer than {run_length} tokens, so the reduction cut none"
    listed = ", ".join(map(str, reduced[:shown]))
    which = f"positions {listed}" if len(reduced) <= shown else f"the first {shown} at positions {listed}"
    texts = "1 text" if len(reduced) == 1 else f"{len(reduced)} texts"
    return (f"{texts} ({token_stats['truncated_by_reduced_length_fraction']:.2%}) longer than {run_length} tokens "
            f"{'was' if len(reduced) == 1 else 'were'} cut by the reduction ({which})")
