"""The device passes: the batch (texts, tokens), its geometry (device, emulation, run length, checked
against memory before anything big is allocated), the emulation-and-guard condition, and one pass per
condition (or its predicted abort, skipped). Shared by the kinds and the training steps."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import numpy as np
import torch

from mpsimpact.attention.blocked import NAME as BLOCKED, REASON, samples_per_block, transformer_layers
from mpsimpact.engine.faults import MPS_INDEX_BITS
from mpsimpact.engine.mac_memory import BUFFER_RULE
from mpsimpact.config import GIB, check_run_length
from mpsimpact.runs.device import check_memory, device_memory, resolve_emulation
from mpsimpact.modes.emulator import emulate
from mpsimpact.errors import MemoryPreflightError, NotEmulatedError, OversizedOpError, UsageError
from mpsimpact.prediction.memory import (TRAINING_PARTS, estimate_peak_bytes, estimate_training_bytes,
                                         largest_fitting_batch)
from mpsimpact.modes.guard import guard
from mpsimpact.prediction.demo_size import DTYPE_BYTES
from mpsimpact.prediction.outcome import site
from mpsimpact.runs.kind import condition_key

# Longer sequences run at this length when the full scale does not fit (always on a CPU), with the
# full-scale plan replayed; a power of two, so the wrap period maps exactly (emulator.replay_decision).
REDUCED_LENGTH = 64


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where and at what size the device passes run, and how MPS is (or is not) emulated."""

    device: str
    emulated: bool
    batch_size: int
    max_length: int
    run_length: int
    index_bits: int = MPS_INDEX_BITS
    profile: Any = None  # the FaultProfile emulated (or guarded and planned); None: the installed torch's
    attention: str = "eager"  # the attention implementation of the pass
    dtype: str = "float32"  # the device passes' dtype
    attentions: tuple[str, ...] = ("eager",)  # the implementations the run compares, one pass set each
    substituted: str = ""  # why `attentions` are not those asked (blocked_eager where eager would not fit)
    mac: Any = dataclasses.field(default=None, compare=False, repr=False)  # the Mac (MacMemory) emulated, or None

    @property
    def replayed(self) -> bool:
        return self.emulated and self.run_length < self.max_length

    @property
    def mode(self) -> str:
        from mpsimpact.engine.release import installed_profile
        from mpsimpact.output.page import EMULATED_LABEL

        profile = self.profile if self.profile is not None else installed_profile()
        if not self.emulated:
            if self.device != "mps":
                return f"{self.device} control (no emulation)"
            other = profile.release != installed_profile().release
            planned = f", guarded and planned as torch {profile.label}" if other else ""
            return f"real MPS (torch {installed_profile().label}){planned}"
        narrowed = self.index_bits != MPS_INDEX_BITS  # a narrowed index: no size here is MPS's full scale
        scale = (f"with texts of {self.run_length} tokens standing for {self.max_length}" if self.replayed
                 else "at full length" if narrowed else "at full scale")
        scale += f", at a {self.index_bits}-bit index" if narrowed else ""
        precision = "" if self.dtype == "float32" else f", {self.dtype}"
        return f"{EMULATED_LABEL} (torch {profile.label}) on {self.device} {scale}{precision}"

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mac"}
        fields["profile"] = self.profile.ref if self.profile is not None else ""  # report.json keeps its ref
        return fields | {"replayed": self.replayed, "mode": self.mode}


def decide_geometry(config: Any, model: Any, device: str, batch: int, max_length: int,
                    training: bool) -> Geometry:
    """Picks emulation, the attention implementations and the run length; checks memory before anything big
    is allocated: one device pass's, or for a training scenario (`training`) one training step's."""
    emulated = resolve_emulation(config.emulate, device)
    if max_length > model.max_positions:
        raise UsageError(f"--max-length {max_length} exceeds the model's {model.max_positions} positions.")
    dtype_bytes = DTYPE_BYTES[config.dtype]
    attentions, substituted = fitted_attentions(config, model, device, emulated, batch, max_length, training)

    def pass_bytes(length: int) -> int:
        return max(estimate_peak_bytes(model.config, batch, length, dtype_bytes, a) for a in attentions)

    full = estimate_training_bytes(model.config, batch, max_length) if training else pass_bytes(max_length)
    run_length = _run_length(config, device, emulated, full, max_length)
    geometry = Geometry(device, emulated, batch, max_length, run_length, config.index_bits,
                        attention=attentions[0], attentions=attentions, substituted=substituted)
    if geometry.replayed and (max_length & (max_length - 1) or run_length & (run_length - 1)):
        raise UsageError(f"--max-length {max_length} cannot be emulated exactly at reduced length "
                         f"{run_length}: the wrap period must be a whole number of batches, which needs "
                         "power-of-two lengths. Use a power of two, or a device with enough memory for the "
                         "full scale.")
    if training:
        check_training_memory(model.config, device, batch, run_length)
    else:
        scale = "" if device == "cpu" else ", or let mpsimpact scale the geometry (--device cpu)"
        check_memory(device, pass_bytes(run_length), "one device pass", f"Lower --batch-size or --max-length{scale}.")
    return geometry


def fitted_attentions(config: Any, model: Any, device: str, emulated: bool, batch: int, max_length: int,
                      training: bool) -> tuple[tuple[str, ...], str]:
    """The attention implementations to run, and why they differ from those asked: on a Mac's GPU, where
    eager attention would not fit and blocked_eager (the same P V call) does, blocked_eager."""
    asked = tuple(config.attentions)
    if asked != ("eager",) or device != "mps" or emulated or training:
        return asked, ""
    dtype_bytes, offered = DTYPE_BYTES[config.dtype], device_memory(device)
    eager, blocked = (estimate_peak_bytes(model.config, batch, max_length, dtype_bytes, attention)
                      for attention in ("eager", BLOCKED))
    if eager <= offered or blocked > offered:
        return asked, ""
    return (BLOCKED,), (f"eager attention would need about {eager / GIB:.1f} GiB and {device} offers "
                        f"{offered / GIB:.1f} GiB, so {BLOCKED} attention runs instead ({REASON}; about "
                        f"{blocked / GIB:.1f} GiB)")


def _run_length(config: Any, device: str, emulated: bool, full: int, max_length: int) -> int:
    """--run-length if given; the full length where it fits on a GPU; else the reduced length, where
    the plan replays (refused on MPS and on an unemulated GPU, which must run at full scale)."""
    if config.run_length:
        check_run_length(config.run_length, max_length)  # refused past the length asked, never clamped
        return config.run_length
    if device != "cpu" and full <= device_memory(device):
        return max_length
    if device == "mps" or (not emulated and device != "cpu"):
        hint = "" if device != "mps" else (
            f" `{config.plan_command('--memory', 'auto')}` names the smallest demo that fits this Mac.")
        raise MemoryPreflightError(
            f"This run needs about {full / GIB:.1f} GiB for attention scores and activations; {device} "
            f"offers {device_memory(device) / GIB:.1f} GiB. Lower --batch-size or --max-length, or use "
            f"--dtype float16.{hint}", device=device, needed_bytes=full)
    return min(max_length, REDUCED_LENGTH)


def check_training_memory(model_config: Any, device: str, batch: int, length: int) -> None:
    """Raises MemoryPreflightError, before anything big is allocated, when one training step of
    `batch` texts at `length` tokens does not fit on `device`; the message names the largest batch
    that does."""
    offered = device_memory(device)
    fits = largest_fitting_batch(lambda b: estimate_training_bytes(model_config, b, length), offered)
    advice = (f"Use --batch-size {fits} or less." if fits
              else "Not even one text fits: free memory, or use a machine with more.")
    needed = estimate_training_bytes(model_config, batch, length)
    check_memory(device, needed, f"one training step ({TRAINING_PARTS}) at {batch} x {length}", advice)


def build_batch(texts: tuple[str, ...], labels: tuple[int, ...],
                batch: int) -> tuple[list[str], np.ndarray, int]:
    """The first `batch` texts in the data's fixed order, repeated if there are too few; returns
    (texts, gold labels, how many positions are repeats)."""
    reps = -(-batch // len(texts))
    return (list(texts) * reps)[:batch], np.array((list(labels) * reps)[:batch]), max(0, batch - len(texts))


@contextlib.contextmanager
def condition(geometry: Geometry, plan, guard_mode: str, training: bool = False):
    """Emulation (or not) and the guard (or not) for one condition; inference mode unless training."""
    bits, profile = geometry.index_bits, geometry.profile
    emulation = (contextlib.nullcontext(None) if not geometry.emulated
                 else emulate(plan=plan, profile=profile) if geometry.replayed  # the plan's release: no other
                 else emulate(index_bits=bits, profile=profile, memory=geometry.mac))
    guarding = (guard(guard_mode, index_bits=bits, profile=profile) if guard_mode != "off"
                else contextlib.nullcontext(None))
    with contextlib.nullcontext() if training else torch.inference_mode(), emulation as emu, guarding as g:
        yield emu, g


def tokenize(tokenizer, texts: list[str], geometry: Geometry
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pads every text to the run length; reports which texts a reduced length truncates."""
    enc = tokenizer(texts, truncation=True, max_length=geometry.run_length, padding="max_length",
                    return_tensors="pt")
    lengths = np.array([len(ids) for ids in tokenizer(texts, truncation=False)["input_ids"]])
    reduced = np.flatnonzero((lengths > geometry.run_length) & (geometry.run_length < geometry.max_length))
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, {
        "truncated_at_max_length": int((lengths > geometry.max_length).sum()),
        "truncated_by_reduced_length": reduced.tolist(),
        "truncated_by_reduced_length_fraction": reduced.size / len(texts),
        "mean_tokens": float(lengths.mean()),
    }


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
        result.update(status="stopped_by_guard", message=str(error), error=error)
    except NotEmulatedError as error:  # wrong on MPS, but nobody characterised the values
        result.update(status="not_emulated", message=error.message, error=error)
    except RuntimeError as error:  # MPS's own error, real or emulated
        result.update(status="error", message=str(error).splitlines()[0], error=error)
    emu, g = state.get("emu"), state.get("guard")
    result["wall_s"] = time.perf_counter() - start
    result.update(stopped_fields(result.pop("error", None), emu, g, geometry))
    if geometry.device == "cuda":
        result["peak_device_memory_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    result["altered_calls"] = [r.to_json() for r in emu.records] if emu else []
    result["guard_calls"] = [r.to_json() for r in (g.stopped + g.chunked)] if g else []
    result["silent_faults_injected"] = sum(r.fault.is_silent for r in (emu.records if emu else []))
    if result["status"] != "completed":
        result["wrong_values_before_stop"] = result["silent_faults_injected"]
    return result


def stopped_fields(error: BaseException | None, emu: Any, g: Any, geometry: Geometry) -> dict[str, Any]:
    """Where a condition that `error` ended stopped, in a speaker's words, whether anybody measured it, the Mac's
    refusal of an allocation, and its stop (`stop_facts`): what headlines and footnotes read. {} where it
    completed, or nothing recorded the call."""
    if error is None:
        return {}
    guarded = isinstance(error, OversizedOpError)
    stopped_at = (g.stopped[-1] if guarded and g and g.stopped else
                  emu.records[-1] if not guarded and emu and emu.records else None)
    if stopped_at is None:
        return {}
    fields = {"where": site(stopped_at), "unmeasured": stopped_at.fault.nobody_measured}
    if stopped_at.fault.rule == BUFFER_RULE:  # the Mac's own refusal (Note [The Mac's largest buffer])
        fields["buffer_refused"] = stopped_at.fault.message
    stop = stop_facts(error, stopped_at, geometry.batch_size, geometry.index_bits)
    return fields | ({"stop": stop} if stop else {})


def stop_facts(error: BaseException, stopped_at: Any, batch: int, index_bits: int) -> dict[str, Any] | None:
    """The stop of a condition that `error` ended at the call `stopped_at` (a CallRecord: the guard's or the
    emulator's last), with `batch` samples at `index_bits`; None where nothing says which call (a real MPS error).
    A guard's error says how many of the call's rows one sample holds (Note [A call's samples]); where it could not
    tell, a call whose rows are whole samples of the batch tells."""
    fault = getattr(error, "fields", {}).get("fault") or (stopped_at.fault if stopped_at is not None else None)
    if fault is None or stopped_at is None:
        return None
    fields = error.fields if isinstance(error, OversizedOpError) else {}
    per = fields.get("rows_per_sample") or 1
    rows = stopped_at.a.shape[0] if stopped_at.is_product and stopped_at.a.shape else 0
    if per == 1 and stopped_at.family == "bmm" and rows > batch and rows % batch == 0:
        per = rows // batch
    first, safe, whole = fault.first_bad_batch, fields.get("safe_chunk"), fields.get("safe_batch")
    return {
        "by": "guard" if isinstance(error, OversizedOpError) else "mps", "kind": fault.kind, "release": fault.release,
        "phase": stopped_at.phase, "torch_text": fault.message or None, "unmeasured": fault.is_unmeasured,
        "rows_per_sample": per, "first_wrong_row": first, "first_wrong_sample": None if first is None else first // per,
        "safe_rows": safe if stopped_at.is_product else None,
        "safe_samples": safe // per if safe is not None and stopped_at.is_product else None,
        # the largest batch that runs the call whole, where more than a piece may hold (stop_text.whole_rows)
        "whole_rows": whole, "whole_samples": None if whole is None else whole // per,
        "index_bits": fields.get("index_bits", index_bits),
    }


def run_conditions(config: Any, module, inputs, geometry: Geometry, sections: dict, heads: int, progress):
    """Every condition, attention implementation by guard mode (`sections`: each one's plan and prediction,
    outcome.PredictionSection): yields (key, result); the module is back on eager attention afterwards."""
    from mpsimpact.models.classifier import use_attention

    for attention, section in sections.items():
        use_attention(module, attention, samples_per_block(heads, geometry.max_length))  # as the plan's trace
        geo = dataclasses.replace(geometry, attention=attention)
        for guard_mode in config.guards:
            yield condition_key(attention, guard_mode), condition_pass(
                module, inputs, geo, section.plan, section.prediction, guard_mode, progress)
    use_attention(module, "eager")


def condition_pass(module, inputs, geometry: Geometry, plan, prediction, guard_mode: str,
                   progress) -> dict[str, Any]:
    """One guard condition's device pass with a per-layer progress bar (or its predicted abort, skipped)."""
    if would_abort(geometry, prediction, guard_mode):
        return skipped_abort(guard_mode, prediction)
    layers = transformer_layers(module)
    label = f"device pass on {geometry.device}, {geometry.attention} attention, guard {guard_mode} (layers)"
    advance = progress(label, len(layers))  # as each layer finishes its forward
    handles = [layer.register_forward_hook(lambda *_: advance(1)) for layer in layers] if advance else []
    try:
        result = device_pass(module, inputs, geometry, plan, guard_mode)
    finally:
        for handle in handles:
            handle.remove()
    result["predicted_first_corrupted_index"] = prediction.first_corrupted_text
    return result


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
