"""`check` answers for the architectures of the installed transformers that have a sequence-classification or
causal-LM head (a tiny config of each, from its config class's defaults), or refuses one in one line that names
the model type and the call that failed; never a traceback. DeBERTa-v2/-v3 at the sizes of the published models
give what independent arithmetic gives (the 2-D mask traces; the 4-D one, tried first before, did not)."""

import json
import math
from typing import Any

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.config import CheckConfig
from mpsimpact.errors import MpsImpactError
from mpsimpact.prediction.check import build_check_report
from said import one_message

runner = CliRunner()

# (field names, the small value): every field so named is set to it (when larger); another size field equal to
# the default of the first field so named (a pooler or embedding size equal to the hidden size) follows it.
SMALL = (
    (("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "n_embed", "hidden_dim", "model_dim"), 64),
    (("intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size",
      "moe_intermediate_size", "shared_expert_intermediate_size"), 128),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads"),
     4),
    (("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), 2),
    (("head_dim", "d_kv", "attention_head_size", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), 16),
    (("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
      "num_decoder_layers"), 2),
)
KEPT = ("vocab_size", "max_position_embeddings", "n_positions", "type_vocab_size")


def tiny_config(model_type: str) -> dict[str, Any]:
    """The config class's defaults, shrunk (see SMALL); lists as long as the layers keep their first two."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]().to_dict()
    config, by_value, layers = dict(defaults), {}, None
    for names, small in SMALL:
        given = [defaults[n] for n in names if type(defaults.get(n)) is int and defaults[n] > 0]
        config.update({n: small for n in names if type(defaults.get(n)) is int and defaults[n] > small})
        if given:
            by_value.setdefault(given[0], small)
            layers = given[0] if names[0] == "num_hidden_layers" else layers
    named = {n for names, _ in SMALL for n in names}
    for key, value in defaults.items():
        if key in named or key in KEPT or key.endswith("_id"):
            continue
        if type(value) is int and value > by_value.get(value, value) and key.endswith(("_size", "_dim")):
            config[key] = by_value[value]
        elif isinstance(value, list) and layers and len(value) == layers and key != "architectures":
            config[key] = value[:2]
    return config


def table(task: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    name = {"sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"}[task]
    return sorted(getattr(modeling_auto, name))


def answer(tmp_path, model_type: str, task: str) -> dict[str, Any] | MpsImpactError:
    """check's report of a tiny config of `model_type` (batch 2, 16 tokens), or the MpsImpactError it refused
    with; anything else is raised (the test fails with its traceback)."""
    folder = tmp_path / f"{model_type}-{task}"
    folder.mkdir()
    try:
        config = tiny_config(model_type)
    except Exception as error:  # the config class refuses its own defaults: nothing for check to read
        pytest.skip(f"{model_type}: its config class's defaults do not validate ({type(error).__name__})")
    (folder / "config.json").write_text(json.dumps(config, default=str))
    try:
        return build_check_report(CheckConfig(str(folder), task=task, batch_size=2, seq_len=16))
    except MpsImpactError as error:
        return error


def assert_answers_or_names_the_reason(result, model_type: str) -> None:
    if isinstance(result, MpsImpactError):
        assert "\n" not in result.message and model_type in result.message, result.message
    else:
        assert type(result["largest_safe_batch"]) is int and type(result["longest_safe_length"]) is int


# A representative few of each head, run in the default suite; the whole of both tables is `slow` (11 minutes on
# 2 shared cores). Each of the few must answer. Measured with transformers 5.24: 85 of 127 sequence-classification
# and 139 of 196 causal-LM types answer (one, gemma4_assistant, has config defaults that do not validate); every
# other one is refused in one line that names it and the call that failed.
FAST = {"sequence-classification": ("bert", "deberta-v2", "gpt2", "llama", "mixtral", "qwen2", "roberta"),
        "causal-lm": ("falcon", "gemma", "gpt2", "llama", "mistral", "qwen3_moe")}


@pytest.mark.parametrize(("task", "model_type"), [(t, m) for t, names in FAST.items() for m in names])
def test_check_answers_a_representative_architecture(tmp_path, task, model_type):
    result = answer(tmp_path, model_type, task)
    assert not isinstance(result, MpsImpactError), result.message


def test_a_model_that_reads_values_on_meta_is_refused_in_one_line_naming_type_and_call(tmp_path):
    # T5's classification head counts end-of-sequence tokens (unique_consecutive), which meta tensors cannot.
    result = answer(tmp_path, "t5", "sequence-classification")
    assert isinstance(result, MpsImpactError)
    assert "model type 't5'" in result.message and "modeling_t5.py:" in result.message
    assert "with any input variant (none, 2-D ones, 4-D ones)" in result.message
    cli = runner.invoke(app, ["check", str(tmp_path / "t5-sequence-classification"), "--task",
                              "sequence-classification", "--batch-size", "2", "--seq-len", "16"])
    assert cli.exit_code == 2 and one_message(cli.stderr) and "Traceback" not in cli.output


@pytest.mark.slow
@pytest.mark.parametrize("task", ["sequence-classification", "causal-lm"])
def test_every_architecture_with_the_head_answers_or_names_its_reason(tmp_path, task):
    answered, refused = [], []
    for model_type in table(task):
        try:
            result = answer(tmp_path, model_type, task)
        except pytest.skip.Exception:
            continue
        assert_answers_or_names_the_reason(result, model_type)
        (refused if isinstance(result, MpsImpactError) else answered).append(model_type)
    print(f"{task}: {len(answered)} answered, {len(refused)} refused: {', '.join(refused)}")
    assert set(FAST[task]) <= set(answered) and len(answered) >= 0.6 * len(table(task))


# DeBERTa at the published sizes (tests/data: deberta-v3-base, -v3-large, -v2-xlarge, from their configs' known
# hyperparameters), under torch 2.14.0's rules, at L = 512 tokens. Its attention (modeling_deberta_v2.py):
# - Q K^T: bmm of Q (B*H, L, 64) with K^T / scale, which keeps K^T's transposed strides; c2p and p2c: bmm of Q
#   (or K) with a transposed view of the repeated position keys (B*H, 64, 2 x 256). Outputs B*H*L*L and
#   B*H*L*512 elements; past 2**32 every batch-head is wrong (a transposed operand: wrong_all).
# - P V: P (B*H, L, L) contiguous past 2**32 wraps from batch-head ceil(2**32 / L**2) = 16384 (input-wrap).
# - gather of those products into (B*H, L, L), and the masked scores: past DIM_MAX = 2**31 - 1 elements,
#   gather is a family nobody measured there (judged conservatively), masked_fill raises past 2**32.
DIM_MAX, LIMIT, L, SPAN2 = 2**31 - 1, 2**32, 512, 512
DEBERTA = {"deberta-v3-base": 12, "deberta-v3-large": 16, "deberta-v2-xlarge": 24}  # attention heads


def deberta_expected(heads: int, batch: int) -> tuple[int, int]:
    """(largest safe batch at 512 tokens, longest safe length at `batch`) by arithmetic alone."""
    safe_batch = DIM_MAX // (heads * L * L)  # the gather's (B*H, 512, 512) within DIM_MAX
    # at length n: the c2p/p2c products (B*H, n, 512) and the gathered scores (B*H, n, n) within DIM_MAX
    safe_length = min(L, DIM_MAX // (batch * heads * SPAN2), math.isqrt(DIM_MAX // (batch * heads)))
    return safe_batch, safe_length


@pytest.mark.parametrize("name", [n if n != "deberta-v3-large" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in DEBERTA])
def test_deberta_at_published_sizes_equals_the_arithmetic(name):
    heads = DEBERTA[name]
    wrong_from = LIMIT // (heads * L * SPAN2) + 1  # c2p's output passes 2**32: 1366 for 12 heads
    report = build_check_report(CheckConfig(f"tests/data/{name}", batch_size=wrong_from, torch_profile="2.14.0"))
    assert report["model"]["model_type"] == "deberta-v2" and report["model"]["attention"] == "eager"
    assert "attention mask: 2-D ones" in report["model"]["inputs"]
    assert (report["largest_safe_batch"], report["longest_safe_length"]) == deberta_expected(heads, wrong_from)
    products = [c for c in report["faulting_calls"] if c["op"] == "bmm"]
    layers = {"deberta-v3-base": 12}.get(name, 24)
    transposed = [c for c in products if (c["kind"], c["rule"]) == ("wrong_all", "output-transposed")]
    wraps = [c for c in products if (c["kind"], c["rule"]) == ("wrong_tail", "input-wrap")]
    assert (len(transposed), len(wraps), len(products)) == (3 * layers, layers, 4 * layers)
    rows = wrong_from * heads
    assert {tuple(c["b"]) for c in transposed} == {(rows, 64, L)} and L == SPAN2  # K^T and the positions' keys
    assert {c["first_bad_batch"] for c in wraps} == {LIMIT // (L * L)} and {c["a"][0] for c in wraps} == {rows}
    prediction = report["prediction"]  # every sample is wrong from (0, 0); then masked_fill raises (2**32)
    assert prediction["outcome"] == "error" and "masked_fill" in prediction["describe"]


def test_deberta_v3_base_below_the_product_limit_has_no_faulting_product():
    # 1365 x 12 x 512 x 512 = 4,293,918,720 <= 2**32: the products are right; only the conservative families fault.
    report = build_check_report(CheckConfig("tests/data/deberta-v3-base", batch_size=1365, torch_profile="2.14.0"))
    assert [c for c in report["faulting_calls"] if c["op"] == "bmm"] == []
    assert report["longest_safe_length"] == deberta_expected(12, 1365)[1] == 256
