"""A Mac's own memory in the fault model (issue 45): the largest buffer MPS allocates ("Invalid buffer size",
PyTorch's MPSAllocator) and the working set, in the rules, plan, check, run, the emulator and doctor's
measurement. Sizes: Apple's "16 GB" is 16 GiB; the buffer is assumed half of it (docs/fault-model.md, section 8)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.engine.call import CallRecord
from mpsimpact.engine.fault_plan import FaultPlan
from mpsimpact.engine.faults import TensorSpec
from mpsimpact.engine.mac_memory import (
    BUFFER_RULE, MacMemory, format_size, is_allocation_failure, largest_allocation, measure_mac, read_measured,
    this_mac,
)
from mpsimpact.errors import EmulatedMpsError, OversizedOpError
from mpsimpact.modes.emulator import emulate
from mpsimpact.modes.guard import guard
from mpsimpact.modes.tracer import UNDECIDED
from said import flat, one_message

runner = CliRunner()
GIB = 1 << 30


def test_sizes_print_as_mps_prints_them_and_the_buffer_is_half_the_memory():
    # MPSAllocator's format_size: two decimals, "GB" for GiB (the published "Invalid buffer size: 9.75 GB").
    assert (format_size(1024), format_size(1536), format_size(int(9.75 * GIB))) == ("1024 bytes", "1.50 KB", "9.75 GB")
    mac = MacMemory.of_size(16)
    assert (mac.largest_buffer, mac.working_set) == (8 * GIB, int(16 * GIB * 2 / 3))
    assert mac.refuses(8 * GIB) and not mac.refuses(8 * GIB - 1)  # size < maxBufferLength passes
    assert mac.buffer_at(23) == 8 * GIB >> 9  # scaled with every other limit at a narrow index width


def p_v(texts: int, dtype: str = "float16") -> CallRecord:
    """Eager attention's P V product of MiniLM at 512 tokens: P (texts*12, 512, 512) @ V (texts*12, 512, 32)."""
    a = TensorSpec.contiguous((texts * 12, 512, 512), dtype)
    b = TensorSpec.contiguous((texts * 12, 512, 32), dtype)
    return CallRecord(0, "bmm", a, b, UNDECIDED)


def decided(call: CallRecord, mac: MacMemory | None):
    return FaultPlan.from_trace((call,), 32, "2.14.0", mac).calls[0].fault


def test_a_tensor_at_the_buffer_is_refused_before_and_instead_of_the_silent_wrap():
    # 1398 texts: P has 1398 * 12 * 512**2 = 4.40e9 elements > 2**32 (the wrap), 8.19 GiB in half precision.
    assert decided(p_v(1398), None).kind == "wrong_tail"
    on_16 = decided(p_v(1398), MacMemory.of_size(16))  # 8 GiB buffer: refused, loud
    assert (on_16.kind, on_16.rule, on_16.message) == ("error", BUFFER_RULE, "Invalid buffer size: 8.19 GB")
    assert decided(p_v(1398), MacMemory.of_size(24)).kind == "wrong_tail"  # 12 GiB buffer: the silent wrap
    # Below 2**32 elements nothing is silent, but 1024 texts' float32 P is 1024 * 12 * 512**2 * 4 bytes = 12 GiB:
    # refused at a 24 GB Mac's 12 GiB buffer (size < buffer passes), not at a 32 GB Mac's 16 GiB.
    assert decided(p_v(1024, "float32"), MacMemory.of_size(24)).message == "Invalid buffer size: 12.00 GB"
    assert decided(p_v(1024, "float32"), MacMemory.of_size(32)).is_ok


def plan_json(*args):
    result = runner.invoke(app, ["plan", "sentiment", "--json", "--torch-profile", "2.14.0", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_plan_on_a_declared_mac_stops_where_the_buffer_refuses_and_sizes_batches_by_it():
    # Without a Mac (tests/test_plan.py): 683 of 2048 texts wrong, largest safe batch 2**32 // (12 * 512**2) = 1365.
    mac = plan_json("--memory", "16GB")
    # 2048 texts in float32: the scores (2048*12, 512, 512) are 24 GiB, past the 8 GiB buffer: MPS raises first.
    assert mac["prediction"]["outcome"] == "error" and mac["mac"]["largest_buffer_gib"] == 8.0
    assert mac["prediction"]["stops"][0]["message"] == "Invalid buffer size: 24.00 GB"
    # On 16 GB the float32 scores stay under 8 GiB up to 2**31 // (12 * 512**2) = 682 texts; the run's peak must
    # also stay within MPS's high watermark (1.7 x the working set): safe means it runs (issue 58).
    safe, watermark = mac["largest_safe_batch"], mac["mac"]["high_watermark_gib"]
    assert 0 < safe <= 682 and mac["largest_safe_batch_by_length"]["128"] <= 2**31 // (12 * 128**2)
    at_safe, past = plan_json("--memory", "16GB", "--batch-size", str(safe)), plan_json(
        "--memory", "16GB", "--batch-size", str(safe + 1))
    assert at_safe["prediction"]["outcome"] == "clean" and at_safe["estimated_peak_gib"] <= watermark
    assert past["prediction"]["outcome"] == "error"  # the buffer, or the watermark: it does not run


LLAMA_3_8B = {  # Llama-3-8B's attention (32 heads of 128, 8 key/value heads), two of its 32 layers, in float16
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 2, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "torch_dtype": "float16", "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def llama_checks(tmp_path_factory):
    config = tmp_path_factory.mktemp("llama3") / "config.json"
    config.write_text(json.dumps(LLAMA_3_8B))

    def check(*memory):
        result = runner.invoke(app, ["check", str(config), "--seq-len", "11586", "--attention", "eager",
                                     "--torch-profile", "2.14.0", "--json", *memory])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    return {memory: check(*(("--memory", memory) if memory else ())) for memory in (None, "16GB", "64GB")}


def test_check_on_a_16gb_mac_says_the_scores_cannot_be_allocated_and_the_longest_length_that_can(llama_checks):
    # 32 * 11586**2 = 4,295,532,672 scores > 2**32: silently wrong by the index rules; in float16 8.59e9 bytes,
    # past a 16 GB Mac's 8 GiB buffer, so there MPS raises instead.
    report = llama_checks["16GB"]
    assert report["prediction"]["outcome"] == "error" and report["prediction"]["first_wrong_sample"] is None
    stop = report["prediction"]["stops"][0]
    assert (stop["rule"], stop["message"], stop["op"]) == (BUFFER_RULE, "Invalid buffer size: 8.00 GB", "bmm")
    # Llama's softmax runs in float32: 32 * L**2 * 4 bytes < 2**33 up to L = 8191 (8192**2 * 128 = 2**33); the
    # run's peak must also stay within MPS's high watermark, which cuts it shorter still (issue 58).
    assert 0 < report["longest_safe_length"] < 8191 and report["largest_safe_batch"] == 0
    assert "No guard mode makes call" in report["guard_advice"][0]


def test_check_on_a_64gb_mac_and_with_no_mac_give_todays_silent_answer(llama_checks):
    plain, big = llama_checks[None], llama_checks["64GB"]
    assert "mac" not in plain and big["mac"]["largest_buffer_gib"] == 32.0
    keys = ("prediction", "largest_safe_batch", "longest_safe_length", "faulting_calls", "guard_advice")
    assert all(plain[key] == big[key] for key in keys)
    assert plain["prediction"]["outcome"] == "wrong" and plain["prediction"]["first_wrong_sample"] == 0
    assert plain["longest_safe_length"] == 11585  # 32 * 11585**2 <= 2**32


def test_the_emulator_on_a_mac_raises_mps_own_text_for_an_allocation_at_the_buffer():
    # At 20 bits the 16 GB Mac's buffer scales to 8 GiB >> 12 = 2 MiB: 2**19 float32 numbers.
    a, b = torch.randn(8, 256, 64), torch.randn(8, 64, 256)  # output 8 * 256 * 256 * 4 bytes = 2 MiB: refused
    with emulate(index_bits=20, profile="2.14.0", memory="16GB") as mode:
        torch.bmm(a[:4], b[:4])  # 1 MiB: runs
        with pytest.raises(EmulatedMpsError, match=r"Invalid buffer size: 8\.00 GB") as error:
            torch.bmm(a, b)
        with pytest.raises(EmulatedMpsError, match="Invalid buffer size"):
            torch.zeros(2**19)  # a creation op, judged on the output it will make
    assert error.value.fields["fault"].rule == BUFFER_RULE and mode.records[-1].fault.rule == BUFFER_RULE
    with emulate(index_bits=20, profile="2.14.0", memory="24GB"):  # 3 MiB at 20 bits
        assert torch.bmm(a, b).shape == (8, 256, 256)


def test_no_guard_mode_hides_the_macs_refusal_behind_its_own_stop_or_split():
    # A replayed plan whose P V call the 16 GB Mac refuses: under guard raise or chunk it still meets MPS's
    # own error (a guard splits a computation, never one tensor).
    call = p_v(1398)
    plan = FaultPlan.from_trace((call,), 32, "2.14.0", MacMemory.of_size(16))
    a, b = torch.randn(1398 * 12, 4, 4), torch.randn(1398 * 12, 4, 2)
    for mode in ("raise", "chunk"):
        with emulate(plan=plan), guard(mode):
            with pytest.raises(EmulatedMpsError, match="Invalid buffer size: 8.19 GB"):
                torch.bmm(a, b)
    # Without the Mac the same plan is the wrap, which the guard stops.
    with pytest.raises(OversizedOpError), emulate(plan=plan.on_mac(None)), guard("raise"):
        torch.bmm(a, b)


def run_json(tmp_path, name, *args, quick=True):
    out = tmp_path / name
    result = runner.invoke(app, ["run", "sentiment", *(["--quick"] if quick else []), "--torch-profile", "2.14.0",
                                 "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text()), result.stdout


@pytest.mark.ci  # whole commands end to end: CI runs it after the default selection (pytest -m ci)
def test_an_emulated_run_on_a_small_mac_stops_with_invalid_buffer_size_and_a_big_one_is_todays(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    # --quick at 23 bits stands for 4.4 times 2**32 float32 scores (24 GiB at full scale): past a 16 GB Mac's
    # buffer at 8 GiB (scaled: 16 MiB), under a 64 GB Mac's 32 GiB.
    small, said = run_json(tmp_path, "16", "--memory", "16GB")
    assert small["mac"]["label"] == "a 16 GB Mac"
    assert all(c["status"] == "error" and c["buffer_refused"] == "Invalid buffer size: 24.00 GB"
               for c in small["conditions"])
    assert "Not silent: on a 16 GB Mac" in said and "Invalid buffer size" in said
    assert any("one buffer of at most 8.0 GiB (assumed: half of 16 GB unified memory)" in n for n in small["notes"])
    # At full length (no plan replayed: what a CUDA machine runs) the emulator holds each op against the buffer.
    direct, _ = run_json(tmp_path, "16-direct", "--memory", "16GB", "--run-length", "256", "--guard", "off")
    (off,) = direct["conditions"]
    assert not direct["geometry"]["replayed"] and off["buffer_refused"] == "Invalid buffer size: 24.00 GB"
    # As without a Mac (the README's --quick figures): 6 texts wrong from text 10, raise stops, chunk is clean.
    big, _ = run_json(tmp_path, "64", "--memory", "64GB")
    keys = ("status", "corrupted_count", "first_corrupted_index")
    assert [[c.get(k) for k in keys] for c in big["conditions"]] == [
        ["completed", 6, 10], ["stopped_by_guard", None, None], ["completed", 0, None]]


def test_bad_memory_values_are_one_line_everywhere(tmp_path):
    for command in (["plan", "sentiment"], ["check", "bert-base-uncased"], ["run", "sentiment"]):
        result = runner.invoke(app, [*command, "--memory", "16 TB", "--out", str(tmp_path / "never")])
        assert result.exit_code == 2 and one_message(result.stderr), result.output
        assert "--memory: '16 TB' is not a Mac's unified memory" in flat(result.stderr)
    result = runner.invoke(app, ["plan", "sentiment", "--memory", "auto"])  # no Apple GPU here
    assert result.exit_code == 2 and "needs a Mac with MPS" in flat(result.stderr)
    assert not (tmp_path / "never").exists()


def test_the_bisection_finds_the_largest_accepted_allocation_and_the_cache_keeps_it_with_the_machine(
        tmp_path, monkeypatch):
    limit, real_empty = 9 * GIB + 12345, torch.empty  # maxBufferLength: sizes below it are accepted

    def fake_empty(n, dtype=None, device=None):
        if n >= limit:
            raise RuntimeError(f"Invalid buffer size: {format_size(n)}")
        return real_empty(0)

    assert largest_allocation(lambda n: n < limit, 18 * GIB) in range(limit - (1 << 20), limit)
    monkeypatch.setattr(torch, "empty", fake_empty)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * GIB)
    mac = measure_mac(tmp_path, "Apple M3 Pro, 19327352832 bytes")
    assert mac.basis == "measured" and limit - (1 << 20) < mac.largest_buffer <= limit
    assert read_measured(tmp_path, "Apple M3 Pro, 19327352832 bytes") == mac
    assert read_measured(tmp_path, "Apple M1, 8589934592 bytes") is None  # another machine: measured again
    monkeypatch.setattr("mpsimpact.engine.mac_memory.machine_key", lambda: "Apple M3 Pro, 19327352832 bytes")
    assert this_mac(tmp_path) == mac  # plan --memory auto and run on MPS read it back


def test_allocation_failures_are_told_from_faults():
    assert is_allocation_failure(RuntimeError("Invalid buffer size: 8.19 GB"))
    assert is_allocation_failure(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB ...)"))
    assert is_allocation_failure(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_allocation_failure(RuntimeError("MPSGraph does not support tensor dims larger than INT_MAX"))


def test_the_24gb_demos_plan_on_24gb_is_the_plan_without_a_mac_and_on_16gb_stops_at_p():
    # What an emulated run replays, call by call (the slow test below runs it): the 24 GB demo's calls traced at
    # full scale (1398 x 512, float16, blocked_eager), every op and allocation, decided on each Mac.
    from mpsimpact.prediction.meta_model import trace_meta
    from mpsimpact.runs.scenario import get_scenario

    scenario = get_scenario("sentiment")()
    meta = scenario.meta_module(scenario.load_config(), attention="blocked_eager").to(torch.float16)
    plan = trace_meta(meta, 1398, 512, every_op=True, allocations=True, profile="2.14.0")
    on_24, on_16 = plan.on_mac(MacMemory.of_size(24)), plan.on_mac(MacMemory.of_size(16))
    assert [(c.op, c.fault) for c in on_24.faults] == [(c.op, c.fault) for c in plan.faults]
    assert [c.fault.kind for c in plan.faults] == ["wrong_tail"] * 6  # the six P V products, one per layer
    stop = on_16.first_stop
    assert (stop.op, stop.fault.message, list(stop.b.shape)) == ("new_empty", "Invalid buffer size: 8.19 GB",
                                                                 [1398, 12, 512, 512])
    assert not any(c.fault.is_silent for c in on_16.calls if c.index < stop.index)  # no wrong value before it


DEMO_24GB = ["--batch-size", "1398", "--max-length", "512", "--dtype", "float16", "--attention", "blocked_eager"]


@pytest.mark.slow
def test_the_24gb_demo_emulated_on_a_16gb_mac_stops_and_on_24gb_is_todays_run(tmp_path, monkeypatch):
    # The command `plan --memory 24GB` recommends, as typed, on the CPU (4 to 8 minutes each: the float16
    # references). On 16 GB its P (1398*12, 512, 512) in float16, 8.19 GiB, is refused where it is allocated.
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    small, said = run_json(tmp_path, "16", *DEMO_24GB, "--memory", "16GB", quick=False)
    assert all(c["status"] == "error" and c["buffer_refused"] == "Invalid buffer size: 8.19 GB"
               and c["wrong_values_before_stop"] == 0 for c in small["conditions"])
    assert "Not silent: on a 16 GB Mac" in said and "the attention probabilities P, allocated whole" in said
    big, _ = run_json(tmp_path, "24", *DEMO_24GB, "--memory", "24GB", "--guard", "off", quick=False)
    (off,) = big["conditions"]
    assert (off["corrupted_count"], off["first_corrupted_index"], len(off["altered_calls"])) == (33, 1365, 6)


def test_an_emulated_run_past_the_macs_high_watermark_is_refused_before_a_tensor_and_plans_batch_runs(tmp_path,
                                                                                                     monkeypatch):
    # Issue 58: "safe" means it runs. MPS stops a process whose total passes its high watermark; the emulator
    # holds each tensor to the buffer but cannot know a Mac's total, so run refuses what plan predicts stops, and
    # the batch plan then gives runs. The ratio is lowered (PYTORCH_MPS_HIGH_WATERMARK_RATIO, as on a Mac) so a
    # small run meets it: 0.03 x an 8 GB Mac's 5.3 GiB working set is about 0.16 GiB.
    monkeypatch.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "0.03")
    common = ["sentiment", "--memory", "8GB", "--max-length", "128", "--torch-profile", "2.14.0"]
    out = tmp_path / "never"
    result = runner.invoke(app, ["run", *common, "--device", "cpu", "--batch-size", "64", "--out", str(out)])
    text = flat(result.output)
    assert result.exit_code == 2, result.output
    assert "On an 8 GB Mac this run needs about" in text and "'MPS backend out of memory" in text, text
    assert "nothing was run" in text and "mpsimpact plan sentiment --memory 8GB --max-length 128" in text, text
    assert not out.exists()
    plan = runner.invoke(app, ["plan", *common, "--batch-size", "64", "--json", "--out", str(tmp_path / "plan")])
    assert plan.exit_code == 0, plan.output
    report = json.loads(plan.stdout)
    assert report["prediction"]["outcome"] == "error" and "MPS backend out of memory" in report["prediction"]["describe"]
    safe = report["largest_safe_batch"]
    assert 0 < safe < 64
    fits = runner.invoke(app, ["run", *common, "--device", "cpu", "--batch-size", str(safe), "--guard", "off",
                               "--out", str(tmp_path / "fits")])
    assert fits.exit_code == 0, fits.output
    assert json.loads((tmp_path / "fits" / "report.json").read_text())["conditions"][0]["status"] == "completed"
