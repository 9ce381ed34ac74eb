"""`mpsimpact run finetune` at a reduced index width (2**23, 16 texts at 256 tokens replayed at 64):
what one oversized training step does under each guard condition; and the memory preflight that
refuses a step that would not fit, before anything big is allocated."""

import json
import re

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from said import one_message

runner = CliRunner()


@pytest.mark.ci  # a whole run, 7 to 12 s: CI runs it after the default selection (pytest -m ci)
def test_training_step_under_each_guard(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("mpsimpact.scenarios.finetune.EVAL_TEXTS", 64)  # 512 evaluate the same code 8x longer
    out = tmp_path / "ft"
    # 2.14.0: on 2.13.0 (the installed torch) the scale on scores past LIMIT aborts first. Index width 22:
    # 8 texts of 256 tokens cross it as 16 x 256 cross 23 bits, for half the arithmetic.
    args = ["run", "finetune", "--batch-size", "8", "--max-length", "256", "--index-bits", "22",
            "--torch-profile", "2.14.0", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    off, stop, chunk = report["conditions"]
    # Forward: P V wraps from text 5 (2**22 / (12*256*256) = 5.3, as in `run sentiment`). Backward, first: the
    # FFN's bias gradient sums (8*256, 1536) = 3,145,728 > 2**21 - 1 elements, which 2.14.0 refuses (its sum
    # needs 64-bit indexing, inferred from the 1-D sum); then grad_V = P^T @ G would read P through a
    # transposed view of 8*12*256*256 >= 2**21 elements (rule 2 raises). Either way the step fails loudly instead of
    # returning silently wrong gradients.
    assert (off["status"], off["phase"], off["corrupted_count"]) == ("error", "backward", 3)
    assert "sum_reduction: tensors requiring 64-bit indexing are not supported" in off["message"]
    assert {(o["kind"], tuple(o["phases"])) for o in off["faulted_ops"]} == {("wrong_tail", ("forward",)), ("error", ("backward",))}
    assert report["backward_prediction"]["stops"]["kind"] == "error"
    assert (stop["status"], stop["phase"]) == ("stopped_by_guard", "forward") and "in forward" in stop["message"]
    assert chunk["status"] == "completed" and chunk["corrupted_gradient_tensors"] == 0
    assert chunk["max_gradient_rel_error"] < 1e-4 and chunk["eval_flips_after_training"] == 0
    assert report["reference"]["eval_texts"] == 64
    assert (out / "gradient_error_by_layer.png").stat().st_size > 0 and (out / "gradients.json").is_file()


def test_a_step_that_does_not_fit_is_refused_before_anything_big_is_allocated(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from mpsimpact.runs import device, training
    from mpsimpact.models.classifier import embedded_model_path
    from mpsimpact.runs.device import GIB
    from mpsimpact.prediction.memory import estimate_training_bytes

    monkeypatch.setattr(device, "host_memory", lambda: (24 * GIB, 2 * GIB))  # total, available
    monkeypatch.setattr(training, "run_training", lambda *args: pytest.fail("the training step started"))
    out = tmp_path / "ft"
    result = runner.invoke(app, ["run", "finetune", "--batch-size", "4096", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = [one_message(result.stderr)]
    assert "Traceback" not in result.output, result.output
    assert lines[0].startswith("error: This run needs about ") and (
        "for one training step (activations kept for backward, gradients, Adam state) at 4096 x 64; "
        "cpu offers 2.0 GiB. Use --batch-size " in lines[0]), lines[0]
    fits = int(re.fullmatch(r".* Use --batch-size (\d+) or less\.", lines[0]).group(1))
    config = AutoConfig.from_pretrained(embedded_model_path())
    # The named batch is the largest that fits at the run length the CPU uses (64).
    assert estimate_training_bytes(config, fits, 64) <= 2 * GIB < estimate_training_bytes(config, fits + 1, 64)
    assert 0 < fits < 4096 and not out.exists() and not list(tmp_path.iterdir())
