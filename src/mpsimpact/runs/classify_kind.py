"""The classify kind: one forward pass of the whole batch per attention implementation and guard
condition, logits judged against a CPU (or same-dtype) reference; its columns, figures and files."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import torch

from mpsimpact.config import CORRUPTION_THRESHOLD
from mpsimpact.errors import UsageError
from mpsimpact.output.page import Footnotes, format_cell
from mpsimpact.runs.device import full_precision_reductions
from mpsimpact.runs.kind import PASS_COLUMNS, RunKind, pass_cells
from mpsimpact.runs.device_pass import Geometry, build_batch, run_conditions, tokenize
from mpsimpact.runs.metrics import relative_error, summarize
from mpsimpact.runs.reference import device_reference, reference_logits


def select_reference(config, model, texts: list[str], geometry: Geometry, boundary: int | None,
                     progress) -> tuple[np.ndarray, dict[str, Any]]:
    """The fp32 reference: on the CPU (cached), or with --reference-device device chunked on the device."""
    device = geometry.device
    info: dict[str, Any] = {"device": "cpu", "dtype": "float32"}
    if config.reference_device == "device" and device != "cpu":
        model.module.to(device)
        advance = progress(f"reference ({device}, chunked)", len(texts))
        ref, spot = device_reference(model, texts, geometry.run_length, device, boundary, advance)
        info.update(device=device, cached=False, cpu_spot_check=spot)
    else:
        if config.reference_device == "device":  # said once, where it changes nothing
            from mpsimpact.output.files import warn

            warn("--reference-device device computes the reference on the run's device, and that is the CPU "
                 "here, where the reference runs in any case: nothing changes.")
        advance = progress("reference (CPU fp32)", len(texts))
        ref, info["cached"] = reference_logits(model, texts, geometry.run_length, advance)
    return ref, info


class ClassifyKind(RunKind):
    """Inference of a classifier: logits per text, corrupted above a relative error threshold."""

    reads = frozenset({"threshold", "reference_device", "dataset"})
    not_read = {"steps": "it trains nothing (finetune takes optimiser steps)",
                "lr": "it trains nothing (finetune takes optimiser steps)"}

    name = "inference"
    columns = (*PASS_COLUMNS, ("flips", "flips"), ("accuracy", "accuracy"),
               ("reference_accuracy", "ref. accuracy"), ("wall_s", "wall s"))
    files = ("report.json", "report.md", "report.html", "samples.jsonl", "figures")
    counts = (*RunKind.counts, "flips")
    fractions = ("accuracy", "reference_accuracy", *RunKind.fractions)
    uncompared = (*RunKind.uncompared, "reference_accuracy")
    position_files = ("samples.jsonl", "logits.npz")
    console_formats = RunKind.console_formats | {"accuracy": "{:.3f}"}
    console_header = ("guard", "status", "wrong", "first wrong (pred.)", "flips", "accuracy (ref.)", "wall")

    @full_precision_reductions()
    def run(self, config, scenario, model, geometry: Geometry, sections: dict,
            progress) -> tuple[dict[str, Any], dict[str, Any]]:
        device, fp32 = geometry.device, geometry.dtype == "float32"
        texts, gold, repeats = build_batch(scenario.data.texts, scenario.data.labels, geometry.batch_size)
        inputs, token_stats = tokenize(model.tokenizer, texts, geometry)
        first = sections[geometry.attentions[0]].prediction
        ref, info = select_reference(config, model, texts, geometry, first.first_corrupted_text, progress)
        info["accuracy"] = float((ref.argmax(1) == gold).mean())
        module = model.module.to(device=device, dtype=getattr(torch, geometry.dtype))
        inputs = {k: v.to(device) for k, v in inputs.items()}
        judge = ref if fp32 else _half_reference(module, model, texts, geometry, info, progress)
        info["judged_against"] = "cpu float32" if fp32 else f"{device} {geometry.dtype}, small batches"
        info["threshold"] = config.corruption_threshold
        conditions, arrays = [], {"reference": judge, "fp32_reference": ref, "gold": gold, "texts": texts,
                                  "errors": {}, "preds": {}}
        for key, result in run_conditions(config, module, inputs, geometry, sections, model.heads, progress):
            logits = result.pop("logits", None)
            if logits is not None:
                result.update(summarize(logits, judge, gold, model.label_names, config.corruption_threshold))
                arrays["errors"][key], arrays["preds"][key] = relative_error(logits, judge), logits.argmax(axis=1)
                arrays.setdefault("logits", {})[key] = logits
            if "flips" in result and not fp32:
                result["flips_vs_fp32"] = int((arrays["preds"][key] != ref.argmax(1)).sum())
                result["fp32_reference_accuracy"] = info["accuracy"]
            conditions.append(result)
        model.module.to(dtype=torch.float32)
        return {"repeated_texts": repeats, "tokens": token_stats, "reference": info,
                "conditions": conditions}, arrays

    def figures(self, report: dict, arrays: dict) -> dict[str, bytes]:
        from mpsimpact.runs.figures import render_all

        return render_all(report, arrays["errors"], arrays["preds"], arrays["reference"].argmax(axis=1),
                          self.figure_line(report))

    def extra_files(self, report: dict, arrays: dict) -> dict[str, bytes]:
        return {"samples.jsonl": samples_jsonl(report, arrays).encode("utf-8"),  # full-precision logits:
                "logits.npz": npz_bytes({"reference": arrays["reference"], "gold": arrays["gold"]},
                                        arrays.get("logits", {}))}

    def read_positions(self, name: str, run: dict, files: Any) -> dict[str, frozenset[int]]:
        """samples.jsonl's, or where it is missing, recomputed from logits.npz at the report's threshold."""
        if name != "logits.npz":
            return super().read_positions(name, run, files)
        if any(c.get("attention") for c in run["conditions"]):
            return {}  # logits.npz is keyed by guard alone: ambiguous when attention varies
        arrays, path = files.arrays(name), files.path / name
        if "reference" not in arrays:
            raise UsageError(f"'{path}' has no reference logits; it was not written by `mpsimpact run`.")
        for key, logits in arrays.items():
            if key.startswith("guard_") and logits.shape != arrays["reference"].shape:
                raise UsageError(f"'{path}': '{key}' has shape {list(logits.shape)}, the reference "
                                 f"{list(arrays['reference'].shape)}; it is damaged: rerun `mpsimpact run` for this "
                                 "folder.")
        threshold = run.get("config", {}).get("threshold", CORRUPTION_THRESHOLD)
        return {key.removeprefix("guard_"):
                frozenset(np.flatnonzero(relative_error(logits, arrays["reference"]) > threshold).tolist())
                for key, logits in arrays.items() if key.startswith("guard_")}

    def console_row(self, condition: dict, footnotes: Footnotes, verbose: bool) -> list[str]:
        c, done = condition, condition["status"] == "completed"
        return [*pass_cells(c, footnotes, verbose), str(c["flips"]) if done else "-",
                f"{c['accuracy']:.3f} ({c['reference_accuracy']:.3f})" if done else "-", f"{c['wall_s']:.1f}s"]

    def damage(self, report: dict, off: dict) -> tuple[str, str]:
        # Outputs (the logits) go wrong; a prediction (the label) changes only where the wrong logits cross.
        flips, c = off.get("flips", 0), off.get("collapse", {})
        then = f"{flips} prediction{'s' if flips != 1 else ''} changed class"
        if c.get("class") and c.get("device_share", 0) > 0.5:
            then += f"; most ({c['device_share']:.0%}) collapsed onto '{c['class']}'"
        return super().damage(report, off)[0], then

    def condition_lines(self, condition: dict) -> list[str]:
        if not condition.get("collapse", {}).get("class"):
            return []
        c = condition["collapse"]
        return [f"- guard {condition['guard']}: corrupted texts collapse onto **{c['class']}**: "
                f"{c['device_share']:.1%} on the device vs {c['reference_share']:.1%} in the reference "
                f"(chi-square p = {format_cell(condition['significance']['chi2_collapse_p'])})."]

    def console_lines(self, report: dict, verbose: bool = False) -> list[str]:
        off = [c.get("collapse", {}) for c in report["conditions"] if c["guard"] == "off"]
        return [f"guard off: corrupted texts collapse onto '{c['class']}': {c['device_share']:.1%} on the device vs "
                f"{c['reference_share']:.1%} in the reference." for c in off if c.get("class")]


def _half_reference(module, model, texts: list[str], geometry: Geometry, info: dict[str, Any], progress):
    """Half precision's judge: the module as it is (dtype, device), over small batches of texts far
    below every limit, padded to the run length exactly as the device pass is; no emulation, no
    guard: an independent computation on the same kernels."""
    from mpsimpact.runs.reference import CHUNK, run_chunked

    info["same_dtype"] = {"device": geometry.device, "dtype": geometry.dtype, "batch": CHUNK}
    advance = progress(f"reference ({geometry.device} {geometry.dtype}, batches of {CHUNK})", len(texts))
    return run_chunked(module, model.tokenizer, texts, geometry.run_length, advance=advance, device=geometry.device,
                       padding="max_length")


def samples_jsonl(report: dict, arrays: dict) -> str:
    """One line per text and completed condition."""
    names, ref, gold = report["label_names"], arrays["reference"], arrays["gold"]
    ref_pred = ref.argmax(axis=1)
    threshold = report["reference"].get("threshold", report["config"]["threshold"])
    lines = []
    for guard_mode, logits in arrays.get("logits", {}).items():
        err = arrays["errors"][guard_mode]
        for i, text in enumerate(arrays["texts"]):
            lines.append(json.dumps({
                "guard": guard_mode, "position": i, "text": text, "gold": names[gold[i]],
                "reference_pred": names[ref_pred[i]], "device_pred": names[int(logits[i].argmax())],
                "relative_error": float(err[i]), "corrupted": bool(err[i] > threshold),
                "reference_logits": ref[i].round(6).tolist(), "device_logits": logits[i].round(6).tolist(),
            }))
    return "\n".join(lines) + "\n"


def npz_bytes(arrays: dict[str, np.ndarray], conditions: dict[str, np.ndarray]) -> bytes:
    """An .npz of `arrays` and each completed condition's outputs as "guard_<condition key>" (for comparisons)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays, **{f"guard_{k}": v for k, v in conditions.items()})
    return buffer.getvalue()
