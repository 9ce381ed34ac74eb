"""`mpsimpact check`: any architecture from its config alone, against arithmetic done by hand, direct
traces, the plan command, mpsimpact.attention and transformers itself."""

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.config import CheckConfig
from mpsimpact.prediction.check import build_check_report, prepare
from mpsimpact.prediction.outcome import summarise
from mpsimpact.prediction.safe_size import _fit, _value, is_clean, longest_safe_length
from mpsimpact.modes.tracer import trace_module
from tiny import tiny_bert
from said import one_message

runner = CliRunner()
DATA = Path(__file__).parent / "data"
LLAMA = DATA / "llama-style-32k"  # 32 heads of dim 128, 32 layers, 32768 positions
BERT = DATA / "bert-base"  # 12 heads, 12 layers, 512 positions
T5 = DATA / "t5-base"
# The arithmetic below is the matrix-product rules'; 2.14.0 keeps them alone. On 2.13.0 (the installed
# torch) the scale and softmax on scores past 2**32 abort first (inferred; see the 2.13.0 test below).
PROFILE = "2.14.0"


def check_json(*args):
    args = args if "--torch-profile" in args else (*args, "--torch-profile", PROFILE)
    result = runner.invoke(app, ["check", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def bad_input(*args):
    """Runs a check that must fail: exit 2, one line on stderr, no traceback."""
    result = runner.invoke(app, ["check", *map(str, args)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.stderr
    return one_message(result.stderr)


def pick(row, *keys):
    return tuple(tuple(row[k]) if isinstance(row[k], list) else row[k] for k in keys)


@pytest.fixture(scope="module")
def llama_16k():
    # use_cache=False (scoring, training): K^T reaches bmm as a strided view (the inferred rule)
    return build_check_report(CheckConfig(str(LLAMA), seq_len=16384, attention="eager", torch_profile=PROFILE,
                                          cache=False))


def test_llama_at_16k_flags_the_attention_products_of_every_layer(llama_16k):
    rows = llama_16k["faulting_calls"]
    assert len(rows) == 64 and {r["module"] for r in rows} == {f"model.layers.{i}.self_attn" for i in range(32)}
    scores, outputs = rows[0::2], rows[1::2]
    # Q K^T at one sample: the 4-D matmul hands bmm strided views (unmeasured layout); its output,
    # 32 * 16384**2 = 2**33 elements, is above 2**32, where a transposed view would be read as packed.
    keys = ("op", "a", "a_layout", "b_layout", "kind", "rule", "inferred", "out_numel")
    assert {pick(r, *keys) for r in scores} == {
        ("bmm", (32, 16384, 128), "strided", "strided", "wrong_other", "unmeasured-layout", True, 2**33)}
    # P V: P, contiguous with 2**33 elements, wraps from row ceil(2**32 / 16384**2) = 16 = (sample 0, head 16).
    keys = ("a", "a_layout", "kind", "rule", "first_bad_batch", "first_bad_sample", "first_bad_head")
    assert {pick(r, *keys) for r in outputs} == {((32, 16384, 16384), "contiguous", "wrong_tail", "input-wrap", 16, 0, 16)}
    prediction = llama_16k["prediction"]
    assert pick(prediction, "first_wrong_sample", "first_wrong_head", "wrong_fraction") == (0, 16, 1.0)
    assert prediction["uncharacterised_calls"] == 32 and prediction["stops"] == []
    assert llama_16k["largest_safe_batch"] == 0  # one sample is already too long
    assert llama_16k["model"]["attention"] == "eager" and llama_16k["model"]["task"] == "causal-lm"


def test_llama_at_8k_is_clean_and_its_safe_batch_is_the_arithmetic():
    report = check_json(LLAMA, "--seq-len", 8192, "--attention", "eager")
    assert report["faulting_calls"] == [] and report["prediction"]["outcome"] == "clean"
    # P per sample 32 * 8192**2 = 2**31: two samples make exactly 2**32 (not above), three wrap.
    assert report["largest_safe_batch"] == 2**32 // (32 * 8192**2) == 2
    assert report["longest_safe_length"] == 11585


def test_longest_safe_length_at_batch_1_is_the_hand_arithmetic(llama_16k):
    # Q K^T output 32 L^2 passes 2**32 first: 32 * 11585**2 = 4,294,836,800 <= 2**32 < 32 * 11586**2.
    assert 32 * 11585**2 <= 2**32 < 32 * 11586**2
    # P V wraps only once its first wrapped row, ceil(2**32 / L^2), is inside the 32 rows: later.
    assert next(n for n in range(11000, 13000) if -(-2**32 // n**2) < 32) == 11771
    search = llama_16k["longest_safe_length_search"]
    assert llama_16k["longest_safe_length"] == 11585 and "checked by tracing at 11585 and 11586" in search["basis"]
    # Independently: direct traces on each side of the boundary.
    model, _ = prepare(CheckConfig(str(LLAMA), attention="eager", torch_profile=PROFILE, cache=False))
    assert is_clean(model.trace(1, 11585))
    first_bad = model.trace(1, 11586).faults
    assert len(first_bad) == 32 and {c.fault.rule for c in first_bad} == {"unmeasured-layout"}
    # Wrong in a pattern nobody characterised: with one sample, that sample is wrong; its head is not known.
    summary = summarise(model.trace(1, 11586), 1, 32)
    keys = ("outcome", "first_wrong_sample", "first_wrong_head", "wrong_fraction")
    assert pick(summary, *keys) == ("wrong_other", 0, None, 1.0)


def test_the_default_forward_passes_k_through_the_cache():
    # model(ids) and generate() run with use_cache=True: K goes through the cache and comes back contiguous,
    # so K^T reaches bmm as a transposed view of it, the measured layout. Q K^T: 3 * 32 * 8192**2 =
    # 6,442,450,944 > 2**32 outputs: every batch-head wrong (strides ignored), from (0, 0); the longest
    # safe length at 3 samples is floor(sqrt(2**32 / 96)) = 6688.
    cached = check_json(LLAMA, "--seq-len", 8192, "--batch-size", 3, "--attention", "eager")
    scores = cached["faulting_calls"][0]
    assert pick(scores, "op", "b_layout", "kind", "rule", "inferred") == (
        "bmm", "transposed", "wrong_all", "output-transposed", False)
    assert pick(cached["prediction"], "first_wrong_sample", "first_wrong_head", "wrong_samples") == (0, 0, 3)
    assert cached["longest_safe_length"] == math.isqrt(2**32 // 96) == 6688
    assert cached["model"]["inputs"].endswith("use_cache=True") and cached["config"]["cache"] is True
    # --no-cache (scoring, training): K^T a strided view (unmeasured layout), wrong in P V from sample 2.
    uncached = check_json(LLAMA, "--seq-len", 8192, "--batch-size", 3, "--attention", "eager", "--no-cache")
    assert {r["rule"] for r in uncached["faulting_calls"]} == {"input-wrap"}
    assert pick(uncached["prediction"], "first_wrong_sample", "wrong_samples") == (2, 1)
    assert uncached["longest_safe_length"] == 6723 and uncached["config"]["cache"] is False


def test_causal_lms_name_the_lm_head_difference_between_generation_and_full_logits(tmp_path):
    fields = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                  intermediate_size=32, vocab_size=1100, max_position_embeddings=64)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    # At 16 bits the full logits (64, 1100) = 70,400 >= 2**16: the lm_head's mm output aborts (the embedding
    # table, 1100 * 16 = 17,600, stays below 2**15). generate() keeps one logit row per sample: (1, 1100).
    report = check_json(tmp_path, "--seq-len", 64, "--index-bits", 16)
    rows = report["faulting_calls"]
    assert [pick(r, "module", "kind", "rule") for r in rows] == [("lm_head", "abort", "mm-encode")]
    assert "logits_to_keep=1" in report["generation"]
    assert ("happens in full-logit forwards, not in generation: generate() at this geometry makes no "
            "faulting call") in report["generation"]
    assert check_json(BERT, "--batch-size", 2, "--seq-len", 64)["generation"] == ""  # not a causal LM


def test_on_2_13_0_eager_attention_past_2_to_the_32_scores_crashes_at_the_scale():
    # 2048 * 12 * 512 * 512 = 6,442,450,944 scores: the study saw eager attention die (SIGSEGV) on 2.13.0;
    # the rules put it at the first op on the scores, inferred.
    report = check_json(BERT, "--batch-size", 2048, "--seq-len", 512, "--attention", "eager",
                        "--torch-profile", "2.13.0")
    stop = report["prediction"]["stops"][0]
    assert pick(stop, "op", "kind", "rule", "inferred") == ("mul", "abort", "int32-kernel", True)
    assert report["prediction"]["outcome"] == "abort" and "SIGSEGV" in stop["message"]
    assert "strict=True" in report["guard_advice"][0]  # the scale and softmax: left to strict mode


def test_bert_base_largest_safe_batch_equals_the_plan_command():
    report = check_json(BERT, "--batch-size", 2048, "--seq-len", 512, "--attention", "eager")
    plan = runner.invoke(app, ["plan", "sentiment", "--batch-size", "4096", "--max-length", "512", "--json",
                               "--torch-profile", PROFILE])
    assert plan.exit_code == 0, plan.output
    # floor(2**32 / (12 * 512**2)) = 1365, for both 12-head models.
    assert report["largest_safe_batch"] == json.loads(plan.stdout)["largest_safe_batch"] == 2**32 // (12 * 512**2)
    assert report["largest_safe_batch"] == 1365
    # divmod(2**32 // 512**2, 12) = (1365, 4): 2048 - 1365 = 683 samples wrong.
    prediction = report["prediction"]
    assert pick(prediction, "first_wrong_sample", "first_wrong_head", "wrong_samples") == (1365, 4, 683)
    assert prediction["wrong_fraction"] == 683 / 2048
    assert "the scaling agrees with the trace at batch 2048" in report["largest_safe_batch_search"]["basis"]


def test_bert_base_at_4096_predicts_the_feed_forward_abort():
    report = check_json(BERT, "--batch-size", 4096, "--seq-len", 512, "--attention", "eager")
    # 4096 * 512 * 3072 = 6,442,450,944 >= 2**32: the intermediate addmm aborts the process.
    stop = report["prediction"]["stops"][0]
    assert stop["kind"] == "abort" and stop["module"].endswith("intermediate.dense")
    assert stop["out_numel"] == 4096 * 512 * 3072
    assert report["prediction"]["outcome"] == "abort" and report["prediction"]["first_wrong_sample"] is None
    assert report["largest_safe_batch"] == 1365


def test_mps_safe_eager_advice_uses_the_chunk_the_attention_module_would(monkeypatch):
    from mpsimpact.attention import safe_rows

    # Both within the same memory budget (issue 36): 2**30 // 16 bytes a float32 score = 67,108,864 scores,
    # // (12 * 512 * 512) = 21 samples a piece (the index limits alone would allow 682).
    monkeypatch.setenv("MPSIMPACT_ATTENTION_BUDGET", "1G")
    report = check_json(BERT, "--batch-size", 2048, "--seq-len", 512, "--attention", "eager")
    q = torch.empty(2048, 12, 512, 64, device="meta")
    chunk = safe_rows(q, q, q) // 12
    assert chunk == 21 and f"in chunks of {chunk} samples" in report["guard_advice"][2]
    # 21 * 12 * 512**2 scores * 16 B = 1,056,964,608 B = 0.98 GiB, stated to one decimal as check does
    assert "take about 1.0 GiB on top of the model" in report["guard_advice"][2]
    assert report["guard_advice"][0].startswith("guard 'chunk'")
    assert "makes all 12 faulting calls safe" in report["guard_advice"][0]


def test_t5_traces_encoder_and_decoder():
    model, info = prepare(CheckConfig(str(T5), target_len=32))
    plan = model.trace(2, 128)
    modules = [c.module for c in plan.calls]
    assert info["encoder_decoder"] and info["task"] == "seq2seq" and info["class"] == "T5ForConditionalGeneration"
    assert any(m.startswith("encoder.") for m in modules) and any(m.startswith("decoder.") for m in modules)
    cross = [c for c in plan.trace if "EncDecAttention" in c.module and c.family == "bmm"]
    assert cross and cross[0].a.shape == (2 * 12, 32, 64) and cross[0].b.shape[-1] == 128  # (B*H, T, d) @ (B*H, d, L)
    # 2048 * 512 * 32128 >= 2**32: the LM head's mm over the decoder's 512 positions aborts.
    report = check_json(T5, "--batch-size", 2048, "--seq-len", 512)
    assert report["geometry"]["target_len"] == 512 and report["prediction"]["stops"][0]["module"] == "lm_head"
    assert report["largest_safe_batch"] == (2**32 - 1) // (512 * 32128) == 261
    assert "does not support transformers' attention interface" in report["guard_advice"][2]


def test_fused_sdpa_is_wrong_up_to_2_12_1_and_clean_on_2_13_0():
    old, new = (check_json(BERT, "--batch-size", 2048, "--attention", "sdpa", "--torch-profile", p)
                for p in ("2.12.1", "2.13.0"))
    # 2048 * 12 * 512 * 512 = 6,442,450,944 score elements > 2**32.
    assert [pick(r, "op", "kind", "rule") for r in old["faulting_calls"]] == [("sdpa", "wrong_other", "sdpa-fused")] * 12
    assert old["torch_profile"]["measured"] and old["torch_profile"]["source"] == "--torch-profile"
    # On 2.13.0 the fused op is right; what is left is the FFN's GELU on 2048 * 512 * 3072 = 3,221,225,472
    # elements, between 2**31 and 2**32, where nobody measured 2.13.0's elementwise kernels: unmeasured.
    assert {pick(r, "op", "kind", "rule") for r in new["faulting_calls"]} == {
        ("gelu", "wrong_other", "unmeasured:elementwise")}
    assert new["prediction"]["outcome"] == "unmeasured" and "nobody measured" in new["prediction"]["describe"]
    # Which samples are wrong was never characterised.
    assert old["prediction"]["wrong_fraction"] is None and "any may be" in old["prediction"]["describe"]
    # 2.13.0: the GELU input passes INT_MAX from (2**31 - 1) // (512 * 3072) + 1 = 1366 samples.
    assert old["largest_safe_batch"] == 1365
    assert new["largest_safe_batch"] == (2**31 - 1) // (512 * 3072) == 1365
    on_2_14 = check_json(BERT, "--batch-size", 2048, "--attention", "sdpa", "--torch-profile", "2.14.0")
    assert on_2_14["faulting_calls"] == []
    assert on_2_14["largest_safe_batch"] == 2730  # then the FFN addmm aborts


def test_training_takes_sdpas_math_path_under_both_releases():
    model, _ = prepare(CheckConfig(str(BERT), attention="sdpa", workload="training", torch_profile="2.12.1"))
    traced = model.trace(2048, 512)
    for plan in (traced, traced.under("2.13.0")):
        products = [c for c in plan.faults if c.is_product]
        assert products and all(c.family == "bmm" for c in products), plan.profile.ref
        forward = [c for c in products if c.phase == "forward"]
        # The math path's P V wraps from row 2**32 // 512**2 = 16384 = (sample 1365, head 4).
        assert {(c.fault.kind, c.fault.rule, c.fault.first_bad_batch) for c in forward} == {
            ("wrong_tail", "input-wrap", 16384)}
    assert traced.first_stop.phase == "backward" and traced.first_stop.fault.kind == "error"
    # The bias gradients sum (2048 * 512, 3072) in backward: a reduction past INT_MAX nobody measured.
    others = {(c.op, c.fault.rule) for c in traced.faults if not c.is_product}
    assert others == {("sum", "unmeasured:reduction")}
    # On 2.13.0 the math path's softmax on the 6.4e9 scores aborts first (inferred, as eager attention did).
    stop = traced.under("2.13.0").first_stop
    assert (stop.phase, stop.op, stop.fault.rule, stop.fault.inferred) == (
        "forward", "_safe_softmax", "int32-kernel", True)


def test_default_attention_is_what_transformers_picks():
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        built = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(BERT))
    report = check_json(BERT / "config.json", "--batch-size", 2, "--seq-len", 64)
    assert report["model"]["attention"] == built.config._attn_implementation
    assert report["model"]["found_in"] == "config file" and "default" in report["model"]["attention_basis"]


def test_out_writes_json_and_markdown(tmp_path):
    out = tmp_path / "check"
    result = runner.invoke(app, ["check", str(BERT), "--batch-size", "2048", "--attention", "eager",
                                 "--out", str(out), "--torch-profile", PROFILE])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["check.json", "check.md"]
    written = json.loads((out / "check.json").read_text())
    assert written["largest_safe_batch"] == 1365 and written["config"]["out"] == str(out)
    markdown = (out / "check.md").read_text()
    # Call indices count every op the trace holds (check traces every op, so traces rescale call by call).
    assert "| 12 calls (16 .. 225) | bert.encoder.layer.*.attention.self |" in markdown
    assert "**largest safe batch**: 1365" in markdown


def test_the_length_fit_is_exact():
    fit = _fit([(64, 64 * 64), (128, 128 * 128), (16384, 16384 * 16384)])
    assert _value(fit, 11586) == 11586**2 and _value(_fit([(1, 7), (2, 7), (3, 7)]), 10**6) == 7


def test_length_search_equals_brute_force_on_a_tiny_model():
    meta = tiny_bert("meta", num_hidden_layers=1)  # 4 heads, 64 positions

    def trace_at(batch, step=1):
        def trace(n):
            ids = torch.zeros(batch, math.ceil(n / step) * step, dtype=torch.long, device="meta")
            return trace_module(meta, {"input_ids": ids}, index_bits=16, profile=PROFILE, every_op=True)
        return trace

    for batch, step in ((8, 1), (8, 16)):
        brute = next((n - 1 for n in range(1, 65) if not is_clean(trace_at(batch, step)(n))), 64)
        search = longest_safe_length(trace_at(batch, step), 64, index_bits=16, profile=PROFILE)
        assert search.largest_safe == brute, (batch, step)
        assert ("bisection" in search.basis) == (step > 1)  # lengths padded to 16 do not fit a quadratic
    # 8 samples: P V wraps once its first wrapped row ceil(2**16 / L^2) is inside the 32 rows: L >= 46;
    # padded to multiples of 16, 33 already becomes 48.
    assert longest_safe_length(trace_at(8), 64, index_bits=16, profile=PROFILE).largest_safe == 45
    assert longest_safe_length(trace_at(8, 16), 64, index_bits=16, profile=PROFILE).largest_safe == 32


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0."),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0."),
    (["--target-len", "0"], "--target-len must be >= 1, got 0."),
    (["--index-bits", "40"], "--index-bits must be in 8..32 (32 is MPS), got 40."),
    (["--torch-profile", "banana"], "--torch-profile: 'banana' is not a torch release"),
    (["--task", "vision"], "--task must be one of auto, base, sequence-classification, token-classification, "
                           "causal-lm, seq2seq; got 'vision'."),
    (["--attention", "flash"], "--attention must be one of eager, sdpa, default; got 'flash'."),
    (["--workload", "eval"], "--workload must be one of inference, training; got 'eval'."),
    (["--seq-len", "513"], "--seq-len 513 exceeds the model's 512 positions."),
])
def test_bad_options_exit_2_with_one_line(tmp_path, args, message):
    out = tmp_path / "never"
    assert message in bad_input(BERT, *args, "--out", out)
    assert not out.exists()


def test_bad_models_exit_2_with_one_line(tmp_path):
    assert bad_input("nobody/no-such-model-anywhere") == (
        "error: 'nobody/no-such-model-anywhere' is not in the Hugging Face cache (offline); download it once with "
        "`hf download nobody/no-such-model-anywhere` or pass a local folder or config.json.")
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({"model_type": "frobnicator", "hidden_size": 8}))
    assert "model_type 'frobnicator', an architecture transformers" in bad_input(unknown)
    assert ("transformers has no AutoModelForSeq2SeqLM class for model type 'llama'; this model offers: base, "
            "sequence-classification, token-classification, causal-lm") in bad_input(LLAMA, "--task", "seq2seq")
    assert "does not exist" in bad_input(tmp_path / "missing.json")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in bad_input(tmp_path / "empty")


@pytest.mark.parametrize("field, value, shown", [
    ("num_attention_heads", 0, "0"), ("hidden_size", "768", '"768"'), ("num_hidden_layers", -1, "-1"),
    ("intermediate_size", 3072.5, "3072.5"), ("vocab_size", True, "true"),
])
def test_a_config_with_an_impossible_size_is_one_line(tmp_path, field, value, shown):
    # Before: ZeroDivisionError inside transformers (0 heads), a huggingface_hub validation traceback (a
    # string), or a model with no layers reported as clean (-1).
    config = json.loads((BERT / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert bad_input(tmp_path) == (f"error: '{tmp_path / 'config.json'}': {field} must be a whole number of at "
                                   f"least 1, got {shown}; check the config.")


def test_out_must_be_fresh(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    assert "already exists and is not empty" in bad_input(BERT, "--out", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_guard_advice_agrees_with_the_guard_at_a_narrow_index(tmp_path):
    import mpsimpact
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                  intermediate_size=128, vocab_size=100, max_position_embeddings=65536)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **fields}))
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**fields), attn_implementation="eager").eval()
    # At 16 bits P (4, L, L) wraps in P V from L = 128 (4 * 128**2 = 2**16). A row of P must stay below
    # the view limit 2**15 as a slice: 160**2 = 25600 does; 200**2 does not, and the guard splits each
    # head's P V into blocks of (2**15 - 1) // 200 = 163 query rows instead.
    for length in (160, 200):
        advice = check_json(tmp_path, "--seq-len", length, "--attention", "eager", "--index-bits", 16)["guard_advice"][0]
        assert "makes all 2 faulting calls safe" in advice
        ids = torch.randint(0, 100, (1, length))
        with torch.no_grad():
            reference = model(input_ids=ids, use_cache=False).logits
            with mpsimpact.emulate(index_bits=16, profile=PROFILE), mpsimpact.guard("chunk", index_bits=16):
                guarded = model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(guarded, reference, atol=1e-5, rtol=1e-5)
    # One row of P alone past the view limit (L = 40000 > 2**15 keys): no split makes P V safe.
    advice = check_json(tmp_path, "--seq-len", 40000, "--attention", "eager", "--index-bits", 16)["guard_advice"][0]
    assert advice.startswith("guard 'chunk' cannot make call")


def test_plan_and_check_answer_with_one_pipeline_on_the_same_model_and_geometry():
    # The embedded model at 4096 x 512, eager: divmod(2**32 // 512**2, 12) = (1365, 4) in both.
    from mpsimpact.models.classifier import embedded_model_path

    plan = json.loads(runner.invoke(app, ["plan", "sentiment", "--batch-size", "4096", "--max-length", "512",
                                          "--json", "--torch-profile", PROFILE]).stdout)
    check = check_json(embedded_model_path(), "--batch-size", 4096, "--seq-len", 512, "--attention", "eager")
    words = ("first_wrong_sample", "first_wrong_head", "wrong_samples", "outcome")
    assert [plan["prediction"][w] for w in words] == [check["prediction"][w] for w in words] == [1365, 4, 2731, "wrong"]
    assert plan["prediction"].keys() == check["prediction"].keys()
    plan_rows, check_rows = plan["faulting_calls"], check["faulting_calls"]
    assert [r.keys() for r in plan_rows] == [r.keys() for r in check_rows] and len(plan_rows) == 6
    first = ("first_bad_batch", "first_bad_sample", "first_bad_head")
    assert {tuple(r[k] for k in first) for r in plan_rows + check_rows} == {(16384, 1365, 4)}
    assert plan["largest_safe_batch"] == check["largest_safe_batch"] == 1365


def test_plan_backward_and_check_training_answer_alike_for_one_training_step():
    # The logits go wrong from text 1365 (P V), then backward raises at P^T's view (2**31 elements or more);
    # a training step keeps more than a forward pass: the same estimate in both.
    from mpsimpact.models.classifier import embedded_model_path

    plan = json.loads(runner.invoke(app, ["plan", "sentiment", "--batch-size", "2048", "--max-length", "512",
                                          "--backward", "--json", "--torch-profile", PROFILE]).stdout)
    check = check_json(embedded_model_path(), "--batch-size", 2048, "--seq-len", 512, "--attention", "eager",
                       "--phase", "training")  # the option's former name
    same = ("outcome", "describe", "first_wrong_sample", "first_wrong_head", "wrong_samples")
    assert [plan["prediction"][w] for w in same] == [check["prediction"][w] for w in same]
    assert plan["prediction"]["outcome"] == "error" and plan["prediction"]["first_wrong_sample"] == 1365
    assert "then an error in backward" in plan["prediction"]["describe"]
    assert plan["largest_safe_batch"] == check["largest_safe_batch"] == 682
    inference = json.loads(runner.invoke(app, ["plan", "sentiment", "--batch-size", "2048", "--json",
                                               "--torch-profile", PROFILE]).stdout)
    assert plan["estimated_peak_gib"] == check["estimated_peak_gib"] > 2 * inference["estimated_peak_gib"]
