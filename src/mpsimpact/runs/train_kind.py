"""The train kind: K optimiser steps on one oversized batch per guard condition against the CPU
reference's (training.run_training); its columns, figures and gradients.json."""

from __future__ import annotations

import json
from typing import Any

from mpsimpact.prediction.outcome import predict
from mpsimpact.runs.kind import RunKind


class TrainKind(RunKind):
    """Training steps: logits, gradients, the update and held-out predictions after training."""

    name = "training"
    backward = True
    dtypes = ("float32",)
    attentions = ("eager",)
    columns = (
        ("guard", "guard"), ("status", "status"), ("phase", "stopped in"),
        ("corrupted_count", "corrupted logits"), ("corrupted_gradient_tensors", "wrong gradient tensors"),
        ("max_gradient_rel_error", "max gradient error"), ("update_rel_error", "update error"),
        ("eval_flips_after_training", "eval flips after"), ("wall_s", "wall s"))
    files = ("report.json", "report.md", "report.html", "gradients.json", "figures")

    def run(self, config, scenario, model, geometry, plans: dict,
            progress) -> tuple[dict[str, Any], dict[str, Any]]:
        from mpsimpact.runs.training import run_training

        plan = plans[config.attentions[0]]
        body, arrays = run_training(config, scenario, model, geometry, plan, progress)
        body["backward_prediction"] = predict(plan, geometry.batch_size, model.heads, "backward").to_json()
        return body, arrays

    def figures(self, report: dict, arrays: dict) -> dict[str, bytes]:
        from mpsimpact.runs.figures import render_training

        return render_training(report, arrays)

    def extra_files(self, report: dict, arrays: dict) -> dict[str, bytes]:
        return {"gradients.json": (json.dumps(arrays["gradient_errors"], indent=1) + "\n").encode("utf-8")}

    def damage(self, report: dict, off: dict) -> str:
        return (f"{off.get('corrupted_count') or 0} of {report['geometry']['batch_size']} logits and "
                f"{off.get('corrupted_gradient_tensors') or 0} gradient tensors came back wrong.")

    def console_table(self, report: dict):
        table = super().console_table(report)
        table.title += f", {report['config']['steps']} step(s)"
        return table

    def console_lines(self, report: dict) -> list[str]:
        lines = []
        for c in report["conditions"]:
            lines += [f"guard {c['guard']}: {op['op']} {op['a']} @ {op['b']}: {op['kind']} in "
                      f"{' and '.join(op['phases'])}" for op in c.get("faulted_ops", [])]
            if c.get("message"):
                lines.append(f"guard {c['guard']}: {c['status']} in {c['phase']}: {c['message']}")
        return lines
