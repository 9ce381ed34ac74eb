"""`mpsimpact plan`: shape-only predictions against the published figures and against emulated runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.engine.release import installed_profile
from mpsimpact.errors import UsageError
from mpsimpact.modes.emulator import emulate
from mpsimpact.prediction.outcome import predict
from mpsimpact.prediction.meta_model import trace_meta
from mpsimpact.prediction.safe_size import largest_safe_batch, per_text_calls, plan_at
from tiny import tiny_bert, token_batch
from said import flat

runner = CliRunner()
ROBERTA = Path(__file__).parent / "data" / "twitter-roberta-base-sentiment-latest"
# The published arithmetic is the matrix-product rules'; 2.14.0 keeps them alone. On 2.13.0 (the installed
# torch) the scale and softmax on scores past 2**32 abort first (tests/test_versions.py, test_check.py).
PROFILE = "2.14.0"


def plan_json(*args):
    args = args if "--torch-profile" in args else (*args, "--torch-profile", PROFILE)
    result = runner.invoke(app, ["plan", "sentiment", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_embedded_model_at_4096_by_512_matches_the_published_arithmetic():
    report = plan_json("--batch-size", "4096", "--max-length", "512")
    pred = report["prediction"]
    # divmod(2**32 // 512**2, 12) = (1365, 4); 4096 - 1365 = 2731 texts.
    assert (pred["first_wrong_sample"], pred["first_wrong_head"], pred["wrong_samples"]) == (1365, 4, 2731)
    assert [(c["op"], c["a"], c["kind"]) for c in report["faulting_calls"]] == [("bmm", [49152, 512, 512], "wrong_tail")] * 6
    # floor(2**32 / (12 * L**2)) texts: the text the wrap starts in counts as unsafe.
    assert report["largest_safe_batch_by_length"] == {"128": 21845, "256": 5461, "384": 2427, "512": 1365}
    assert report["largest_safe_batch"] == 1365


PLAN_IN_A_CHILD = """
from mpsimpact.cli import app
from mpsimpact.errors import UsageError
try:
    app(['plan', 'sentiment', '--batch-size', '4096', '--max-length', '512', '--torch-profile', '2.14.0'])
except SystemExit as done:
    assert not done.code, done.code
status = dict(line.split(':', 1) for line in open('/proc/self/status'))
print('peak RSS KiB', status['VmHWM'].split()[0])
"""


@pytest.mark.ci  # fresh processes: CI runs it after the default selection (pytest -m ci)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from Linux's /proc")
def test_plan_runs_in_a_small_process():
    # The child reports VmHWM, the peak RSS of its own address space: ru_maxrss would carry over
    # the pytest parent's size through fork and exec, and RUSAGE_CHILDREN every earlier child's.
    done = subprocess.run([sys.executable, "-c", PLAN_IN_A_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2731 of 4096 texts silently wrong, from text 1365 (head 4)" in " ".join(done.stdout.split())
    peak_rss_gib = int(done.stdout.rsplit("peak RSS KiB", 1)[1]) / 2**20
    assert peak_rss_gib < 1.5, f"peak RSS {peak_rss_gib:.2f} GiB"


def test_published_roberta_config_predicts_the_feed_forward_abort():
    # 5462 * 256 * 3072 = 4,295,491,584 >= 2**32: the FFN's addmm aborts the process on MPS.
    report = plan_json("--model", str(ROBERTA), "--batch-size", "5462", "--max-length", "256")
    stop = report["prediction"]["stops"][0]
    assert stop["kind"] == "abort" and "Encode failed" in stop["message"]
    assert "intermediate" in stop["module"] and stop["out_numel"] == 5462 * 256 * 3072
    assert report["prediction"]["first_wrong_sample"] is None  # no silent outputs: the process dies
    assert report["largest_safe_batch_by_length"]["512"] == 1365
    clean = plan_json("--model", str(ROBERTA), "--batch-size", "1365", "--max-length", "512")
    assert clean["faulting_calls"] == [] and clean["prediction"]["wrong_samples"] == 0


def test_scaled_plan_equals_a_direct_trace():
    from mpsimpact.models.classifier import meta_classifier
    from transformers import AutoConfig

    meta = meta_classifier(AutoConfig.from_pretrained(ROBERTA), embedded=False)
    direct = trace_meta(meta, 1400, 512, every_op=True)  # the scaled calls hold every op too
    scaled = plan_at(per_text_calls(meta, 512), 1400, 32, installed_profile())
    assert [(c.op, c.a, c.b, c.fault) for c in direct.calls] == [(c.op, c.a, c.b, c.fault) for c in scaled.calls]


def test_plan_predicts_the_emulated_corrupted_set_on_a_tiny_model():
    meta, model = tiny_bert("meta"), tiny_bert()
    calls = per_text_calls(meta, 64)
    # P per text 4 * 64 * 64 = 16384; at 2**16 the wrap starts at row 16 = text 4.
    assert largest_safe_batch(calls, heads=4, index_bits=16, profile=PROFILE) == 4
    for batch in (4, 5, 10):
        prediction = predict(plan_at(calls, batch, 16, PROFILE), batch, 4)
        ids = token_batch(batch, 64)
        with torch.inference_mode():
            ref = model(input_ids=ids).last_hidden_state
            with emulate(index_bits=16, profile=PROFILE):
                got = model(input_ids=ids).last_hidden_state
        err = (got - ref).abs().amax(dim=(1, 2)) / ref.abs().amax(dim=(1, 2))
        corrupted = set(torch.nonzero(err > 1e-3).flatten().tolist())
        expected = set(range(prediction.first_corrupted_text, batch)) if prediction.first_corrupted_text is not None else set()
        assert corrupted == expected, batch


def test_backward_plan_lists_gradient_products():
    report = plan_json("--batch-size", "4096", "--max-length", "512", "--backward")
    assert report["backward_faulting_calls"] > 0
    assert any(c["phase"] == "backward" and c["kind"] == "error" for c in report["faulting_calls"])


def test_sweep_table_and_figure(tmp_path):
    figure = tmp_path / "sweep.png"
    report = plan_json("--batch-size", "1024", "--max-length", "128", "--sweep", "--figure", str(figure))
    row = {r["batch"]: r["corrupted_fraction"] for r in report["sweep"]["512"]}
    assert row[1365] == 0 and row[1366] == 1 / 1366 and abs(row[4096] - 2731 / 4096) < 1e-12
    assert figure.stat().st_size > 0


def test_run_on_real_mps_skips_a_predicted_process_abort():
    from mpsimpact.models.classifier import meta_classifier
    from mpsimpact.runs.device_pass import skipped_abort, would_abort
    from mpsimpact.runs.device_pass import Geometry
    from transformers import AutoConfig

    meta = meta_classifier(AutoConfig.from_pretrained(ROBERTA), embedded=False)
    prediction = predict(plan_at(per_text_calls(meta, 256), 5462, 32, installed_profile()), 5462, 12)
    mac = Geometry("mps", False, 5462, 256, 256)
    assert would_abort(mac, prediction, "off") and not would_abort(mac, prediction, "chunk")
    assert not would_abort(Geometry("cpu", True, 5462, 256, 64), prediction, "off")  # emulated: raises instead
    skipped = skipped_abort("off", prediction)
    assert skipped["status"] == "skipped_predicted_abort" and "would abort the process on MPS" in skipped["message"]


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta", "camembert"])
def test_plan_and_run_agree_on_the_usable_length(tmp_path, model_type):
    from mpsimpact.prediction.meta_model import usable_positions

    config = json.loads((ROBERTA / "config.json").read_text()) | {"model_type": model_type}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # 514 positions, of which padding_idx + 1 = 2 are reserved: 512 usable, by the same function run uses.
    assert usable_positions(type("C", (), config)) == 512
    result = runner.invoke(app, ["plan", "sentiment", "--model", str(tmp_path), "--batch-size", "2", "--max-length", "513"])
    assert result.exit_code == 2 and "--max-length 513 exceeds the model's 512 positions." in flat(result.stderr)
    assert plan_json("--model", str(tmp_path), "--batch-size", "2", "--max-length", "512")["config"]["max_length"] == 512


def test_plan_and_run_agree_under_an_unmeasured_release(tmp_path):
    # 2.15.0 (conservative): Q K^T (call 12) is wrong in a pattern nobody characterised, then the scale on the
    # scores (call 13) aborts. The run's emulator stops at call 12 ('not emulated'); the plan must say so,
    # not only "aborts at call 13".
    args = ["--batch-size", "16", "--max-length", "256", "--index-bits", "23", "--torch-profile", "2.15.0"]
    plan = runner.invoke(app, ["plan", "sentiment", *args], env={"COLUMNS": "200"})
    assert plan.exit_code == 0, plan.output
    text = " ".join(plan.output.split())
    assert "MPS aborts the process at call 13 (mul in encoder.encoder.layer.0.attention.self)" in text
    assert ("Before it, call 12 (bmm in encoder.encoder.layer.0.attention.self) returns wrong values in a pattern "
            "nobody characterised; an emulated run stops there instead of inventing them.") in text
    run = runner.invoke(app, ["run", "sentiment", *args, "--guard", "off", "--out", str(tmp_path / "run")])
    assert run.exit_code == 0, run.output
    off = json.loads((tmp_path / "run" / "report.json").read_text())["conditions"][0]
    assert off["status"] == "not_emulated" and off["message"].startswith("bmm[192, 256, 32] @ [192, 32, 256]")


@pytest.mark.parametrize("backward", [False, True])
def test_scaled_calls_equal_direct_traces_forward_and_backward(backward):
    calls = per_text_calls(tiny_bert("meta"), 64, backward=backward)
    # Backward: the weight gradients' x^T (16, B*64) grows in its last dim, with its stride.
    assert any(p.a_scales and p.call.a.shape[-1] != p.a4.shape[-1] for p in calls) == backward
    for batch in (3, 40, 100_000):
        direct = trace_meta(tiny_bert("meta"), batch, 64, backward=backward, every_op=True, index_bits=16)
        scaled = plan_at(calls, batch, index_bits=16, profile=installed_profile())
        assert [(c.op, c.a, c.b, c.fault) for c in scaled.calls] == [(c.op, c.a, c.b, c.fault) for c in direct.calls]


def test_backward_largest_safe_batch_at_128_is_where_a_direct_trace_first_faults():
    report = plan_json("--backward", "--batch-size", "2048")
    safe = report["largest_safe_batch_by_length"]["128"]
    assert safe == 10922  # P^T (B*12, 128, 128) as a view reaches 2**31 elements from 10923 texts on
    meta = meta_classifier_of_the_scenario()
    for batch, clean in ((safe, True), (safe + 1, False)):
        plan = trace_meta(meta, batch, 128, backward=True, every_op=True, profile=PROFILE)
        assert all(c.fault.is_ok for c in plan.calls) == clean


def meta_classifier_of_the_scenario():
    from mpsimpact.runs.scenario import get_scenario

    scenario = get_scenario("sentiment")()
    return scenario.meta_module(scenario.load_config())


class BatchBranching(torch.nn.Module):
    """Makes one more op from 4 texts on: its calls cannot be scaled from 2 and 4 texts."""

    def forward(self, input_ids):
        y = input_ids.float().unsqueeze(-1) @ torch.ones(1, 8, device=input_ids.device)  # (B, L, 8)
        return y * 2 if input_ids.shape[0] > 2 else y


def test_a_model_whose_calls_depend_on_the_batch_is_refused_not_scaled():
    with pytest.raises(UsageError, match="calls at 2 texts and at 4 differ"):
        per_text_calls(BatchBranching(), 16)


class HalfTheBatch(torch.nn.Module):
    """A product over ceil(B / 2) texts: 1 at 2 texts, 2 at 4, not a whole number of rows per text."""

    def forward(self, input_ids):
        x = input_ids.float().unsqueeze(-1)[: (input_ids.shape[0] + 1) // 2]  # (ceil(B/2), L, 1)
        return x @ torch.ones(1, 8, device=x.device)


def test_a_size_that_does_not_grow_by_whole_amounts_per_text_is_refused():
    with pytest.raises(UsageError, match="differ in more than sizes"):
        per_text_calls(HalfTheBatch(), 15)  # rows ceil(B / 2) * 15: 15 at 2 texts, 30 at 4
