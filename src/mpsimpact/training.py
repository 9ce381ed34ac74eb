"""The training runner: K optimiser steps on one oversized batch, under each guard condition on the
device and once on the CPU reference; compares logits, gradients, updates and the predictions the
trained models make on a held-out evaluation set."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any

import numpy as np
import torch

from mpsimpact.errors import OversizedOpError
from mpsimpact.workload import Geometry, build_batch, condition, tokenize

GRADIENT_THRESHOLD = 1e-3


def training_copy(module: torch.nn.Module, device: str) -> torch.nn.Module:
    """A fresh copy in training mode with every dropout off (a deterministic step)."""
    model = copy.deepcopy(module).to(device).train()
    for sub in model.modules():
        if isinstance(sub, torch.nn.Dropout):
            sub.p = 0.0
    return model


def train_steps(module, inputs, labels, steps: int, lr: float, geometry: Geometry | None, plan, guard_mode: str) -> dict[str, Any]:
    """Runs `steps` Adam steps; records the first step's logits (even if its backward fails), its
    gradients, every call the emulator altered, and where a stop happened."""
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    out: dict[str, Any] = {"guard": guard_mode, "status": "completed", "message": None, "phase": None, "altered_calls": []}
    start = time.perf_counter()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        held: dict[str, Any] = {}
        stage = "forward"
        try:
            stepping = condition(geometry, plan, guard_mode, training=True) if geometry else contextlib.nullcontext((None, None))
            with stepping as (emu, _g):
                held["emu"] = emu
                logits = module(**inputs)
                if step == 0:
                    out["logits"] = logits.detach().float().cpu().numpy()
                stage = "backward"
                torch.nn.functional.cross_entropy(logits, labels).backward()
        except (OversizedOpError, RuntimeError) as error:
            out.update(status="stopped_by_guard" if isinstance(error, OversizedOpError) else "error",
                       message=str(error).splitlines()[0], phase=stage, step=step)
        finally:
            if held.get("emu") is not None:
                out["altered_calls"] += [r.to_json() | {"step": step} for r in held["emu"].records]
        if out["status"] != "completed":
            break
        if step == 0:
            out["gradients"] = {n: p.grad.detach().float().cpu().clone() for n, p in module.named_parameters() if p.grad is not None}
        optimizer.step()
    out["wall_s"] = time.perf_counter() - start
    return out


def gradient_errors(gradients: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter tensor: max |g - g_ref| / max |g_ref|."""
    errors = {}
    for name, ref in reference.items():
        scale = ref.abs().max().item() or 1.0
        errors[name] = float((gradients[name] - ref).abs().max().item() / scale)
    return errors


def update_error(trained: torch.nn.Module, reference: torch.nn.Module, initial: dict[str, torch.Tensor]) -> float:
    """max over parameters of |delta - delta_ref| / max |delta_ref| (the update, not the weights)."""
    worst = 0.0
    ref_params = dict(reference.named_parameters())
    for name, p in trained.named_parameters():
        delta = p.detach().cpu() - initial[name]
        ref_delta = ref_params[name].detach().cpu() - initial[name]
        scale = ref_delta.abs().max().item() or 1.0
        worst = max(worst, (delta - ref_delta).abs().max().item() / scale)
    return worst


def evaluate(module: torch.nn.Module, tokenizer, texts, length: int) -> np.ndarray:
    """Predictions of a trained copy on the evaluation texts (CPU, eval mode, no emulation)."""
    from mpsimpact.reference import run_chunked

    model = copy.deepcopy(module).cpu().eval()
    return run_chunked(model, tokenizer, texts, length).argmax(axis=1)


def run_training(config, scenario, model, geometry: Geometry, plan, progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every guard condition's steps plus the CPU reference; returns (conditions, arrays)."""
    from mpsimpact.metrics import relative_error

    texts, gold, repeats = build_batch(scenario.data.texts, scenario.data.labels, geometry.batch_size)
    inputs, token_stats = tokenize(model.tokenizer, texts, geometry)
    labels = torch.as_tensor(gold)
    initial = {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}
    reference_model = training_copy(model.module, "cpu")
    reference = train_steps(reference_model, inputs, labels, config.steps, config.lr, None, None, "off")
    eval_texts = list(scenario.eval_data.texts)
    eval_gold = np.array(scenario.eval_data.labels)
    ref_eval = evaluate(reference_model, model.tokenizer, eval_texts, geometry.run_length)
    dev_inputs = {k: v.to(geometry.device) for k, v in inputs.items()}
    conditions, arrays = [], {"gradient_errors": {}, "eval_changes": {}, "reference_eval": ref_eval}
    for guard_mode in config.guards:
        trained = training_copy(model.module, geometry.device)
        result = train_steps(trained, dev_inputs, labels.to(geometry.device), config.steps, config.lr, geometry, plan, guard_mode)
        logits, grads = result.pop("logits", None), result.pop("gradients", None)
        if logits is not None:
            err = relative_error(logits, reference["logits"])
            result["corrupted_count"] = int((err > config.threshold).sum())
            result["first_corrupted_index"] = int(np.argmax(err > config.threshold)) if result["corrupted_count"] else None
        if grads is not None:
            errors = gradient_errors(grads, reference["gradients"])
            arrays["gradient_errors"][guard_mode] = errors
            result["corrupted_gradient_tensors"] = sum(e > GRADIENT_THRESHOLD for e in errors.values())
            result["max_gradient_rel_error"] = max(errors.values())
        if result["status"] == "completed":
            result["update_rel_error"] = update_error(trained, reference_model, initial)
            dev_eval = evaluate(trained, model.tokenizer, eval_texts, geometry.run_length)
            arrays["eval_changes"][guard_mode] = dev_eval != ref_eval
            result["eval_flips_after_training"] = int((dev_eval != ref_eval).sum())
            result["eval_accuracy_after"] = float((dev_eval == eval_gold).mean())
            result["reference_eval_accuracy_after"] = float((ref_eval == eval_gold).mean())
        result["faulted_ops"] = faulted_ops(result["altered_calls"])
        conditions.append(result)
    return {"conditions": conditions, "repeated_texts": repeats, "tokens": token_stats,
            "reference": {"device": "cpu", "status": reference["status"], "eval_texts": len(eval_texts)}}, arrays


def faulted_ops(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Which calls the emulator altered, grouped as (where, op, shapes) with their phases."""
    grouped: dict[tuple, set] = {}
    for r in records:
        key = (r["op"], tuple(r["a"]["shape"]), tuple(r["b"]["shape"]), r["fault"]["kind"])
        grouped.setdefault(key, set()).add(r["phase"])
    return [{"op": k[0], "a": list(k[1]), "b": list(k[2]), "kind": k[3], "phases": sorted(v)} for k, v in grouped.items()]
