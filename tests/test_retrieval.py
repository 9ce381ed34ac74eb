"""`mpsimpact run retrieval` end to end through the CLI at a small geometry (as tests/test_run.py's
SMALL: 16 texts at 256 tokens, index width 2**23, replayed at 64), the sentence-transformers guard snippet of
the guard's page (docs/guard.md) at a reduced index width, and the run kinds' single home."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from said import flat

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
# P (16*12, 256, 256): 2**23 / 65536 = 128 batch-heads -> divmod(128, 12) = text 10, head 8.
# 2.14.0: the P V wrap alone; on 2.13.0 (the installed torch) the scale on scores past LIMIT aborts first.
SMALL = ["run", "retrieval", "--batch-size", "16", "--max-length", "256", "--index-bits", "23",
         "--torch-profile", "2.14.0"]


@pytest.mark.ci  # whole runs, 6 s: CI runs it after the default selection (pytest -m ci)
def test_small_retrieval_run_under_each_guard(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    result = runner.invoke(app, [*SMALL, "--out", str(out), "--expect", "corrupted"])
    assert result.exit_code == 0, result.output
    lines = " ".join(result.output.split())  # the console wraps its lines at the width (80 here)
    assert "EMULATED MPS, guard off: 6 corrupted vectors (first 10, predicted 10)" in lines
    report = json.loads((out / "report.json").read_text())
    assert report["kind"] == "embedding" and report["geometry"]["replayed"]
    off, stop, chunk = report["conditions"]
    assert (off["status"], off["corrupted_count"], off["first_corrupted_index"]) == ("completed", 6, 10)
    assert off["predicted_first_corrupted_index"] == report["prediction"]["first_corrupted_text"] == 10
    assert off["corrupted_contiguous_to_end"] and off["max_corrupted_cosine"] < 0.99 < 1 - 1e-6 < off["min_clean_cosine"]
    assert 0 < off["self_retrieval_failures"] <= 6 and off["recall_at_10"] < 1.0 and off["top1_changed"] > 0
    assert off["hubs"]["expected_if_uniform"] == 256 * 10 * 6 / 16
    assert stop["status"] == "stopped_by_guard" and "would return wrong values from sample 10" in stop["message"]
    assert (chunk["status"], chunk["corrupted_count"], chunk["recall_at_10"], chunk["self_retrieval_failures"]) == ("completed", 0, 1.0, 0)
    assert chunk["min_cosine"] > 1 - 1e-6
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["position"] for s in samples if s["guard"] == "off" and s["corrupted"]] == list(range(10, 16))
    for name in ("report.md", "report.html", "embeddings.npz", "cosine_by_position.png", "recall_per_query.png", "top10_appearances.png"):
        assert (out / name).stat().st_size > 0, name
    assert "EMULATED MPS" in (out / "report.md").read_text() and "emulated" in (out / "report.html").read_text()


def test_retrieval_refuses_a_dataset(tmp_path):
    result = runner.invoke(app, ["run", "retrieval", "--dataset", "tweet_eval", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "run retrieval does not use --dataset" in flat(result.stderr)
    assert not (tmp_path / "o").exists()


def readme_snippet(marker: str) -> str:
    """The python block that follows `marker` in docs/guard.md (the guard's page)."""
    text = (ROOT / "docs" / "guard.md").read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index(marker):], re.DOTALL)
    return block.group(1)


@pytest.fixture(scope="module")
def sentence_transformer():
    from mpsimpact.models.embedder import load_sentence_transformer

    return load_sentence_transformer()


def test_readme_guard_snippet_for_sentence_transformers(sentence_transformer):
    import torch

    import mpsimpact
    from mpsimpact.models.dataset import load_embedded
    from mpsimpact.errors import NotEmulatedError

    texts = list(load_embedded("heldout").texts[:64])
    model = sentence_transformer
    # encode pads to the longest text (L tokens): P (64*12, L, L) and the feed-forward output
    # (64*L, 1536) both pass 2**20 elements, and already the embeddings' output (64, L, 384) passes 2**19:
    # a lookup that big nobody measured, so unguarded the emulator stops there (not emulated); the guard
    # splits it, and every later call past a limit.
    longest = max(len(ids) for ids in model.tokenizer(texts)["input_ids"])
    assert 64 * 12 * longest * longest > 2**20 and 64 * longest * 1536 > 2**20
    with torch.inference_mode():
        clean = model.encode(texts, batch_size=len(texts))
        with mpsimpact.emulate(index_bits=20, profile="2.14.0"):
            with pytest.raises(NotEmulatedError, match="embedding"):
                model.encode(texts, batch_size=len(texts))
            namespace = {"mpsimpact": mpsimpact, "model": model, "texts": texts}
            exec(readme_snippet("<!-- tested: sentence-transformers guard -->"), namespace)  # noqa: S102 (our own docs page)
    np.testing.assert_allclose(namespace["embeddings"], clean, atol=1e-6, rtol=0)


def test_no_kind_branches_in_runner_report_or_cli():
    # A run kind compared by name, or a training flag (a fault's `.kind` is not a run kind).
    pattern = re.compile(r"""(?<![.\w])kind\s*==|\("kind"\)\s*==|\["kind"\]\s*==|\btraining\b""")
    run_command = (ROOT / "src/mpsimpact/commands/run.py").read_text()
    for name, text in (("runner.py", (ROOT / "src/mpsimpact/runs/runner.py").read_text()),
                       ("report.py", (ROOT / "src/mpsimpact/reports/run.py").read_text()), ("commands/run.py", run_command)):
        hits = [line for line in text.splitlines() if pattern.search(line) and "help=" not in line]
        assert not hits, f"{name} branches on the kind of run: {hits}"
    assert pattern.search('if report.get("kind") == "training":') and pattern.search("training = True")  # the grep can fail
