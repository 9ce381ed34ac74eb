"""`mpsimpact run` end to end through the CLI, at small geometries: the embedded model with a
reduced index width (2**23: P of 16 texts at 256 tokens crosses it, the FFN does not) replayed at
64 tokens, a tiny random RoBERTa from a temp dir, and every bad input."""

import json

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from said import flat
from test_one_release import counted  # noqa: F401 (a fixture)

runner = CliRunner()
# P (16*12, 256, 256): 2**23 / 65536 = 128 batch-heads -> divmod(128, 12) = text 10, head 8.
# 2.14.0: the P V wrap alone; on 2.13.0 (the installed torch) the scale on scores past LIMIT aborts first.
PROFILE = ["--torch-profile", "2.14.0"]
SMALL = ["run", "sentiment", "--batch-size", "16", "--max-length", "256", "--index-bits", "23", *PROFILE]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))


def invoke(args):
    result = runner.invoke(app, args)
    return result, flat(result.output + (result.stderr if result.stderr_bytes else ""))


def load_report(folder):
    return json.loads((folder / "report.json").read_text())


def test_small_run_corrupts_exactly_the_predicted_texts(tmp_path):
    out = tmp_path / "run"
    result, text = invoke([*SMALL, "--out", str(out), "--expect", "corrupted"])
    assert result.exit_code == 0, text
    assert "EMULATED MPS" in text and "expectation met" in text
    report = load_report(out)
    off, stop, chunk = report["conditions"]
    assert report["geometry"]["emulated"] and report["geometry"]["replayed"]
    assert (off["guard"], off["status"], off["corrupted_count"], off["first_corrupted_index"]) == ("off", "completed", 6, 10)
    assert off["predicted_first_corrupted_index"] == report["prediction"]["first_corrupted_text"] == 10
    assert off["corrupted_contiguous_to_end"]
    assert stop["status"] == "stopped_by_guard" and "would return wrong values from sample 10 of the first dimension onward (bmm batch 128" in stop["message"]
    assert stop["wrong_values_before_stop"] == 0
    assert (chunk["status"], chunk["corrupted_count"], chunk["flips"]) == ("completed", 0, 0)
    for name in ("report.md", "report.html", "samples.jsonl", "error_by_position.png", "corrupted_classes.png", "confusion.png"):
        assert (out / name).stat().st_size > 0, name
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sum(s["corrupted"] for s in samples if s["guard"] == "off") == 6
    assert "emulated" in (out / "report.html").read_text().lower()


@pytest.mark.ci  # whole runs, 6 s: CI runs it after the default selection (pytest -m ci)
def test_below_the_boundary_is_clean_and_expect_fails_otherwise(tmp_path):
    result, text = invoke(["run", "sentiment", "--batch-size", "10", "--max-length", "256", "--index-bits", "23",
                           *PROFILE, "--out", str(tmp_path / "a"), "--expect", "clean"])
    assert result.exit_code == 0, text
    report = load_report(tmp_path / "a")
    assert [c["status"] for c in report["conditions"]] == ["completed"] * 3
    assert [c["corrupted_count"] for c in report["conditions"]] == [0, 0, 0]
    assert report["reference"]["cached"] is False
    result, text = invoke([*SMALL, "--guard", "off", "--out", str(tmp_path / "b"), "--expect", "clean"])
    assert result.exit_code == 1 and "expectation failed" in text


def test_reference_is_cached_between_runs(tmp_path):
    args = [*SMALL, "--guard", "chunk"]
    assert invoke([*args, "--out", str(tmp_path / "a")])[0].exit_code == 0
    assert invoke([*args, "--out", str(tmp_path / "b")])[0].exit_code == 0
    first, second = load_report(tmp_path / "a"), load_report(tmp_path / "b")
    assert (first["reference"]["cached"], second["reference"]["cached"]) == (False, True)
    assert first["conditions"][0]["accuracy"] == second["conditions"][0]["accuracy"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "sentimnet"], "Unknown scenario 'sentimnet'. Did you mean 'sentiment'?"),
        (["run", "sentiment", "--batch-size", "0"], "--batch-size must be >= 1, got 0."),
        (["run", "sentiment", "--device", "mps"], "Device 'mps' is not available on this machine"),
        (["run", "sentiment", "--guard", "sometimes"], "--guard must be one of off, raise, chunk, all"),
        (["run", "sentiment", "--model", "no-such-org/no-such-model"], "Model 'no-such-org/no-such-model' could not be loaded"),
        (["run", "sentiment", "--batch-size", "100000000"], "This run needs about"),
        (["run", "sentiment", "--max-length", "384", "--batch-size", "8"], "power-of-two lengths"),
        # Offline with an empty Hugging Face cache, as on CI.
        (["run", "sentiment", "--dataset", "tweet_eval"], "Dataset 'tweet_eval' (sentiment, test) is not in the local cache"),
    ],
)
def test_bad_input_is_one_actionable_line_and_leaves_nothing(tmp_path, monkeypatch, args, message):
    import mpsimpact.output.files as files

    # A disk with room for any report (the free-space check has its own tests, tests/test_input_bounds.py): each
    # case's own check speaks (10**8 texts would also need 286 GiB of report).
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1 << 50})())
    out = tmp_path / "never"
    result, text = invoke([*args, "--out", str(out)])
    assert result.exit_code == 2, text
    assert message in text and "Traceback" not in text
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_csv_without_a_text_column_is_refused(tmp_path):
    data = tmp_path / "data.csv"
    data.write_text("sentence,label\nhello,positive\n")
    result, text = invoke(["run", "sentiment", "--dataset", str(data), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "has no 'text' column" in text


def test_interrupted_report_leaves_no_complete_looking_folder(tmp_path, monkeypatch):
    import mpsimpact.runs.figures

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mpsimpact.runs.figures, "render_all", interrupted)
    out = tmp_path / "run"
    result, _ = invoke([*SMALL, "--guard", "off", "--out", str(out)])
    assert result.exit_code != 0
    assert not out.exists() and not list(tmp_path.glob(".run*"))


@pytest.fixture
def tiny_roberta_dir(tmp_path):
    """A tiny random RoBERTa sequence classifier (4 heads) with a WordPiece tokenizer, saved offline."""
    from transformers import AutoTokenizer, RobertaConfig, RobertaForSequenceClassification

    from mpsimpact.models.classifier import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    config = RobertaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=32, max_position_embeddings=66, pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.5, num_labels=3,
        id2label={0: "negative", 1: "neutral", 2: "positive"}, label2id={"negative": 0, "neutral": 1, "positive": 2},
    )
    model = RobertaForSequenceClassification(config)
    path = tmp_path / "tiny-roberta"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    data = tmp_path / "tweets.csv"
    rows = [f"text {i} about cars and {'good' if i % 3 else 'bad'} days,{['negative', 'neutral', 'positive'][i % 3]}" for i in range(12)]
    data.write_text("text,label\n" + "\n".join(rows) + "\n")
    return path, data


def test_hub_model_path_with_a_local_csv(tmp_path, tiny_roberta_dir):
    model, data = tiny_roberta_dir
    out = tmp_path / "run"
    # P (16*4, 64, 64): 2**17 / 4096 = 32 batch-heads -> text 8; the FFN (16*64, 32) stays below 2**17.
    result, text = invoke(["run", "sentiment", "--model", str(model), "--dataset", str(data), "--batch-size", "16",
                           "--max-length", "64", "--index-bits", "17", *PROFILE, "--out", str(out)])
    assert result.exit_code == 0, text
    report = load_report(out)
    off, _, chunk = report["conditions"]
    assert report["model"] == str(model) and report["repeated_texts"] == 4
    assert not report["geometry"]["replayed"]  # 64 tokens run at full scale on the CPU
    assert (off["first_corrupted_index"], off["corrupted_count"]) == (8, 8)
    assert chunk["corrupted_count"] == 0


def test_a_run_judges_its_release_once_and_predicts_each_attention_once(counted):
    from mpsimpact.config import RunConfig
    from mpsimpact.runs.runner import run_scenario

    config = RunConfig(batch_size=2, max_length=16, guard="off", attention="both", torch_profile="2.14.0")
    report, _ = run_scenario(config)
    assert len(counted["resolve_profile"]) == 1 and len(counted["installed_profile"]) <= 1
    sections = counted["sections"]  # one PredictionSection per attention, each predicted once; the report's
    assert [s.plan.profile.release for s in sections] == ["2.14.0", "2.14.0"]
    predicted = [id(plan) for plan in counted["predict"]]
    assert [predicted.count(id(s.plan)) for s in sections] == [1, 1]
    assert report["predictions"] == {a: s.prediction_json() for a, s in zip(("eager", "sdpa"), sections)}
    assert report["release"] == sections[0].release_json()


def test_quick_chooses_the_geometry_where_a_models_damage_is_silent(tmp_path, tiny_roberta_dir):
    model, data = tiny_roberta_dir
    out = tmp_path / "run"
    # 64 positions: --quick's 256 tokens become 64, where 16 texts hold P (64, 64, 64) = 2**18 elements, far under
    # 2**23: clean. Of the geometries that are silent, 17 bits wraps P V from batch-head 2**17 / 64**2 = 32, text 8
    # (8 of 16 wrong: the share nearest a third), the feed-forward's (1024, 32) = 2**15 elements staying under it.
    result, text = invoke(["run", "sentiment", "--model", str(model), "--dataset", str(data), "--quick", *PROFILE,
                           "--guard", "off", "--out", str(out)])
    assert result.exit_code == 0, text
    report = load_report(out)
    assert [report["config"][k] for k in ("batch_size", "max_length", "index_bits")] == [16, 64, 17]
    off = report["conditions"][0]
    assert (off["first_corrupted_index"], off["corrupted_count"], off["predicted_first_corrupted_index"]) == (8, 8, 8)
    assert "--quick chose 16 texts of 64 tokens at a 17-bit index for this model" in " ".join(text.split())
