"""blocked_eager: eager attention's one oversized call (P V of the whole batch) with everything else in blocks
of samples. It equals eager bit for bit, faults exactly where eager faults, peaks where its estimate says, and
`plan --memory` / `run` pick it for a Mac that eager does not fit."""

import json
import subprocess
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from mpsimpact.attention import blocked
from mpsimpact.cli import app
from mpsimpact.modes.emulator import emulate
from mpsimpact.prediction.memory import blocked_peak_bytes, estimate_peak_bytes, parameter_count
from mpsimpact.prediction.meta_model import trace_meta
from tiny import tiny_bert, token_batch
from said import one_message

runner = CliRunner()
NAME = blocked.register()
LENGTHS = torch.tensor([64, 60, 5, 64, 1, 13, 9, 64, 30, 2])  # padding in most texts, one text of one token


def padded_batch(batch, length):
    ids = token_batch(batch, length)
    lengths = LENGTHS.repeat(-(-batch // len(LENGTHS)))[:batch].clamp(max=length)
    return ids, (torch.arange(length)[None] < lengths[:, None]).long()


def forward(model, attention, ids, mask, samples=None):
    """Last hidden states under `attention`; with `samples`, blocked_eager's layers run in blocks of that many."""
    model.set_attn_implementation(attention)
    if samples:
        blocked.use_blocks(model, samples)
    try:
        return model(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        blocked.remove_blocks(model)


class MaskShapes(torch.overrides.TorchFunctionMode):
    """Records the shapes of every tensor added to the scores (the masks)."""

    def __init__(self):
        super().__init__()
        self.added = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("add", "__add__") and len(args) == 2 and args[0].dim() == 4:
            self.added.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("samples", [None, 1, 3])
def test_equals_eager_bit_for_bit_on_a_tiny_bert_with_padding(dtype, samples):
    # The same ops on the same values, a block of samples at a time (softmax is per row, the rest per
    # element or per sample; the mask row broadcast over the queries adds the same values), so no rounding
    # differs on the CPU. samples=None: the attention alone (P in blocks of its own), layers run whole.
    model = tiny_bert(max_position_embeddings=64).to(dtype)
    ids, mask = padded_batch(10, 64)
    with torch.inference_mode():
        expected = forward(model, "eager", ids, mask)
        with MaskShapes() as shapes:
            got = forward(model, NAME, ids, mask, samples)
    assert torch.equal(got, expected)
    # The mask is one row per text: (10, 1, 1, 64), not eager's (10, 1, 64, 64); sliced per block.
    blocks = -(-10 // samples) if samples else 1
    assert len(shapes.added) == 2 * blocks  # one fill step per block and layer
    assert all(shape[1:] == (1, 1, 64) for shape in shapes.added), shapes.added


def test_a_model_with_gradients_runs_its_layers_whole_and_still_equals_eager():
    model = tiny_bert(max_position_embeddings=64).train()  # dropout 0 in the tiny config
    ids, mask = padded_batch(6, 32)
    expected = forward(model, "eager", ids, mask)
    got = forward(model, NAME, ids, mask, samples=2)  # with grad: no in-place blocks, P in blocks only
    assert torch.equal(got, expected)
    got.sum().backward()
    assert all(p.grad is not None for p in model.encoder.parameters())


def test_under_emulation_it_alters_exactly_the_calls_eager_alters():
    # P per text 4 * 64 * 64 = 16384; at 2**16 the P V wrap starts at batch-head 4 = text 1: texts 1..9 wrong.
    model = tiny_bert(max_position_embeddings=64)
    ids, mask = padded_batch(10, 64)
    emulated = {}
    with torch.inference_mode():
        for attention, samples in (("eager", None), (NAME, 2)):
            with emulate(index_bits=16, profile="2.14.0") as mode:
                out = forward(model, attention, ids, mask, samples)
            emulated[attention] = out, [(r.op, r.a, r.b, r.fault, r.phase) for r in mode.records], mode.calls
        clean = forward(model, "eager", ids, mask)
    (eager, eager_calls, eager_count), (mine, my_calls, my_count) = emulated["eager"], emulated[NAME]
    assert torch.equal(mine, eager) and not torch.equal(eager, clean)  # the same wrong values
    assert my_calls == eager_calls and [c[0] for c in eager_calls] == ["bmm", "bmm"]  # P V of each layer
    assert my_count > eager_count  # the blocks really ran: more, smaller calls, none altered


def test_its_one_oversized_call_is_eagers_p_v_and_every_other_call_is_a_block():
    eager_plan = trace_meta(tiny_bert("meta", max_position_embeddings=64), 48, 64, every_op=True)
    meta = tiny_bert("meta", max_position_embeddings=64)
    meta.set_attn_implementation(NAME)
    blocked.use_blocks(meta, 5)
    plan = trace_meta(meta, 48, 64, every_op=True)
    p_v = [c for c in plan.products if c.a.shape == (48 * 4, 64, 64)]
    eager_p_v = [c for c in eager_plan.products if c.a.shape == (48 * 4, 64, 64)]
    assert [(c.a, c.b, c.fault) for c in p_v] == [(c.a, c.b, c.fault) for c in eager_p_v]  # shapes, layouts
    assert [c.module for c in p_v] == ["encoder.layer.0", "encoder.layer.1"]  # made between the block steps
    # Every other attention product covers one block of 5 texts (the last one 3): Q K^T (b*4, 64, 4) @ (b*4, 4, 64).
    scores = [c for c in plan.products if c.family == "bmm" and c not in p_v]
    assert {c.a.shape[0] for c in scores} == {20, 12} and len(scores) == 2 * 10


def test_a_layer_whose_attention_is_not_blocked_eager_is_refused_in_blocks():
    model = tiny_bert(max_position_embeddings=64)
    ids, mask = padded_batch(4, 16)
    blocked.use_blocks(model, 2)  # blocks without the attention that fills P
    try:
        with torch.inference_mode(), pytest.raises(blocked.MpsImpactError, match="made no attention call"):
            model(input_ids=ids, attention_mask=mask)
    finally:
        blocked.remove_blocks(model)


# Peak memory measured on the CPU: a subprocess resets its peak RSS (/proc/self/clear_refs, "5") after building
# the model and its inputs, runs one forward, and prints VmHWM - VmRSS. Every large allocation is mmap'ed
# (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once.
MEASURE = """
import json, sys, torch, transformers
from mpsimpact.attention import blocked
def status(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
torch.set_num_threads(1)
fields, attention, batch, length, samples = json.loads(sys.argv[1])
config = transformers.BertConfig(**fields)
model = transformers.BertModel._from_config(config, attn_implementation="eager").eval()
if attention != "eager":
    model.set_attn_implementation(blocked.register())
    blocked.use_blocks(model, samples)
ids = torch.randint(1, 64, (batch, length))
mask = (torch.arange(length)[None] < torch.randint(length // 2, length + 1, (batch, 1))).long()
with torch.inference_mode():
    model(input_ids=ids[:2, :8], attention_mask=mask[:2, :8])
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    model(input_ids=ids, attention_mask=mask)
    print(status("VmHWM") - before)
"""
# 4 heads over 256 tokens: P = 128 * 4 * 256**2 = 33.6M elements (128 MiB); each (B, L, D) 8 MiB.
FIELDS = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def measured_peak(attention, batch=128, length=256, samples=2):
    command = [sys.executable, "-c", MEASURE, json.dumps([FIELDS, attention, batch, length, samples])]
    done = subprocess.run(command, capture_output=True, text=True, env={"MALLOC_MMAP_THRESHOLD_": "65536",
                                                                        "PATH": "/usr/bin:/bin"})
    if done.returncode != 0 and "clear_refs" in done.stderr:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_the_blocked_estimate_is_under_half_of_eagers_at_the_measured_geometry():
    # The arithmetic the measured test below checks against a real peak, without the two processes.
    config = types.SimpleNamespace(**FIELDS)
    held = 4 * parameter_count(config, 256) + 2 * 8 * 128 * 256
    blocked_bytes = blocked_peak_bytes(config, 128, 256, 4, samples=2) - held
    eager_bytes = estimate_peak_bytes(config, 128, 256, 4, "eager") - held
    p_bytes = 128 * 4 * 256**2 * 4
    assert p_bytes < blocked_bytes < 0.5 * eager_bytes  # P itself, plus what the product holds beside it


@pytest.mark.slow  # two fresh processes each import torch and transformers and run a 128 x 256 batch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from Linux's /proc")
def test_the_blocked_estimate_against_a_peak_measured_on_the_cpu():
    config = types.SimpleNamespace(**FIELDS)
    # What the subprocess held before its reset (weights, ids and mask) is not in the measured peak.
    held = 4 * parameter_count(config, 256) + 2 * 8 * 128 * 256
    estimate = blocked_peak_bytes(config, 128, 256, 4, samples=2) - held
    measured, eager = measured_peak(NAME), measured_peak("eager")
    # At the product: P (128 MiB), V, the product's output and the hidden states (3 x 8 MiB) and the mask
    # rows, 152.1 MiB estimated (a fill step of 2 texts holds less); measured 152.6 MiB on a 2-core CPU.
    # Eager: scores and P, its (B, 1, L, L) mask, Q, K, V and more, 329 MiB (estimated 320).
    print(f"blocked: estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB; eager {eager / 2**20:.1f}")
    assert 0.95 < estimate / measured < 1.05, (estimate, measured)
    eager_estimate = estimate_peak_bytes(config, 128, 256, 4, "eager") - held
    assert measured < 0.5 * eager and 0.95 < eager_estimate / eager < 1.05


# The run: --attention blocked_eager, and on a Mac's GPU in place of eager where only it fits.

MINILM = types.SimpleNamespace(hidden_size=384, num_attention_heads=12, intermediate_size=1536, vocab_size=30522,
                               num_hidden_layers=6)
GIB = 2**30


def plan_memory(size):
    result = runner.invoke(app, ["plan", "sentiment", "--memory", size, "--json", "--torch-profile", "2.14.0"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["memory"]


def run_report(tmp_path, name, *args):
    out = tmp_path / name
    result = runner.invoke(app, ["run", "sentiment", *args, "--guard", "off", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads((out / "report.json").read_text())


DEMO_24GB = "mpsimpact run sentiment --batch-size 1398 --max-length 512 --dtype float16 --attention blocked_eager"


def test_the_24gb_demo_fits_in_16_gib_and_a_12_gib_buffer_and_corrupts_texts(tmp_path, monkeypatch):
    from mpsimpact.prediction.demo_size import HEADROOM

    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    rec = plan_memory("24GB")["recommendation"]
    option = rec["option"]
    assert rec["command"] == DEMO_24GB
    # P (1398*12, 512, 512) in fp16 is 8.2 GiB; with V, the product's output and the hidden states 9.8 GiB.
    assert option["estimated_peak_gib"] * HEADROOM <= 16.0 and 8.2 <= option["estimated_peak_gib"] <= 9.9
    assert 8.19 == option["largest_tensor_gib"] < 12.0  # P: 1398 * 12 * 512**2 * 2 bytes, under half of 24 GB
    assert (option["corrupted_count"], option["first_corrupted_text"]) == (33, 1365)


def test_a_16gb_mac_cannot_show_the_silent_fault_and_is_told_what_instead(tmp_path, monkeypatch):
    # Every silent fault needs a tensor past 2**32 elements, 8 GiB in half precision: a 16 GB Mac's largest buffer.
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    memory = plan_memory("16GB")
    rec = memory["recommendation"]
    assert rec["command"] is None and not any(o["fits"] for o in memory["options"])
    assert all(o["largest_tensor_gib"] >= 8.0 for o in memory["options"])
    assert "No run can show the silent fault on a 16 GB Mac" in rec["why"] and "Invalid buffer size" in rec["why"]
    # The smallest Mac that can (an 18 GB M3 Pro: a 9 GiB buffer, 12 GiB working set) runs the 24 GB demo.
    assert (rec["smallest_mac"]["mac_gb"], rec["smallest_mac"]["command"]) == (18, DEMO_24GB)
    assert rec["emulated_command"] == "mpsimpact run sentiment --device cpu --batch-size 1438 --max-length 512"


@pytest.mark.slow
def test_the_16gb_demos_flags_replayed_small_corrupt_exactly_what_eager_does(tmp_path, monkeypatch):
    # 50 s on 2 CPU cores (the float16 products run on CPU kernels that are slow in half precision); the
    # same P V call in float32 corrupts what eager does in the default selection (the retrieval test below).
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    rec = plan_memory("24GB")["recommendation"]
    # Its flags at a small geometry and a narrow width (the later --batch-size, --max-length win): traced at
    # 160 x 256 under 2**26, run at 64 tokens replaying that plan. P per text 12 * 256**2: the wrap starts at
    # batch-head 2**26 / 256**2 = 1024, text 85 (head 4); blocks of 2**26 // (12 * 256**2) = 85 texts. Nothing
    # else crosses the narrow limits: the feed-forward output 160 * 256 * 1536 < 2**26, the embeddings' output
    # 160 * 256 * 384 < 2**25.
    small = ["--batch-size", "160", "--max-length", "256", "--index-bits", "26", "--torch-profile", "2.14.0"]
    flags = rec["command"].split()[3:]
    mine = run_report(tmp_path, "blocked", *flags, *small)
    eager = run_report(tmp_path, "eager", *flags, *small, "--attention", "eager")
    (got,), (expected,) = mine["conditions"], eager["conditions"]
    assert mine["geometry"]["attentions"] == ["blocked_eager"] and mine["geometry"]["dtype"] == "float16"
    assert eager["geometry"]["attentions"] == ["eager"] and mine["geometry"]["replayed"]
    assert (got["corrupted_count"], got["first_corrupted_index"]) == (expected["corrupted_count"],
                                                                      expected["first_corrupted_index"]) == (75, 85)
    assert [c["a"] for c in got["altered_calls"]] == [c["a"] for c in expected["altered_calls"]]
    assert "blocked_eager attention: the same P V call eager attention makes" in " ".join(mine["notes"])


@pytest.mark.slow
def test_the_16gb_demo_as_typed_replayed_at_64_tokens_corrupts_what_eager_does(tmp_path, monkeypatch):
    # The command itself on the CPU: 1398 x 512 traced, run at 64 tokens replaying the plan (4 to 8 minutes).
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    flags = plan_memory("24GB")["recommendation"]["command"].split()[3:]
    mine = run_report(tmp_path, "blocked", *flags, "--torch-profile", "2.14.0")
    eager = run_report(tmp_path, "eager", *flags, "--attention", "eager", "--torch-profile", "2.14.0")
    for report in (mine, eager):  # 33 of 1398 from text 1365, the six P V calls, both
        (off,) = report["conditions"]
        assert (off["corrupted_count"], off["first_corrupted_index"], len(off["altered_calls"])) == (33, 1365, 6)


def test_on_a_mac_where_eager_does_not_fit_the_run_takes_blocked_eager_and_says_so(monkeypatch):
    import mpsimpact.runs.device as device
    import mpsimpact.runs.device_pass as device_pass
    from mpsimpact.config import RunConfig
    from mpsimpact.errors import MemoryPreflightError
    from mpsimpact.runs.runner import run_notes

    model = types.SimpleNamespace(config=MINILM, max_positions=512)
    for module in (device, device_pass):
        monkeypatch.setattr(module, "device_memory", lambda device: int(10.7 * GIB))  # a 16 GB Mac
    geometry = device_pass.decide_geometry(RunConfig(device="mps", dtype="float16"), model, "mps", 1438, 512,
                                           training=False)
    assert geometry.attentions == ("blocked_eager",) and (geometry.run_length, geometry.emulated) == (512, False)
    note = run_notes(geometry, 0, {})[1]
    assert note == ("Eager attention would need about 19.7 GiB and mps offers 10.7 GiB, so blocked_eager attention "
                    "runs instead (the same P V call eager attention makes; scores computed in blocks to fit a "
                    "smaller Mac; about 10.1 GiB).")
    # Where neither fits (float32: 20.1 GiB blocked), the preflight names the plan command, as before.
    with pytest.raises(MemoryPreflightError, match="plan sentiment --memory auto"):
        device_pass.decide_geometry(RunConfig(device="mps"), model, "mps", 1438, 512, training=False)
    # Asked for another attention, emulated, or where eager fits: what was asked.
    for config, device in ((RunConfig(device="mps", dtype="float16", attention="both"), "mps"),
                           (RunConfig(device="cpu", dtype="float16"), "cpu")):
        monkeypatch.setattr(device_pass, "check_memory", lambda *args: None)
        monkeypatch.setattr(device_pass, "_run_length", lambda config, device, emulated, full, length: length)
        assert device_pass.decide_geometry(config, model, device, 1438, 512, training=False).attentions == \
            config.attentions


def test_blocked_eager_is_refused_where_a_run_kind_does_not_take_it(tmp_path):
    result = runner.invoke(app, ["run", "finetune", "--attention", "blocked_eager", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert one_message(result.stderr) == (
        "error: run finetune supports --attention eager and --dtype float32 only; `mpsimpact plan finetune "
        "--versions` predicts sdpa.")
    assert not list(tmp_path.iterdir())


@pytest.mark.ci  # a whole run, 7 to 12 s: CI runs it after the default selection (pytest -m ci)
def test_retrieval_with_blocked_eager_corrupts_the_vectors_eager_corrupts(tmp_path, monkeypatch):
    # tests/test_retrieval.py's small run (16 x 256 under 2**23, run at 64 tokens), whose eager figures the
    # README gives: vectors 10..15 corrupted, 3 documents lose themselves, recall@10 0.8449, 135 top-1 changed.
    # blocked_eager's P V is the same call: the same figures.
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    result = runner.invoke(app, ["run", "retrieval", "--batch-size", "16", "--max-length", "256", "--index-bits",
                                 "23", "--torch-profile", "2.14.0", "--guard", "off", "--attention", NAME,
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    (off,) = json.loads((out / "report.json").read_text())["conditions"]
    assert (off["attention"], off["corrupted_count"], off["first_corrupted_index"]) == (NAME, 6, 10)
    assert (off["self_retrieval_failures"], round(off["recall_at_10"], 4), off["top1_changed"]) == (3, 0.8449, 135)


def test_plan_memory_offers_only_what_the_scenarios_run_takes():
    def memory(scenario, size):
        result = runner.invoke(app, ["plan", scenario, "--memory", size, "--json", "--torch-profile", "2.14.0"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["memory"]

    finetune = memory("finetune", "64GB")  # run finetune takes eager in float32 only
    assert {(o["attention"], o["dtype"]) for o in finetune["options"]} == {("eager", "float32")}
    assert "blocked_eager" not in finetune["mac_table"][0]
    retrieval = memory("retrieval", "48GB")  # run retrieval: float32, eager or blocked_eager
    assert {o["dtype"] for o in retrieval["options"]} == {"float32"}
    assert retrieval["recommendation"]["command"] == ("mpsimpact run retrieval --batch-size 1398 --max-length 512 "
                                                      "--attention blocked_eager")
    # On 32 GB its float32 P (16.4 GiB) reaches the 16 GiB buffer: a 36 GB Mac (18 GiB) is the smallest that can.
    assert memory("retrieval", "32GB")["recommendation"]["smallest_mac"]["mac_gb"] == 36
