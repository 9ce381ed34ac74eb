"""The runner: turns a RunConfig into one device pass per guard condition, against a CPU
reference, and writes the reports. Scenarios never pick devices or write files; this does."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpsimpact.device import GIB, check_memory, device_memory, resolve_device, resolve_emulation
from mpsimpact.emulator import emulate
from mpsimpact.errors import MemoryPreflightError, OversizedOpError, UsageError
from mpsimpact.guard import guard
from mpsimpact.planner import estimate_peak_bytes, predict, trace_classifier
from mpsimpact.report import SCHEMA_VERSION

GUARDS = ("off", "raise", "chunk")
# Longer sequences run at this length when the full scale does not fit (always on a CPU), with the
# full-scale plan replayed; a power of two, so the wrap period maps exactly (emulator.replay_decision).
REDUCED_LENGTH = 64


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything `mpsimpact run` was asked; embedded in every report."""

    scenario: str = "sentiment"
    batch_size: int | None = None
    steps: int = 1
    lr: float = 1e-4
    max_length: int | None = None
    device: str = "auto"
    emulate: bool | None = None
    guard: str = "all"
    out: str | None = None
    seed: int = 0
    expect: str | None = None
    model: str | None = None
    dataset: str | None = None
    threshold: float = 1e-3
    reference_device: str = "cpu"
    run_length: int | None = None
    index_bits: int = 32

    def validate(self) -> None:
        """Raises UsageError on any bad value, before anything is loaded."""
        for name in ("batch_size", "max_length", "run_length", "steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
        if self.guard not in (*GUARDS, "all"):
            raise UsageError(f"--guard must be one of off, raise, chunk, all; got '{self.guard}'.")
        if self.expect not in (None, "clean", "corrupted"):
            raise UsageError(f"--expect must be clean or corrupted, got '{self.expect}'.")
        if not 8 <= self.index_bits <= 32:
            raise UsageError(f"--index-bits must be in 8..32 (32 is MPS), got {self.index_bits}.")
        if self.reference_device not in ("cpu", "device"):
            raise UsageError(f"--reference-device must be cpu or device, got '{self.reference_device}'.")
        if not 0 < self.threshold < 1:
            raise UsageError(f"--threshold must be in (0, 1), got {self.threshold}.")

    @property
    def guards(self) -> tuple[str, ...]:
        return GUARDS if self.guard == "all" else (self.guard,)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where and at what size the device passes run, and how MPS is (or is not) emulated."""

    device: str
    emulated: bool
    batch_size: int
    max_length: int
    run_length: int
    index_bits: int = 32

    @property
    def replayed(self) -> bool:
        return self.emulated and self.run_length < self.max_length

    @property
    def mode(self) -> str:
        if not self.emulated:
            return "real MPS" if self.device == "mps" else f"{self.device} control (no emulation)"
        scale = f"at reduced length {self.run_length} replaying the full-scale fault plan" if self.replayed else "at full scale"
        return f"EMULATED MPS on {self.device} {scale}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"replayed": self.replayed, "mode": self.mode}


def decide_geometry(config: RunConfig, model: Any, device: str, batch: int, max_length: int) -> Geometry:
    """Picks emulation and the run length; checks memory before anything big is allocated."""
    emulated = resolve_emulation(config.emulate, device)
    if max_length > model.max_positions:
        raise UsageError(f"--max-length {max_length} exceeds the model's {model.max_positions} positions.")
    full = estimate_peak_bytes(model.config, batch, max_length)
    if config.run_length:
        run_length = min(config.run_length, max_length)
    elif device != "cpu" and full <= device_memory(device):
        run_length = max_length
    elif device == "mps" or (not emulated and device != "cpu"):
        raise MemoryPreflightError(
            f"This run needs about {full / GIB:.1f} GiB for attention scores and activations; {device} offers "
            f"{device_memory(device) / GIB:.1f} GiB. Lower --batch-size or --max-length.",
            device=device, needed_bytes=full,
        )
    else:
        run_length = min(max_length, REDUCED_LENGTH)
    geometry = Geometry(device, emulated, batch, max_length, run_length, config.index_bits)
    if geometry.replayed and (max_length & (max_length - 1) or run_length & (run_length - 1)):
        raise UsageError(
            f"--max-length {max_length} cannot be emulated exactly at reduced length {run_length}: the wrap "
            "period must be a whole number of batches, which needs power-of-two lengths. Use a power of two, "
            "or a device with enough memory for the full scale."
        )
    check_memory(
        device, estimate_peak_bytes(model.config, batch, run_length), "one device pass",
        "Lower --batch-size or --max-length, or let mpsimpact scale the geometry (--device cpu).",
    )
    return geometry


def build_batch(texts: tuple[str, ...], labels: tuple[int, ...], batch: int) -> tuple[list[str], np.ndarray, int]:
    """The first `batch` texts in the data's fixed order, repeated if there are too few; returns
    (texts, gold labels, how many positions are repeats)."""
    reps = -(-batch // len(texts))
    picked = (list(texts) * reps)[:batch]
    gold = np.array((list(labels) * reps)[:batch])
    return picked, gold, max(0, batch - len(texts))


@contextlib.contextmanager
def _condition(geometry: Geometry, plan, guard_mode: str, training: bool = False):
    """Emulation (or not) and the guard (or not) for one condition; inference mode unless training."""
    if not geometry.emulated:
        emulation = contextlib.nullcontext(None)
    else:
        emulation = emulate(plan=plan) if geometry.replayed else emulate(index_bits=geometry.index_bits)
    guarding = guard(guard_mode, index_bits=geometry.index_bits) if guard_mode != "off" else contextlib.nullcontext(None)
    with contextlib.nullcontext() if training else torch.inference_mode(), emulation as emu, guarding as g:
        yield emu, g


def device_pass(module, inputs: dict[str, torch.Tensor], geometry: Geometry, plan, guard_mode: str) -> dict[str, Any]:
    """One forward pass of the whole batch under one guard condition."""
    if geometry.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result: dict[str, Any] = {"guard": guard_mode, "status": "completed", "message": None, "logits": None}
    state: dict[str, Any] = {}
    try:
        with _condition(geometry, plan, guard_mode) as (emu, g):
            state.update(emu=emu, guard=g)
            result["logits"] = module(**inputs).float().cpu().numpy()
    except OversizedOpError as error:
        result.update(status="stopped_by_guard", message=str(error))
    except RuntimeError as error:  # MPS's own error, real or emulated
        result.update(status="error", message=str(error).splitlines()[0])
    emu, g = state.get("emu"), state.get("guard")
    result["wall_s"] = time.perf_counter() - start
    if geometry.device == "cuda":
        result["peak_device_memory_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    result["altered_calls"] = [r.to_json() for r in emu.records] if emu else []
    result["guard_calls"] = [r.to_json() for r in (g.stopped + g.chunked)] if g else []
    result["silent_faults_injected"] = len([r for r in (emu.records if emu else []) if r.fault.is_silent])
    if result["status"] != "completed":
        result["wrong_values_before_stop"] = result["silent_faults_injected"]
    return result


def prepare_out_dir(config: RunConfig) -> Path:
    """The final report folder (see report.fresh_out_dir)."""
    from mpsimpact.report import fresh_out_dir

    return fresh_out_dir(config.out, config.scenario)


def tokenize(tokenizer, texts: list[str], geometry: Geometry) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pads every text to the run length; reports which texts a reduced length truncates."""
    enc = tokenizer(texts, truncation=True, max_length=geometry.run_length, padding="max_length", return_tensors="pt")
    lengths = np.array([len(ids) for ids in tokenizer(texts, truncation=False)["input_ids"]])
    reduced = np.flatnonzero((lengths > geometry.run_length) & (geometry.run_length < geometry.max_length))
    stats = {
        "truncated_at_max_length": int((lengths > geometry.max_length).sum()),
        "truncated_by_reduced_length": reduced.tolist(),
        "truncated_by_reduced_length_fraction": reduced.size / len(texts),
        "mean_tokens": float(lengths.mean()),
    }
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, stats


def reference_logits(model, texts: list[str], run_length: int, advance=None) -> tuple[np.ndarray, bool]:
    """CPU fp32 reference at the run length, from the on-disk cache when present."""
    from mpsimpact import reference

    key = reference.cache_key(reference.model_fingerprint(model.module), texts, run_length)
    cached = reference.cached_reference(key)
    if cached is not None:
        return cached, True
    logits = reference.run_chunked(model.module, model.tokenizer, texts, run_length, advance=advance)
    reference.store_reference(key, logits)
    return logits, False


def device_reference(model, texts: list[str], run_length: int, device: str, boundary: int | None, advance=None) -> tuple[np.ndarray, dict]:
    """A chunked, unemulated reference on the device itself (for big GPUs), spot-checked on the
    CPU on a sample that includes the texts around the predicted boundary."""
    from mpsimpact.metrics import relative_error
    from mpsimpact.reference import run_chunked

    logits = run_chunked(model.module, model.tokenizer, texts, run_length, advance=advance, device=device)
    rng = np.random.default_rng(0)
    around = range(max(0, (boundary or 0) - 8), min(len(texts), (boundary or 0) + 8))
    sample = sorted(set(around) | set(rng.choice(len(texts), size=min(48, len(texts)), replace=False).tolist()))
    cpu = run_chunked(model.module.to("cpu"), model.tokenizer, [texts[i] for i in sample], run_length)
    model.module.to(device)
    diff = relative_error(logits[sample], cpu)
    return logits, {"texts": len(sample), "includes_boundary": boundary is not None, "max_relative_difference": float(diff.max())}


def model_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the model's largest ModuleList (its transformer layers)."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len, default=[]))


@contextlib.contextmanager
def layer_progress(layers: list[torch.nn.Module], advance):
    """Advances a progress bar as each layer finishes its forward."""
    handles = [layer.register_forward_hook(lambda *_: advance(1)) for layer in layers] if advance else []
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _no_progress(description: str, total: int):
    return None


def run_scenario(config: RunConfig, progress=_no_progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """Runs every guard condition of `config`; returns (report, arrays for samples and figures).

    `progress(description, total)` returns a callable that advances that task (or None).
    """
    from mpsimpact.environment import collect_environment
    from mpsimpact.scenario import get_scenario

    config.validate()
    scenario_cls = get_scenario(config.scenario)
    device = resolve_device(config.device)
    scenario = scenario_cls(model=config.model, dataset=config.dataset)
    batch = config.batch_size or scenario_cls.default_batch_size
    max_length = config.max_length or scenario_cls.default_max_length
    torch.manual_seed(config.seed)
    scenario.load()
    model = scenario.model
    geometry = decide_geometry(config, model, device, batch, max_length)
    training = getattr(scenario_cls, "training", False)
    plan = trace_classifier(scenario.meta_module(), batch, max_length, index_bits=config.index_bits, backward=training)
    prediction = predict(plan, batch, model.heads)
    if training:
        from mpsimpact.training import run_training

        body, arrays = run_training(config, scenario, model, geometry, plan, progress)
        body["backward_prediction"] = predict(plan, batch, model.heads, "backward").to_json()
    else:
        body, arrays = run_inference(config, scenario, model, geometry, plan, prediction, progress)
    report = {
        "schema_version": SCHEMA_VERSION,
        "kind": "training" if training else "inference",
        "config": dataclasses.asdict(config) | {"batch_size": batch, "max_length": max_length},
        "environment": collect_environment(),
        "geometry": geometry.to_json(),
        "model": model.name,
        "label_names": list(model.label_names),
        "data_source": scenario.data.source,
        "prediction": prediction.to_json(),
        **body,
    }
    report["notes"] = run_notes(geometry, report["repeated_texts"], report["tokens"])
    return report, arrays


def run_inference(config: RunConfig, scenario, model, geometry: Geometry, plan, prediction, progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """One forward pass per guard condition against the reference; returns (report body, arrays)."""
    from mpsimpact.metrics import relative_error, summarize

    device = geometry.device
    texts, gold, repeats = build_batch(scenario.data.texts, scenario.data.labels, geometry.batch_size)
    inputs, token_stats = tokenize(model.tokenizer, texts, geometry)
    reference_info: dict[str, Any] = {"device": "cpu", "dtype": "float32"}
    if config.reference_device == "device" and device != "cpu":
        model.module.to(device)
        ref, spot = device_reference(model, texts, geometry.run_length, device, prediction.first_corrupted_text, progress(f"reference ({device}, chunked)", len(texts)))
        reference_info.update(device=device, cached=False, cpu_spot_check=spot)
    else:
        ref, cached = reference_logits(model, texts, geometry.run_length, progress("reference (CPU fp32)", len(texts)))
        reference_info["cached"] = cached
    reference_info["accuracy"] = float((ref.argmax(1) == gold).mean())
    module = model.module.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    conditions, arrays = [], {"reference": ref, "gold": gold, "texts": texts, "errors": {}, "preds": {}}
    layers = model_layers(module)
    for guard_mode in config.guards:
        if would_abort(geometry, prediction, guard_mode):
            conditions.append(skipped_abort(guard_mode, prediction))
            continue
        with layer_progress(layers, progress(f"device pass on {device}, guard {guard_mode} (layers)", len(layers))):
            result = device_pass(module, inputs, geometry, plan, guard_mode)
        logits = result.pop("logits")
        result["predicted_first_corrupted_index"] = prediction.first_corrupted_text
        if logits is not None:
            result.update(summarize(logits, ref, gold, model.label_names, config.threshold))
            arrays["errors"][guard_mode] = relative_error(logits, ref)
            arrays["preds"][guard_mode] = logits.argmax(axis=1)
            arrays.setdefault("logits", {})[guard_mode] = logits
        conditions.append(result)
    return {"repeated_texts": repeats, "tokens": token_stats, "reference": reference_info, "conditions": conditions}, arrays


def would_abort(geometry: Geometry, prediction, guard_mode: str) -> bool:
    """On real MPS an unguarded call the plan says aborts would kill this process (and the report)."""
    stop = prediction.stop
    return geometry.device == "mps" and not geometry.emulated and guard_mode == "off" and stop is not None and stop.fault.kind == "abort"


def skipped_abort(guard_mode: str, prediction) -> dict[str, Any]:
    call = prediction.stop
    return {
        "guard": guard_mode, "status": "skipped_predicted_abort", "wall_s": 0.0,
        "predicted_first_corrupted_index": prediction.first_corrupted_text,
        "message": f"not run: {call.describe()} ({call.out_numel} output elements) would abort the process on MPS "
                   f"({call.fault.message}); see `mpsimpact plan`.",
    }


def run_notes(geometry: Geometry, repeats: int, token_stats: dict[str, Any]) -> list[str]:
    notes = [geometry.mode + "."]
    if geometry.index_bits != 32:
        notes.append(f"Index width {geometry.index_bits} bits instead of MPS's 32: every threshold scaled by 2^{32 - geometry.index_bits}.")
    if geometry.emulated:
        notes.append("No Apple GPU was used: MPS's faults were emulated from the published fault model (rule set B, torch 2.13/2.14).")
    if geometry.replayed:
        reduced = token_stats["truncated_by_reduced_length"]
        notes.append(
            f"Texts run at {geometry.run_length} tokens with the fault plan traced at {geometry.max_length}; "
            f"{len(reduced)} texts ({token_stats['truncated_by_reduced_length_fraction']:.2%}) are longer than "
            f"{geometry.run_length} tokens and were truncated by the reduction (positions {reduced[:20]})."
        )
    if repeats:
        notes.append(f"The data has fewer texts than the batch: {repeats} positions repeat earlier texts.")
    return notes
