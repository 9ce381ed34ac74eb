"""The training runner: K optimiser steps on one oversized batch under each guard condition and once on the CPU
reference, compared in logits, gradients, updates and held-out predictions. One trained copy is alive at a time,
beside the reference-trained one, and each step keeps only the activations backward cannot recompute."""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mpsimpact.config import GRADIENT_THRESHOLD
from mpsimpact.errors import OversizedOpError
from mpsimpact.prediction.outcome import site
from mpsimpact.runs.activations import MATMULS, recompute_activations
from mpsimpact.runs.device_pass import Geometry, build_batch, condition, stopped_fields, tokenize


def training_copy(module: torch.nn.Module, device: str) -> torch.nn.Module:
    """A fresh copy in training mode with every dropout off (a deterministic step)."""
    model = copy.deepcopy(module).to(device).train()
    for sub in model.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
    return model


def train_steps(module, inputs, labels, steps: int, lr: float, geometry: Geometry | None, plan,
                guard_mode: str, reference_gradients: Mapping[str, torch.Tensor] | None = None
                ) -> dict[str, Any]:
    """Runs `steps` Adam steps; records the first step's logits (even if its backward fails), every
    call the emulator altered, where a stop happened, and the first step's gradients: their error
    against `reference_gradients` when given (no copy kept), else the gradients themselves."""
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    out: dict[str, Any] = {"guard": guard_mode, "status": "completed", "message": None, "phase": None,
                           "altered_calls": []}
    start = time.perf_counter()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if not _one_step(module, inputs, labels, geometry, plan, guard_mode, step, out):
            break
        if step == 0:
            grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
            if reference_gradients is None:
                # No copy: Adam only reads them; zero_grad(set_to_none=True) drops them, never overwrites.
                out["gradients"] = {n: g.detach().float().cpu() for n, g in grads.items()}
            else:
                out["gradient_errors"] = gradient_errors(grads, reference_gradients)
            del grads
        optimizer.step()
    module.zero_grad(set_to_none=True)
    out["wall_s"] = time.perf_counter() - start
    return out


def _one_step(module, inputs, labels, geometry: Geometry | None, plan, guard_mode: str, step: int,
              out: dict[str, Any]) -> bool:
    """Forward and backward of one step; whether it completed. Its graph dies with this frame,
    also when the step stops."""
    held: dict[str, Any] = {}
    phase = "forward"
    try:
        stepping = (condition(geometry, plan, guard_mode, training=True) if geometry
                    else contextlib.nullcontext((None, None)))
        keeping_less = recompute_activations(module, trusted_matmuls(geometry, plan))
        with stepping as (emu, g), keeping_less:
            held.update(emu=emu, guard=g)
            logits = module(**inputs)
            if step == 0:
                out["logits"] = logits.detach().float().cpu().numpy()
            phase = "backward"
            torch.nn.functional.cross_entropy(logits, labels).backward()
    except (OversizedOpError, RuntimeError) as error:
        out.update(status="stopped_by_guard" if isinstance(error, OversizedOpError) else "error",
                   message=str(error).splitlines()[0], phase=phase, step=step)
        if geometry is not None:  # where, in a speaker's words, and the stop (device_pass.stop_facts)
            out.update(stopped_fields(error, held.get("emu"), held.get("guard"), geometry))
    finally:
        if held.get("emu") is not None:
            out["altered_calls"] += [r.to_json() | {"step": step, "where": site(r)} for r in held["emu"].records]
    return out["status"] == "completed"


def trusted_matmuls(geometry: Geometry | None, plan) -> frozenset[str]:
    """The matmul families no call of this step alters (see Note [Recomputed activations]): all on
    the plain CPU reference, none on a real device, and under emulation those the plan (forward and
    backward) leaves alone."""
    if geometry is None:
        return MATMULS
    if not geometry.emulated or plan is None:
        return frozenset()
    return MATMULS - {call.family for call in plan.calls if not call.fault.is_ok}


def _tensor_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| / max |reference| (max |value - reference| for a reference of zeros)."""
    return float((value - reference).abs().max().item() / (reference.abs().max().item() or 1.0))


def gradient_errors(gradients: Mapping[str, torch.Tensor],
                    reference: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter tensor: max |g - g_ref| / max |g_ref|."""
    return {name: _tensor_error(gradients[name].detach().float().cpu(), ref) for name, ref in reference.items()}


def update_error(trained: torch.nn.Module, reference: torch.nn.Module,
                 initial: Mapping[str, torch.Tensor]) -> float:
    """max over parameters of |delta - delta_ref| / max |delta_ref| (the update, not the weights)."""
    ref_params = dict(reference.named_parameters())
    errors = (_tensor_error(p.detach().cpu() - initial[name], ref_params[name].detach().cpu() - initial[name])
              for name, p in trained.named_parameters())
    return max([0.0, *errors])  # a running max from 0: a NaN never wins


def evaluate(module: torch.nn.Module, tokenizer, texts, length: int) -> np.ndarray:
    """Predictions of a trained copy on the evaluation texts (CPU, eval mode, no emulation). Moves
    the copy itself to the CPU: its training is over."""
    from mpsimpact.runs.reference import run_chunked

    return run_chunked(module.cpu().eval(), tokenizer, texts, length).argmax(axis=1)


def train_reference(config, model, inputs, labels, eval_texts, length: int) -> dict[str, Any]:
    """What every condition is compared with: the CPU reference's steps (train_steps' result: its first-step
    "logits" and "gradients", its "status"), its trained copy ("model") and that copy's predictions on the
    evaluation texts ("eval_preds")."""
    trained = training_copy(model.module, "cpu")
    result = train_steps(trained, inputs, labels, config.steps, config.lr, None, None, "off")
    return result | {"model": trained, "eval_preds": evaluate(trained, model.tokenizer, eval_texts, length)}


def run_training(config, scenario, model, geometry: Geometry, plan,
                 progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every guard condition's steps plus the CPU reference; returns (conditions, arrays)."""
    texts, gold, repeats = build_batch(scenario.data.texts, scenario.data.labels, geometry.batch_size)
    inputs, token_stats = tokenize(model.tokenizer, texts, geometry)
    labels = torch.as_tensor(gold)
    eval_texts, eval_gold = list(scenario.eval_data.texts), np.array(scenario.eval_data.labels)
    reference = train_reference(config, model, inputs, labels, eval_texts, geometry.run_length)
    on_device = ({k: v.to(geometry.device) for k, v in inputs.items()}, labels.to(geometry.device))
    arrays = {"gradient_errors": {}, "eval_changes": {}, "reference_eval": reference["eval_preds"]}
    conditions = []
    for guard_mode in config.guards:
        result = train_condition(config, model, geometry, plan, guard_mode, on_device, reference, eval_texts)
        if "gradient_errors" in result:
            arrays["gradient_errors"][guard_mode] = result.pop("gradient_errors")
        if "eval_preds" in result:
            dev_eval = result.pop("eval_preds")
            arrays["eval_changes"][guard_mode] = dev_eval != reference["eval_preds"]
            result["eval_flips_after_training"] = int((dev_eval != reference["eval_preds"]).sum())
            result["eval_accuracy_after"] = float((dev_eval == eval_gold).mean())
            result["reference_eval_accuracy_after"] = float((reference["eval_preds"] == eval_gold).mean())
        result["faulted_ops"] = faulted_ops(result["altered_calls"])
        conditions.append(result)
    return {"conditions": conditions, "repeated_texts": repeats, "tokens": token_stats,
            "reference": {"device": "cpu", "status": reference["status"], "eval_texts": len(eval_texts)}}, arrays


def train_condition(config, model, geometry: Geometry, plan, guard_mode: str, device_batch,
                    reference: dict[str, Any], eval_texts: list[str]) -> dict[str, Any]:
    """One guard condition: a fresh trained copy, its steps, its comparison with the reference; the
    copy is freed before the next condition makes its own."""
    from mpsimpact.runs.metrics import relative_error

    trained = training_copy(model.module, geometry.device)
    result = train_steps(trained, *device_batch, config.steps, config.lr, geometry, plan, guard_mode,
                         reference["gradients"])
    logits = result.pop("logits", None)
    if logits is not None:
        wrong = relative_error(logits, reference["logits"]) > config.threshold
        result["corrupted_count"] = int(wrong.sum())
        result["first_corrupted_index"] = int(np.argmax(wrong)) if result["corrupted_count"] else None
    if "gradient_errors" in result:
        errors = result["gradient_errors"]
        result["corrupted_gradient_tensors"] = sum(e > GRADIENT_THRESHOLD for e in errors.values())
        result["max_gradient_rel_error"] = max(errors.values())
    if result["status"] == "completed":
        # The loaded model is never trained (training_copy copies it): it is the initial state.
        initial = {n: p.detach() for n, p in model.module.named_parameters()}
        result["update_rel_error"] = update_error(trained, reference["model"], initial)
        result["eval_preds"] = evaluate(trained, model.tokenizer, eval_texts, geometry.run_length)
    del trained
    gc.collect()
    return result


def faulted_ops(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Which calls the emulator altered, grouped as (where, op, shapes) with their phases."""
    grouped: dict[tuple, set] = {}
    for r in records:
        key = (r["op"], tuple(r["a"]["shape"]), tuple(r["b"]["shape"]), r["fault"]["kind"], r.get("where"))
        grouped.setdefault(key, set()).add(r["phase"])
    return [{"op": op, "a": list(a), "b": list(b), "kind": kind, "phases": sorted(phases),
             **({"where": where} if where else {})} for (op, a, b, kind, where), phases in grouped.items()]
