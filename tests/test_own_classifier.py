"""The named model's demo (issue 62): a RoBERTa-base-shaped sequence classifier (hidden 768, feed-forward 3072, 12
heads, 514 positions, 3 labels; random weights, the embedded model's tokenizer), saved with save_pretrained and
loaded as any user's (`run --model`: AutoModelForSequenceClassification.from_pretrained, eager, float32).

Its shapes put the feed-forward's output (B*L, 3072) beside eager attention's P (B*12, L, L): per text they are
equal at 256 tokens (12 x 256 = 3072), so no batch of 256-token texts is silent (the addmm aborts where P V would
wrap), while at 512 tokens P crosses the limit at half the batch the addmm does. --quick must find that itself,
`run` and `plan` must say where the silent effect shows when the asked batch stops, and every command they
recommend must carry --model."""

import json
import re
import shlex

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app

runner = CliRunner()
PROFILE = ["--torch-profile", "2.14.0"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def roberta_base_shaped(folder, layers, weights=True):
    """A RoBERTa-base-shaped classifier with `layers` layers, saved with save_pretrained: its config, and with
    `weights` random weights and the embedded model's tokenizer (what `run` loads); without, the config alone (what
    `plan` and `check` read)."""
    from transformers import AutoTokenizer, RobertaConfig, RobertaForSequenceClassification

    from mpsimpact.models.classifier import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    config = RobertaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
        num_hidden_layers=layers, max_position_embeddings=514, pad_token_id=tokenizer.pad_token_id, num_labels=3,
        id2label=LABELS, label2id={name: i for i, name in LABELS.items()})
    if not weights:
        config.save_pretrained(folder)
        return folder
    RobertaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    # The config alone, with two of roberta-base's twelve layers: every rule decides on one layer's shapes (each
    # layer repeats layer 0's calls, and layer 0 is where the addmm aborts and P V first wraps), and plan's traces
    # of two cost a sixth of twelve's. A space in the folder's name: the commands quote it.
    return roberta_base_shaped(tmp_path_factory.mktemp("models") / "roberta base shaped", layers=2, weights=False)


@pytest.fixture(scope="module")
def roberta_base(tmp_path_factory):
    # The whole shape with random weights: 500 MB written, then loaded by each run as a user's folder (`ci` tests).
    return roberta_base_shaped(tmp_path_factory.mktemp("models") / "roberta-base shaped", layers=12)


def invoke(args, columns="80"):
    """The result, and what it printed (stdout, then stderr) with every run of whitespace one space."""
    result = runner.invoke(app, args, env={"COLUMNS": columns})
    return result, " ".join((result.stdout + (result.stderr if result.stderr_bytes else "")).split())


def report_of(folder):
    return json.loads((folder / "report.json").read_text())


@pytest.mark.ci  # 500 MB written and read, 13 CPU-s for the run
def test_quick_chooses_a_silent_geometry_for_a_roberta_base_shaped_model(roberta_base, tmp_path):
    out = tmp_path / "run"
    result, text = invoke(["run", "sentiment", "--model", str(roberta_base), "--quick", *PROFILE, "--out", str(out)])
    assert result.exit_code == 0, text
    report = report_of(out)
    off = next(c for c in report["conditions"] if c["guard"] == "off")
    # 16 x 256 at 23 bits: the addmm (4096, 3072) and P (192, 256, 256) both hold 12,582,912 >= 2**23 elements:
    # the addmm aborts first. 16 x 512 at 25 bits: P (192, 512, 512) = 50,331,648 > 2**25 wraps from batch-head
    # ceil(2**25 / 512**2) = 128, text 10 (head 8); the addmm (8192, 3072) = 25,165,824 < 2**25.
    assert text.startswith("EMULATED MPS. Silent: 6 of 16 outputs came back wrong"), text
    assert report["geometry"]["emulated"] and (report["config"]["batch_size"], report["config"]["max_length"],
                                               report["config"]["index_bits"]) == (16, 512, 25)
    assert "batch 16, max length 512" in text and "25-bit index" in text
    assert ("--quick chose 16 texts of 512 tokens at a 25-bit index for this model, where the damage is silent on "
            "torch 2.14.0: at its usual 16 texts of 256 tokens at a 23-bit index, torch 2.14.0 kills the process at "
            "addmm in model.roberta.encoder.layer.0.intermediate.dense.") in text
    assert (off["status"], off["first_corrupted_index"], off["corrupted_count"]) == ("completed", 10, 6)
    assert off["predicted_first_corrupted_index"] == 10 and report["model"] == str(roberta_base)
    assert report["config"]["quick_sizes"] == ["batch_size", "max_length", "index_bits"]


@pytest.mark.ci  # a whole run of 32 texts through the twelve layers
def test_a_pinned_batch_that_aborts_names_the_batches_that_would_be_silent(roberta_base, tmp_path):
    # 32 x 512 at 25 bits stands for 4096 x 512 at MPS's 32 (2**7 times fewer texts): the addmm's output (16384,
    # 3072) = 50,331,648 >= 2**25 aborts; P V is silent from 2**25 / (12 * 512**2) = 10.7 -> 11 texts to
    # ceil(2**25 / (512 * 3072)) - 1 = 21, wrong from text 10.
    args = ["--batch-size", "32", "--max-length", "512", "--index-bits", "25"]
    result, text = invoke(["run", "sentiment", "--model", str(roberta_base), *args, "--guard", "off", *PROFILE,
                           "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, text
    assert text.startswith("EMULATED MPS. Not silent: the process would die at addmm"), text
    sizes = report_of(tmp_path / "run")["silent_sizes"]
    assert (sizes["max_length"], sizes["batches"], sizes["first_corrupted_text"]) == (512, [[11, 21]], 10)
    assert ("the silent effect shows instead from 11 to 21 texts of 512 tokens at the 25-bit index on torch 2.14.0 "
            "for this model: wrong from text 10, and nothing stops (e.g. --batch-size 15 --max-length 512).") in text


def plan_json(model, *args):
    result = runner.invoke(app, ["plan", "sentiment", "--model", str(model), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_plan_at_the_cards_4096_names_the_abort_and_the_silent_batches(two_layers):
    report = plan_json(two_layers, "--batch-size", "4096", "--max-length", "512", *PROFILE)
    stop = report["prediction"]["stops"][0]
    # (4096 * 512, 3072) = 6,442,450,944 >= 2**32: layer 0's feed-forward aborts, before any text comes back.
    assert stop["kind"] == "abort" and stop["module"].endswith("layer.0.intermediate.dense")
    assert stop["out_numel"] == 4096 * 512 * 3072 and report["prediction"]["first_wrong_sample"] is None
    # P passes 2**32 from 1366 texts (12 * 512**2 * 1366 > 2**32); the addmm reaches it at ceil(2**32 / (512 *
    # 3072)) = 2731; between them the outputs are wrong from text 1365 and nothing stops; 2048 is the published one.
    sizes = report["silent_sizes"]
    assert (sizes["batches"], sizes["first_corrupted_text"], sizes["example_batch"]) == ([[1366, 2730]], 1365, 2048)
    console = invoke(["plan", "sentiment", "--model", str(two_layers), "--batch-size", "4096", "--max-length", "512",
                      *PROFILE])[1]
    assert "MPS aborts the process at call" in console and sizes["sentence"] in console


@pytest.mark.parametrize(("release", "outcome", "where"), [
    ("2.4.1", "wrong", None), ("2.7.1", "wrong", None),  # the addmm's output past 2**32: never measured before 2.8.0
    ("2.8.0", "abort", "intermediate.dense"), ("2.12.1", "abort", "intermediate.dense"),
    ("2.13.0", "abort", "attention.self"),  # the scale on the scores aborts first (inferred: the SIGSEGV)
    ("2.14.0", "abort", "intermediate.dense"),
])
def test_what_the_cards_4096_does_on_each_release_group(two_layers, release, outcome, where):
    # The README's "your own classifier" table, from the release rules (engine.release).
    pred = plan_json(two_layers, "--batch-size", "4096", "--max-length", "512", "--torch-profile", release)["prediction"]
    assert pred["outcome"] == outcome
    if where is None:
        assert (pred["first_wrong_sample"], pred["wrong_samples"]) == (1365, 2731)
    else:
        assert pred["stops"][0]["module"].endswith(f"layer.0.{where}")


def run_commands(text):
    """Every `mpsimpact run ...` command in a text, a command broken over lines (" \\") joined, as argv lists."""
    joined = re.sub(r" \\\n\s*", " ", text)
    return [shlex.split(match) for match in re.findall(r"mpsimpact run [^`\n]*", joined)]


def test_the_command_scan_sees_a_command_without_its_model():
    found = run_commands("Run:\nmpsimpact run sentiment --model 'a b' \\\n  --batch-size 8\nthen `mpsimpact run x --quick`")
    assert found == [["mpsimpact", "run", "sentiment", "--model", "a b", "--batch-size", "8"],
                     ["mpsimpact", "run", "x", "--quick"]]


def json_strings(data):
    if isinstance(data, dict):
        return [s for value in data.values() for s in json_strings(value)]
    if isinstance(data, list):
        return [s for value in data for s in json_strings(value)]
    return [data] if isinstance(data, str) else []


@pytest.mark.parametrize("memory", ["16GB", "64GB"])  # no Mac that fits (three commands), and one that does
def test_every_run_command_plan_prints_carries_the_model(two_layers, memory):
    args = ["plan", "sentiment", "--model", str(two_layers), "--memory", memory, *PROFILE]
    text = invoke(args, columns="80")[0].output
    report = plan_json(two_layers, "--memory", memory, *PROFILE)
    commands = run_commands(text) + [shlex.split(s) for s in json_strings(report) if s.startswith("mpsimpact run")]
    assert len(commands) >= (6 if memory == "16GB" else 2)  # each command in the console and in the JSON
    for argv in commands:
        assert argv[3:5] == ["--model", str(two_layers)], argv  # the folder, spaces and all, as the shell reads it


def test_check_prints_no_run_command_that_could_drop_the_model(two_layers):
    # check recommends guards, not runs (none today): any `mpsimpact run` it comes to print must name the model.
    result = runner.invoke(app, ["check", str(two_layers), "--batch-size", "4096", "--seq-len", "512", *PROFILE])
    assert result.exit_code == 0, result.output
    as_json = runner.invoke(app, ["check", str(two_layers), "--batch-size", "4096", "--seq-len", "512", *PROFILE,
                                  "--json"])
    commands = run_commands(result.output) + [shlex.split(s) for s in json_strings(json.loads(as_json.output))
                                              if s.startswith("mpsimpact run")]
    assert all(argv[3:5] == ["--model", str(two_layers)] for argv in commands), commands


def test_a_refused_run_names_the_plan_of_its_model(two_layers):
    # finetune takes no blocked_eager: the refusal points at `plan ... --versions` for the model asked, before loading.
    result, text = invoke(["run", "finetune", "--model", str(two_layers), "--attention", "blocked_eager"])
    assert result.exit_code == 2
    assert f"`{shlex.join(['mpsimpact', 'plan', 'finetune', '--model', str(two_layers), '--versions'])}`" in text


def test_silent_batches_are_every_batch_whose_forward_is_silently_wrong():
    from tiny import tiny_bert

    from mpsimpact.prediction.outcome import predict
    from mpsimpact.prediction.safe_size import per_text_calls, plan_at, silent_batches

    calls = per_text_calls(tiny_bert("meta"), 64)
    # 4 heads at 64 tokens: P is 4 * 64**2 = 16,384 elements a text, the feed-forward's output (64, 32) 2,048. At
    # 16 bits P V wraps from 65,536 / 16,384 = 4 -> 5 texts; the addmm reaches 2**16 at 32 texts and aborts.
    # On 2.13.0 the scale on the scores aborts wherever P V would wrap: nothing is silent.
    for release, expected in (("2.14.0", [(5, 31)]), ("2.13.0", [])):
        brute = [b for b in range(1, 81) if predict(plan_at(calls, b, 16, release), b, 4).outcome == "wrong"]
        assert silent_batches(calls, 4, 16, release, ceiling=80) == expected
        assert brute == [b for first, last in expected for b in range(first, last + 1)]  # every batch, one by one


def meta_of(config_path):
    """The classifier of a config on meta, with 2 of its layers: each layer repeats layer 0's calls, where every rule
    first decides (the traces of twelve cost six times as much and decide the same)."""
    from transformers import AutoConfig

    from mpsimpact.models.classifier import meta_classifier

    return meta_classifier(AutoConfig.from_pretrained(config_path, num_hidden_layers=2), embedded=False)


def test_quick_geometry_is_the_arithmetic_and_a_direct_trace_agrees():
    from pathlib import Path

    from mpsimpact.engine.release import profile_for
    from mpsimpact.prediction.demo_size import quick_geometry
    from mpsimpact.prediction.meta_model import trace_meta
    from mpsimpact.prediction.outcome import predict
    from mpsimpact.prediction.safe_size import PerTextTraces

    profile = profile_for("2.14.0")
    roberta = Path(__file__).parent / "data" / "twitter-roberta-base-sentiment-latest"
    meta = meta_of(roberta)
    traces = PerTextTraces(meta, profile=profile)
    every = {"batch_size", "max_length", "index_bits"}
    chosen, at_asked = quick_geometry(traces, (16, 256, 23), every, 512, 12, profile)
    assert chosen == (16, 512, 25) and at_asked.outcome == "abort"
    for (batch, length, bits), outcome in (((16, 512, 25), "wrong"), ((16, 256, 23), "abort")):
        direct = predict(trace_meta(meta, batch, length, index_bits=bits, profile=profile), batch, 12)
        assert direct.outcome == outcome
    # 8 texts pinned: P (96, 512, 512) = 25,165,824 passes 2**24 (wrong from batch-head 64: text 5) while the addmm
    # (4096, 3072) = 12,582,912 stays under it; at 23 bits the addmm aborts.
    assert quick_geometry(traces, (8, 256, 23), every - {"batch_size"}, 512, 12, profile)[0] == (8, 512, 24)
    # 256 tokens pinned: the addmm and P cross together at any width and batch; 32 bits pinned: P passes 2**32 in
    # 32 texts only past 3,344 tokens, beyond the model's 512.
    assert quick_geometry(traces, (16, 256, 23), every - {"max_length"}, 512, 12, profile)[0] is None
    assert quick_geometry(traces, (16, 256, 32), every - {"index_bits"}, 512, 12, profile)[0] is None


def test_quick_geometry_on_other_shapes():
    from pathlib import Path

    from tiny import tiny_bert

    from mpsimpact.engine.release import profile_for
    from mpsimpact.prediction.demo_size import quick_geometry
    from mpsimpact.prediction.safe_size import PerTextTraces

    profile, every = profile_for("2.14.0"), {"batch_size", "max_length", "index_bits"}
    # BERT-base: the same feed-forward against P as RoBERTa-base.
    bert = PerTextTraces(meta_of(Path(__file__).parent / "data" / "bert-base" / "config.json"), profile=profile)
    assert quick_geometry(bert, (16, 256, 23), every, 512, 12, profile)[0] == (16, 512, 25)
    # A tiny BERT (4 heads, feed-forward 32, 64 positions): 16 x 64 holds P = 2**18, the addmm 2**15. At 17 bits
    # P V wraps from batch-head 32, text 8 (8 of 16 wrong); at 16, from text 4 (12 of 16): 17 is nearer a third.
    # At 32 tokens P = 2**16 and 15 bits give 8 of 16 too: the longer length is taken.
    tiny = PerTextTraces(tiny_bert("meta"), profile=profile)
    chosen, at_asked = quick_geometry(tiny, (16, 64, 23), every, 64, 4, profile)
    assert (chosen, at_asked.outcome) == ((16, 64, 17), "clean")
    # The embedded model's own quick geometry is silent: kept as it is.
    embedded = PerTextTraces(meta_classifier_of_the_embedded(), profile=profile)
    assert quick_geometry(embedded, (16, 256, 23), every, 512, 12, profile)[0] == (16, 256, 23)


def meta_classifier_of_the_embedded():
    from mpsimpact.runs.scenario import get_scenario

    scenario = get_scenario("sentiment")()
    return scenario.meta_module(scenario.load_config())


@pytest.mark.parametrize("release", ["2.13.0", "2.15.0"])
def test_quick_on_a_release_with_no_silent_geometry_takes_the_published_releases(two_layers, release):
    # 2.13.0 aborts at the scale on the scores wherever P V would wrap, and nobody measured 2.15.0: --quick takes the
    # geometry that is silent on 2.14.0, so that quick runs of one model on two releases compare (same sizes).
    from mpsimpact.config import RunConfig
    from mpsimpact.engine.release import resolve_profile
    from mpsimpact.runs.runner import ModelShapes, quick_config
    from mpsimpact.runs.scenario import get_scenario

    quick = dict(batch_size=16, max_length=256, index_bits=23, quick_sizes=("batch_size", "max_length", "index_bits"))
    # The embedded model's usual geometry is silent on 2.14.0: kept (on 2.13.0 tests/test_console_width.py's run).
    for model, kept in ((str(two_layers), False), *(((None, True),) if release == "2.15.0" else ())):
        config = RunConfig(model=model, **quick)
        shapes = ModelShapes(get_scenario("sentiment")(model=model), "eager", config, False, None)
        chosen, words = quick_config(config, shapes, resolve_profile(release))
        sizes = (chosen.batch_size, chosen.max_length, chosen.index_bits)
        assert sizes == ((16, 256, 23) if kept else (16, 512, 25)) and bool(words) != kept
        unknown = "none is on torch 2.13.0" if release == "2.13.0" else "nobody measured torch 2.15.0 on MPS"
        assert kept or f"where the damage is silent on torch 2.14.0, a release measured on Macs where the bug is " \
                       f"silent ({unknown})" in words


def test_quick_on_a_model_of_fewer_positions_runs_at_its_longest_power_of_two(tmp_path):
    # 100 positions: --quick's 256 tokens would be refused; it takes 64 (a power of two, replayed exactly), where
    # this tiny RoBERTa (4 heads, feed-forward 32) is silent; a length given past them is left for the run to refuse
    # as it refuses any (tests/test_plan.py, test_plan_and_run_agree_on_the_usable_length).
    from transformers import RobertaConfig

    from mpsimpact.config import RunConfig
    from mpsimpact.engine.release import resolve_profile
    from mpsimpact.runs.runner import ModelShapes, quick_config
    from mpsimpact.runs.scenario import get_scenario

    RobertaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_hidden_layers=2,
                  max_position_embeddings=102, num_labels=3).save_pretrained(tmp_path)  # 102 - (1 + 1) = 100 usable
    scenario = get_scenario("sentiment")(model=str(tmp_path))
    for given, length in ((None, 64), (256, 256)):
        config = RunConfig(model=str(tmp_path), batch_size=16, max_length=given or 256, index_bits=23,
                           quick_sizes=("batch_size", "index_bits") + (() if given else ("max_length",)))
        chosen = quick_config(config, ModelShapes(scenario, "eager", config, False, None), resolve_profile("2.14.0"))[0]
        assert chosen.max_length == length
