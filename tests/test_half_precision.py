"""Half precision and demo sizing: a bfloat16 run judged against a same-dtype small-batch reference,
and `plan --memory` choosing the smallest clear demo that fits a Mac."""

import json

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.engine.mac_memory import MacMemory
from mpsimpact.prediction.demo_size import visible_batch
from said import flat

runner = CliRunner()


@pytest.mark.ci  # whole commands end to end: CI runs it after the default selection (pytest -m ci)
def test_bfloat16_run_corrupts_the_same_texts_judged_against_a_same_dtype_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    # P (16*12, 256, 256): 2**23 / 65536 = 128 batch-heads -> divmod(128, 12) = text 10: 6 texts.
    # 2.14.0: on 2.13.0 (the installed torch) the scale on scores past LIMIT aborts first
    result = runner.invoke(app, ["run", "sentiment", "--batch-size", "16", "--max-length", "256", "--index-bits", "23",
                                 "--dtype", "bfloat16", "--torch-profile", "2.14.0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    off, stop, chunk = report["conditions"]
    assert report["geometry"]["dtype"] == "bfloat16" and "bfloat16" in report["geometry"]["mode"]
    assert report["reference"]["judged_against"] == "cpu bfloat16, small batches" and report["reference"]["threshold"] == 0.02
    assert (off["corrupted_count"], off["first_corrupted_index"], off["corrupted_contiguous_to_end"]) == (6, 10, True)
    assert stop["status"] == "stopped_by_guard" and (chunk["corrupted_count"], chunk["max_relative_error"]) == (0, 0.0)
    # The guard names the call as it runs (the plan is traced in the run's dtype).
    assert "(bfloat16) in forward" in stop["message"] and "float32" not in stop["message"]
    assert "flips_vs_fp32" in off and off["fp32_reference_accuracy"] == report["reference"]["accuracy"]


def test_memory_sizes_and_the_visible_margin():
    mac = MacMemory.of_size(32)
    assert (mac.working_set, mac.largest_buffer) == (int(32 * 2**30 * 2 / 3), 16 * 2**30)  # about 21.3 GiB, half
    # 1365 first corrupted: max(64, ceil(0.05 * 1365 / 0.95) = 72) more texts.
    assert visible_batch(1365) == 1437


def plan_memory(size, profile="2.14.0"):
    # 2.14.0: the P V wrap alone; on 2.13.0 (the installed torch) the scale on scores past 2**32 aborts first
    result = runner.invoke(app, ["plan", "sentiment", "--memory", size, "--json", "--torch-profile", profile])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["memory"]


def test_32gb_gets_a_half_precision_demo_that_fits_and_corrupts_visibly():
    memory = plan_memory("32GB")
    rec = memory["recommendation"]
    assert memory["budget_gib"] == 21.3 and rec["option"]["dtype"] in ("float16", "bfloat16")
    assert rec["option"]["estimated_peak_gib"] <= 21.3 and rec["option"]["corrupted_count"] >= 64
    assert rec["command"] == f"mpsimpact run sentiment --batch-size {rec['option']['batch_size']} --max-length 512 --dtype float16"
    row = next(r for r in memory["mac_table"] if r["mac_gb"] == 32)
    assert row["float32"]["corrupted_texts"] == 0 < row["float16"]["corrupted_texts"]


def test_8gb_says_no_run_shows_the_effect_and_why():
    # Every demo's P has more than 2**32 elements: 8 GiB in half precision, past an 8 GB Mac's 4 GiB buffer.
    rec = plan_memory("8GB")["recommendation"]
    assert rec["command"] is None and "more than 2^32 numbers (8 GiB in half precision" in rec["why"]
    assert "buffer of 4.0 GiB or more there" in rec["why"] and "Invalid buffer size" in rec["why"]
    assert rec["smallest_mac"]["mac_gb"] == 18


def test_where_the_buffer_fits_but_the_working_set_does_not_the_answer_says_so():
    from mpsimpact.prediction.demo_size import RunAsked, recommend

    option = {"attention": "blocked_eager", "dtype": "float16", "max_length": 512, "batch_size": 1398,
              "first_corrupted_text": 1365, "corrupted_count": 33, "outcome": "33 texts wrong from text 1365",
              "estimated_peak_gib": 9.8, "largest_tensor_gib": 8.19}
    # A Mac measured with a 12 GiB buffer but lending only 8 GiB: the working set, not the buffer, binds.
    mac = MacMemory(None, 12 * 2**30, 8 * 2**30, "measured", "M9, today")
    rec = recommend([option], mac, RunAsked("sentiment"))
    assert rec["command"] is None and "No run shows the effect in 8.0 GiB" in rec["why"]
    assert "needs about 9.8 GiB" in rec["why"] and "Invalid buffer size" not in rec["why"]


def test_on_2_13_0_only_blocked_eager_shows_the_effect():
    # Eager attention's scale on the > 2**32 scores aborts on 2.13.0 (inferred) before its P V; blocked_eager
    # scales a block at a time, so its P V wrap (wrong on every release) is what the run shows.
    memory = plan_memory("32GB", "2.13.0")
    assert {o["attention"] for o in memory["options"]} == {"blocked_eager"}
    # float32 fits the working set (20.1 GiB of 21.3) but its P (16.4 GiB) reaches the 16 GiB buffer: half precision
    assert memory["recommendation"]["command"].endswith("--max-length 512 --dtype float16 --attention blocked_eager")


def test_no_silent_option_says_where_the_run_stops():
    from mpsimpact.prediction.demo_size import RunAsked, recommend

    rec = recommend([], MacMemory.of_size(16), RunAsked("sentiment"))
    assert rec["command"] is None and "stops the run" in rec["why"]


def test_bad_memory_and_dtype_are_one_line(tmp_path):
    result = runner.invoke(app, ["plan", "sentiment", "--memory", "lots"])
    assert result.exit_code == 2 and "--memory: 'lots' is not a Mac's unified memory: give a size such as 16GB" in flat(result.stderr)
    result = runner.invoke(app, ["run", "sentiment", "--dtype", "float8", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--dtype must be one of float32, float16, bfloat16; got 'float8'." in flat(result.stderr)


def test_mps_preflight_counts_the_dtype_and_names_the_plan_command(monkeypatch):
    import types

    import pytest

    import mpsimpact.runs.device_pass as workload
    from mpsimpact.errors import MemoryPreflightError
    from mpsimpact.config import RunConfig

    config = types.SimpleNamespace(hidden_size=384, num_attention_heads=12, intermediate_size=1536, vocab_size=30522, num_hidden_layers=6)
    model = types.SimpleNamespace(config=config, max_positions=512)
    monkeypatch.setattr(workload, "device_memory", lambda device: int(21.3 * 2**30))  # a 32 GB Mac
    # 1438 x 512 needs about 39.4 GiB in float32 and 19.7 GiB in float16 (memory.estimate_peak_bytes); with
    # blocked_eager (taken where eager does not fit, tests/test_blocked_attention.py) 20.1 and 10.1 GiB.
    with pytest.raises(MemoryPreflightError, match="plan sentiment --memory auto"):
        workload.decide_geometry(RunConfig(device="mps"), model, "mps", 2048, 512, training=False)
    monkeypatch.setattr(workload, "check_memory", lambda *args: None)
    geometry = workload.decide_geometry(RunConfig(device="mps", dtype="float16"), model, "mps", 1438, 512, training=False)
    assert (geometry.run_length, geometry.emulated, geometry.attentions) == (512, False, ("eager",))
