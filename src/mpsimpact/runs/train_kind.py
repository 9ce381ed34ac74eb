"""The train kind: K optimiser steps on one oversized batch per guard condition against the CPU
reference's (training.run_training); its columns, figures and gradients.json."""

from __future__ import annotations

import json
from typing import Any

from mpsimpact.prediction.outcome import predict
from mpsimpact.engine.call import op_cell
from mpsimpact.output.page import FAULT_WORDS, Footnotes
from mpsimpact.runs.kind import RunKind, status_cell


# What the emulator made of a call, by its fault's kind, in the console's words.
_DID = {"wrong_tail": "silently returned wrong values", "wrong_all": "silently returned wrong values",
        "truncated": "silently returned wrong values", "wrong_other": "went wrong in a way nobody characterised",
        "error": "MPS raised an error", "abort": "the process would die"}


class TrainKind(RunKind):
    """Training steps: logits, gradients, the update and held-out predictions after training."""

    name = "training"
    backward = True
    dtypes = ("float32",)
    attentions = ("eager",)
    reads = frozenset({"steps", "lr", "threshold", "dataset"})
    not_read = {"reference_device": "its reference steps run on the CPU, in full"}
    columns = (
        ("guard", "guard"), ("status", "status"), ("phase", "stopped in"),
        ("corrupted_count", "corrupted logits"), ("corrupted_gradient_tensors", "wrong gradient tensors"),
        ("max_gradient_rel_error", "max gradient error"), ("update_rel_error", "update error"),
        ("eval_flips_after_training", "eval flips after"), ("wall_s", "wall s"))
    files = ("report.json", "report.md", "report.html", "gradients.json", "figures")
    counts = (*RunKind.counts, "corrupted_gradient_tensors")
    console_header = ("guard", "status", "wrong logits", "wrong gradients", "max gradient error", "update error",
                      "eval flips after", "wall")
    console_formats = RunKind.console_formats | {"max_gradient_rel_error": "{:.1e}", "update_rel_error": "{:.1e}"}

    def run(self, config, scenario, model, geometry, sections: dict,
            progress) -> tuple[dict[str, Any], dict[str, Any]]:
        from mpsimpact.runs.training import run_training

        plan = sections[geometry.attentions[0]].plan
        body, arrays = run_training(config, scenario, model, geometry, plan, progress)
        body["backward_prediction"] = predict(plan, geometry.batch_size, model.heads, "backward").to_json()
        return body, arrays

    def figures(self, report: dict, arrays: dict) -> dict[str, bytes]:
        from mpsimpact.runs.figures import render_training

        return render_training(report, arrays)

    def extra_files(self, report: dict, arrays: dict) -> dict[str, bytes]:
        return {"gradients.json": (json.dumps(arrays["gradient_errors"], indent=1) + "\n").encode("utf-8")}

    def corrupted_parts(self, condition: dict) -> list[str]:
        grads = condition.get("corrupted_gradient_tensors") or 0
        return [*super().corrupted_parts(condition), *([f"{grads} gradient tensors"] if grads else [])]

    def condition_lines(self, condition: dict) -> list[str]:
        return [f"- guard {condition['guard']}: {op['op']} {op['a']} @ {op['b']} was {op['kind']} in "
                f"{' and '.join(op['phases'])}." for op in condition.get("faulted_ops", [])]

    def damage(self, report: dict, off: dict) -> tuple[str, str]:
        return (f"{off.get('corrupted_count') or 0} of {report['geometry']['batch_size']} logits and "
                f"{off.get('corrupted_gradient_tensors') or 0} gradient tensors came back wrong", "")

    def console_title(self, report: dict, title: str) -> str:
        return f"{title}, {report['config']['steps']} step(s)"

    def console_row(self, condition: dict, footnotes: Footnotes, verbose: bool) -> list[str]:
        keys = ("corrupted_count", "corrupted_gradient_tensors", "max_gradient_rel_error", "update_rel_error",
                "eval_flips_after_training", "wall_s")
        return [condition["guard"], status_cell(condition, footnotes, verbose),
                *(self.console_cell(condition, key) for key in keys)]

    def console_lines(self, report: dict, verbose: bool = False) -> list[str]:
        """What the emulator did to each call a condition met: in words (where, what) unless `verbose` (the op and
        its shapes, the fault's kind)."""
        def line(op: dict) -> str:
            phases = " and ".join(op["phases"])
            if verbose or "where" not in op:
                what = op["kind"] if verbose else FAULT_WORDS.get(op["kind"], op["kind"])
                return f"{op_cell(op['op'], op['a'], op['b'])}: {what} in {phases}."
            phases = "" if "backward" in op["where"] else f" in {phases}"
            return f"{op['where']}: {_DID.get(op['kind'], 'went wrong')}{phases}."

        return [f"guard {c['guard']}: {line(op)}" for c in report["conditions"] for op in c.get("faulted_ops", [])]
