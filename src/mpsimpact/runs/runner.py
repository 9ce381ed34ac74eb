"""The runner: turns a RunConfig into the scenario's kind of run (see runs.kind.RunKind), one device
pass per guard condition against a reference, and the report. Scenarios never pick devices; this does."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import time
from typing import Any

import numpy as np
import torch

from mpsimpact.blocked_attention import NAME as BLOCKED, REASON, samples_per_block, transformer_layers
from mpsimpact.config import GIB
from mpsimpact.runs.device import resolve_device
from mpsimpact.errors import NotEmulatedError, OversizedOpError
from mpsimpact.config import RunConfig
from mpsimpact.prediction.outcome import on_a_mac, predict, site
from mpsimpact.prediction.safe_size import trace_classifier
from mpsimpact.engine.release import STUDY, judge_release, resolve_profile
from mpsimpact.runs.kind import SCHEMA_VERSION, columns_of, condition_key
from mpsimpact.runs.device_pass import Geometry, condition

def device_pass(module, inputs: dict[str, torch.Tensor], geometry: Geometry, plan,
                guard_mode: str) -> dict[str, Any]:
    """One forward pass of the whole batch under one guard condition."""
    if geometry.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result: dict[str, Any] = {"guard": guard_mode, "status": "completed", "message": None, "logits": None}
    if geometry.attention != "eager":
        result["attention"] = geometry.attention
    state: dict[str, Any] = {}
    try:
        with condition(geometry, plan, guard_mode) as (emu, g):
            state.update(emu=emu, guard=g)
            result["logits"] = module(**inputs).float().cpu().numpy()
    except OversizedOpError as error:
        result.update(status="stopped_by_guard", message=str(error))
    except NotEmulatedError as error:  # wrong on MPS, but nobody characterised the values
        result.update(status="not_emulated", message=error.message)
    except RuntimeError as error:  # MPS's own error, real or emulated
        result.update(status="error", message=str(error).splitlines()[0])
    emu, g = state.get("emu"), state.get("guard")
    result["wall_s"] = time.perf_counter() - start
    stopped_at = (g.stopped[-1] if result["status"] == "stopped_by_guard" and g and g.stopped else
                  emu.records[-1] if result["status"] in ("error", "not_emulated") and emu and emu.records else None)
    if stopped_at is not None:  # in a speaker's words, and whether anybody measured it (headlines read these)
        result["where"] = site(stopped_at)
        result["unmeasured"] = stopped_at.fault.nobody_measured
    if geometry.device == "cuda":
        result["peak_device_memory_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    result["altered_calls"] = [r.to_json() for r in emu.records] if emu else []
    result["guard_calls"] = [r.to_json() for r in (g.stopped + g.chunked)] if g else []
    result["silent_faults_injected"] = sum(r.fault.is_silent for r in (emu.records if emu else []))
    if result["status"] != "completed":
        result["wrong_values_before_stop"] = result["silent_faults_injected"]
    return result


def reference_logits(model, texts: list[str], run_length: int, advance=None) -> tuple[np.ndarray, bool]:
    """CPU fp32 reference at the run length, from the on-disk cache when present (an entry of another shape
    than these texts by this model's labels is damage: removed and recomputed)."""
    from mpsimpact.runs import reference

    key = reference.cache_key(reference.model_fingerprint(model.module), texts, run_length)
    cached = reference.cached_reference(key, shape=(len(texts), len(model.label_names)))
    if cached is not None:
        return cached, True
    logits = reference.run_chunked(model.module, model.tokenizer, texts, run_length, advance=advance)
    reference.store_reference(key, logits)
    return logits, False


def device_reference(model, texts: list[str], run_length: int, device: str, boundary: int | None,
                     advance=None) -> tuple[np.ndarray, dict]:
    """A chunked, unemulated reference on the device itself (for big GPUs), spot-checked on the
    CPU on a sample that includes the texts around the predicted boundary."""
    from mpsimpact.runs.metrics import relative_error
    from mpsimpact.runs.reference import run_chunked

    logits = run_chunked(model.module, model.tokenizer, texts, run_length, advance=advance, device=device)
    around = range(max(0, (boundary or 0) - 8), min(len(texts), (boundary or 0) + 8))
    drawn = np.random.default_rng(0).choice(len(texts), size=min(48, len(texts)), replace=False).tolist()
    sample = sorted(set(around) | set(drawn))
    cpu = run_chunked(model.module.to("cpu"), model.tokenizer, [texts[i] for i in sample], run_length)
    model.module.to(device)
    return logits, {"texts": len(sample), "includes_boundary": boundary is not None,
                    "max_relative_difference": float(relative_error(logits[sample], cpu).max())}


@contextlib.contextmanager
def layer_progress(layers: list[torch.nn.Module], advance):
    """Advances a progress bar as each layer finishes its forward."""
    handles = [layer.register_forward_hook(lambda *_: advance(1)) for layer in layers] if advance else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_scenario(config: RunConfig,
                 progress=lambda description, total: None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs every guard condition of `config` as the scenario's kind of run; returns (report, arrays
    for samples and figures).

    `progress(description, total)` returns a callable that advances that task (or None).
    """
    from mpsimpact.runs.scenario import get_scenario

    config.validate()
    scenario_cls = get_scenario(config.scenario)
    device = resolve_device(config.device)
    scenario = scenario_cls(model=config.model, dataset=config.dataset)
    kind = scenario.kind
    batch = config.batch_size or scenario_cls.default_batch_size
    max_length = config.max_length or scenario_cls.default_max_length
    kind.check(config)
    release = judge_release(config.torch_profile, apple_gpu=torch.backends.mps.is_available())
    torch.manual_seed(config.seed)
    scenario.load()
    model = scenario.model
    geometry = dataclasses.replace(kind.geometry(config, model, device, batch, max_length),
                                   profile=release.profile.ref, dtype=config.dtype)
    # Traced in the run's dtype: the guard names the call as it runs, and 2.4.1's output rule depends on it.
    dtype = getattr(torch, config.dtype)
    plans = {a: trace_classifier(scenario.meta_module(attention=a).to(dtype), batch, max_length,
                                 index_bits=config.index_bits, backward=kind.backward,
                                 profile=geometry.profile) for a in geometry.attentions}
    body, arrays = kind.run(config, scenario, model, geometry, plans, progress)
    report = report_head(config, scenario, kind.name, geometry, plans, batch, max_length) | body
    installed = predict(plans[geometry.attentions[0]].under(release.installed), batch, model.heads)
    report["release"] = release.to_json() | {"on_a_mac": on_a_mac(release, installed)}
    report["columns"] = [list(pair) for pair in columns_of(kind, report["conditions"])]
    report["notes"] = run_notes(geometry, report["repeated_texts"], report["tokens"])
    return report, arrays


def report_head(config: RunConfig, scenario, kind_name: str, geometry: Geometry, plans: dict, batch: int,
                max_length: int) -> dict[str, Any]:
    """What every run report starts with: config, environment, geometry, model, data and the predictions."""
    from mpsimpact.runs.environment import collect_environment

    model = scenario.model
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind_name,
        "config": dataclasses.asdict(config) | {"batch_size": batch, "max_length": max_length},
        "environment": collect_environment(),
        "geometry": geometry.to_json(),
        "model": model.name,
        "label_names": list(model.label_names),
        "data_source": scenario.data.source,
        "prediction": predict(plans[geometry.attentions[0]], batch, model.heads).to_json(),
        "predictions": {a: predict(p, batch, model.heads).to_json() for a, p in plans.items()},
        "versions": version_rows(scenario, model, batch, max_length, config.index_bits),
    }


def run_conditions(config: RunConfig, module, inputs, geometry: Geometry, plans: dict, heads: int, progress):
    """Every condition, attention implementation by guard mode: yields (key, result); the module is
    back on eager attention afterwards."""
    from mpsimpact.models.classifier import use_attention

    for attention, plan in plans.items():
        use_attention(module, attention, samples_per_block(heads, geometry.max_length))  # as the plan's trace
        prediction = predict(plan, geometry.batch_size, heads)
        geo = dataclasses.replace(geometry, attention=attention)
        for guard_mode in config.guards:
            yield condition_key(attention, guard_mode), condition_pass(
                module, inputs, geo, plan, prediction, guard_mode, progress)
    use_attention(module, "eager")


def condition_pass(module, inputs, geometry: Geometry, plan, prediction, guard_mode: str,
                   progress) -> dict[str, Any]:
    """One guard condition's device pass with a per-layer progress bar (or its predicted abort, skipped)."""
    if would_abort(geometry, prediction, guard_mode):
        return skipped_abort(guard_mode, prediction)
    layers = transformer_layers(module)
    label = f"device pass on {geometry.device}, {geometry.attention} attention, guard {guard_mode} (layers)"
    with layer_progress(layers, progress(label, len(layers))):
        result = device_pass(module, inputs, geometry, plan, guard_mode)
    result["predicted_first_corrupted_index"] = prediction.first_corrupted_text
    return result


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


def would_abort(geometry: Geometry, prediction, guard_mode: str) -> bool:
    """On real MPS an unguarded call the plan says aborts would kill this process (and the report)."""
    stop = prediction.stop
    return (geometry.device == "mps" and not geometry.emulated and guard_mode == "off"
            and stop is not None and stop.fault.kind == "abort")


def skipped_abort(guard_mode: str, prediction) -> dict[str, Any]:
    call = prediction.stop
    return {
        "guard": guard_mode, "status": "skipped_predicted_abort", "wall_s": 0.0, "where": site(call),
        "unmeasured": call.fault.nobody_measured,
        "predicted_first_corrupted_index": prediction.first_corrupted_text,
        "message": f"not run: {call.describe()} ({call.out_numel} output elements) would abort the process "
                   f"on MPS ({call.fault.message}); see `mpsimpact plan`.",
    }


def run_notes(geometry: Geometry, repeats: int, token_stats: dict[str, Any]) -> list[str]:
    notes = [geometry.mode + "."]
    if geometry.substituted:
        notes.append(f"{geometry.substituted[0].upper()}{geometry.substituted[1:]}.")
    elif BLOCKED in geometry.attentions:
        notes.append(f"{BLOCKED} attention: {REASON}.")
    if geometry.index_bits != 32:
        notes.append(f"Index width {geometry.index_bits} bits instead of MPS's 32: every threshold scaled by "
                     f"2^{32 - geometry.index_bits}.")
    if geometry.emulated:
        release = resolve_profile(geometry.profile or None)
        origin = "the published fault model" if release.source == STUDY else "a profile measured by a sweep"
        notes.append(f"No Apple GPU was used: MPS's faults were emulated from {origin} for torch "
                     f"{release.label}.")
    if geometry.replayed:
        reduced = token_stats["truncated_by_reduced_length"]
        notes.append(f"Texts run at {geometry.run_length} tokens with the fault plan traced at "
                     f"{geometry.max_length}; {len(reduced)} texts "
                     f"({token_stats['truncated_by_reduced_length_fraction']:.2%}) are longer than "
                     f"{geometry.run_length} tokens and were truncated by the reduction (positions "
                     f"{reduced[:20]}).")
    if repeats:
        notes.append(f"The data has fewer texts than the batch: {repeats} positions repeat earlier texts.")
    return notes
