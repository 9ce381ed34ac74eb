"""What the audience reads, part four (issue 58): every number in the user's unit, and "safe" means it runs. One
test per numbered example of the issue, on the words (the consoles' own scan is in tests/test_snapshots.py)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app

runner = CliRunner()
DATA = Path(__file__).parent / "data"
BERT = str(DATA / "bert-base" / "config.json")
# Llama-3.1-8B (bf16): 32 layers, 32 heads of 128, 8 key/value heads, a 128256-token vocabulary.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def said(args, **env) -> str:
    result = runner.invoke(app, args, env={"COLUMNS": "80", **env})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


def stop(**fields):
    return {"guard": "raise", "status": "stopped_by_guard", "message": "mpsimpact guard: bmm[...] ...",
            "where": "attention's weighted sum of the values", "stop": {"by": "guard", **fields}}


def test_1_a_guard_stop_is_told_in_texts_and_its_rows_only_with_verbose():
    from mpsimpact.output.page import Footnotes
    from mpsimpact.runs.kind import status_cell

    # The 4096 run: the P V wrap from bmm batch 16384 = 12 rows a text x 1365; a batch of 1365 texts runs it whole
    # (P at most 2**32 elements: 16380 rows), a piece of the guard's split (a slice, a view) holds 8191 rows = 682.
    condition = stop(kind="wrong_tail", release="2.14.0", phase="forward", rows_per_sample=12, first_wrong_row=16384,
                     first_wrong_sample=1365, safe_rows=8191, safe_samples=682, whole_rows=16380, whole_samples=1365,
                     index_bits=32)
    notes = Footnotes()
    status_cell(condition, notes)
    (line,) = notes.lines()
    assert "from text 1365 on" in line and ("At most 1365 texts at once run this call correctly: lower the batch "
                                            "size to 1365") in line
    assert "16384" not in line and "8191" not in line and "batch" not in line.replace("batch size", "")
    assert "index" not in line  # MPS's own width: nothing narrowed to say
    narrowed = stop(kind="wrong_tail", release="2.14.0", rows_per_sample=12, first_wrong_row=128,
                    first_wrong_sample=10, safe_rows=63, safe_samples=5, index_bits=23)
    notes = Footnotes()
    status_cell(narrowed, notes)
    assert "at this run's 23-bit index, every limit divided by 2^9" in notes.lines()[0]
    notes = Footnotes()
    status_cell(narrowed, notes, verbose=True)  # --verbose: the guard's own message, rows and all
    assert notes.lines()[0].startswith("[1] guard raise: stopped_by_guard: mpsimpact guard: bmm")


def test_1_the_guards_error_carries_the_rows_per_sample_the_console_counts_in():
    import torch

    import mpsimpact
    from mpsimpact.errors import OversizedOpError

    # (4, 12, 64, 64) @ (4, 12, 64, 8) at a 16-bit index: 48 bmm batches of 64 x 64 = 4096 elements each; P is past
    # 2**16 from batch 16, which is text 16 // 12 = 1.
    p, v = torch.randn(4, 12, 64, 64), torch.randn(4, 12, 64, 8)
    with pytest.raises(OversizedOpError) as error, mpsimpact.guard("raise", index_bits=16, devices=("cpu",),
                                                                    profile="2.14.0"):
        torch.matmul(p, v)
    fields = error.value.fields
    assert fields["rows_per_sample"] == 12 and fields["index_bits"] == 16
    assert fields["fault"].first_bad_batch // fields["rows_per_sample"] == 1
    # "safe" as the plan means it: a batch of 1 text (12 batches of 4096, P at most 2**16) runs the call whole; a piece
    # of the split is a slice, a view, held below 2**15: 7 batches, not one whole text.
    assert (fields["safe_batch"], fields["safe_chunk"]) == (16, 7)
    assert ("It runs correctly on a batch of at most 1 sample of the first dimension (12 bmm batches): lower the batch "
            "size to 1, or use guard mode 'chunk' (its pieces, slices of the batch, hold part of one (7 bmm batches)).") in str(error.value)


def test_2_and_3_plan_and_check_say_sizes_in_words_with_units():
    text = said(["plan", "sentiment", "--memory", "16GB", "--torch-profile", "2.14.0"])
    assert "6.44 billion" in text and "402.7 million" in text and "6.44G" not in text
    assert "ops traced" not in text and "on meta" not in text and "first bad row" not in text
    assert "first wrong text" in text and "128 operations, 50 of them matrix products" in text
    verbose = said(["plan", "sentiment", "--verbose"])
    assert "ops traced" in verbose and "first bad row (sample, head)" in verbose  # the technical words, when asked
    check = said(["check", BERT, "--batch-size", "2048", "--verbose"])
    assert "(109.5 million parameters)" in check and "G parameters" not in check and "G elements" not in check


def test_4_and_7_a_stop_after_wrong_values_is_not_before_any_and_every_sentence_ends():
    text = said(["check", BERT, "--batch-size", "2048", "--memory", "16GB", "--torch-profile", "2.12.1"])
    assert "returns wrong values in a pattern nobody characterised" in text
    # layer 0's SDPA (call 10) goes wrong before layer 0's feed-forward (call 15) cannot be allocated
    assert "before any wrong value" not in text and "after 1 call already returned wrong values" in text
    assert "rather than invent its values" not in text and "instead of inventing them." in text
    assert "Mac: A 16 GB Mac" not in text and "On a 16 GB Mac, Metal allocates one buffer" in text
    assert "guard: The" not in text and "guard: guard" not in text


def test_5_the_upgrade_advice_agrees_with_what_the_installed_release_is_said_to_do():
    text = said(["check", BERT, "--batch-size", "2048", "--torch-profile", "2.12.1"])
    assert "nobody measured torch 2.13.0 on MPS at gelu" in text  # the line about the installed torch
    assert "upgrading torch fixes those calls" not in text
    assert ("Upgrading torch fixes the fused SDPA calls (correct from torch 2.13.0), but on torch 2.13.0 nobody "
            "measured what it does at gelu") in text


def test_6_plan_on_a_16gb_mac_shows_no_largest_batch_that_does_not_fit():
    report = json.loads(said(["plan", "sentiment", "--memory", "16GB", "--json"]))
    watermark = report["mac"]["high_watermark_gib"]
    assert watermark == pytest.approx(1.7 * 16 * 2 / 3, abs=0.01)  # 1.7 x the working set, 2/3 of 16 GB
    for length, batch in report["largest_safe_batch_by_length"].items():  # each one runs: clean, and it fits
        at = json.loads(said(["plan", "sentiment", "--memory", "16GB", "--json", "--batch-size", str(batch),
                              "--max-length", length]))
        assert at["prediction"]["outcome"] == "clean" and at["estimated_peak_gib"] <= watermark, length
        past = json.loads(said(["plan", "sentiment", "--memory", "16GB", "--json", "--batch-size", str(batch + 1),
                                "--max-length", length]))
        assert past["prediction"]["outcome"] == "error", length  # the buffer or the watermark stops it


def test_6_the_watermark_is_torchs_variable_and_a_bad_value_is_refused_in_one_line():
    report = json.loads(said(["plan", "sentiment", "--memory", "16GB", "--json"],
                             PYTORCH_MPS_HIGH_WATERMARK_RATIO="1.0"))
    assert report["mac"]["high_watermark_gib"] == pytest.approx(16 * 2 / 3, abs=0.01)
    unlimited = json.loads(said(["plan", "sentiment", "--memory", "16GB", "--json"],
                                PYTORCH_MPS_HIGH_WATERMARK_RATIO="0"))
    assert unlimited["mac"]["high_watermark_gib"] is None  # torch's 0: no limit
    assert unlimited["largest_safe_batch"] >= report["largest_safe_batch"]
    result = runner.invoke(app, ["plan", "sentiment", "--memory", "16GB"], env={"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "3"})
    assert result.exit_code == 2 and "PYTORCH_MPS_HIGH_WATERMARK_RATIO='3' is out of range" in result.stderr


@pytest.mark.ci  # the whole 8B model traced several times: about 20 s
def test_6_a_llama_8b_at_8191_tokens_on_a_16gb_mac_runs_out_of_memory_and_its_safe_length_fits(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_31_8B))
    args = ["check", str(config), "--seq-len", "8191", "--attention", "eager", "--memory", "16GB", "--json"]
    report = json.loads(said(args))
    prediction, watermark = report["prediction"], report["mac"]["high_watermark_gib"]
    assert report["estimated_peak_gib"] > watermark  # about 35 GiB against 18.1
    assert prediction["outcome"] == "error" and prediction["stops"][0]["rule"] == "high-watermark"
    assert prediction["stops"][0]["message"].startswith("MPS backend out of memory")
    assert prediction["describe"].startswith("MPS stops the run with 'MPS backend out of memory")
    safe = report["longest_safe_length"]
    assert 0 < safe < 8191
    at_safe = json.loads(said([*args[:3], str(safe), *args[4:]]))
    assert at_safe["prediction"]["outcome"] == "clean" and at_safe["estimated_peak_gib"] <= watermark
    text = said(args[:-1])
    assert "predicted: MPS stops the run with 'MPS backend out of memory" in text and "predicted: clean" not in text


def test_8_torchs_misspelt_text_is_quoted_as_torchs():
    from mpsimpact.engine.release import torch_words

    assert torch_words("MPSGaph does not support tensor dims larger than INT_MAX") == (
        "in torch's own words, misspelling and all: 'MPSGaph does not support tensor dims larger than INT_MAX'")
    assert torch_words("MPSGraph does not support tensor dims larger than INT_MAX").startswith("in torch's own words:")


def test_9_a_number_never_wraps_away_from_its_unit_nor_a_word_inside_a_table_cell():
    from rich.console import Console

    from mpsimpact.errors import wrapped
    from mpsimpact.output.page import fitted_table

    for text in ("device pass on cpu, eager attention, guard chunk (layers): 1/6 (396 s, about 198 s left)",
                 "assumed to allocate one buffer of at most half its unified memory (a 16 GB Mac: 8 GiB, so no",
                 "the process would die: SIGSEGV (signal 11): the process dies with no error message at all"):
        for width in range(30, 90):
            for line, after in zip(*(lambda lines: (lines, lines[1:]))(wrapped(text, width).split("\n"))):
                assert not (line.rstrip()[-1:].isdigit() and after.split()[0] in ("s", "GB", "GiB", "11)")), line
                assert not line.endswith("(signal")
    table = fitted_table("op-family cells", ("cell", "code"), [["masked_fill-1d", "masked-fill-numel"]])
    for width in (30, 40, 60):
        console = Console(width=width, record=True)
        console.print(table)
        assert "masked-fill-numel" in console.export_text(), width


def test_10_compare_reads_at_80_columns_and_says_text(tmp_path):
    import copy

    from test_compare import TEMPLATE, write_run

    mode = ("EMULATED MPS (torch 2.13.0) on cpu with texts of 64 tokens standing for 256, at a 23-bit index, the "
            "long way a mode is said")
    old = copy.deepcopy(TEMPLATE)
    old["geometry"]["mode"] = mode
    new = copy.deepcopy(old)
    new["conditions"][0]["first_corrupted_index"] = 1364
    new["conditions"][0]["corrupted_count"] = 684
    result = runner.invoke(app, ["compare", str(write_run(tmp_path / "old", old)), str(write_run(tmp_path / "new", new))],
                           env={"COLUMNS": "80"})
    lines = result.stdout.splitlines()
    table = lines[lines.index(next(line for line in lines if "Environment" in line)):]
    table = table[:next(i for i, line in enumerate(table) if line.startswith("└"))]
    assert not any("│" in line and " mode " in line for line in table)  # said above, once per side
    assert len(table) < 14 and all(len(line) <= 80 for line in lines)
    text = " ".join(result.stdout.split())
    assert "first at text 1365 -> 1364" in text and "position" not in text
    from types import SimpleNamespace

    from mpsimpact.reports.compare import result_line

    one = SimpleNamespace(verdicts=[SimpleNamespace(changed=True)], exit_code=1, undecided=False)
    assert result_line(one) == "1 change that matters: exit code 1."


def test_11_the_sweeps_first_estimate_comes_from_the_first_cell_and_the_judged_release_leads():
    from types import SimpleNamespace

    from mpsimpact.runs.cell import CellClock

    # 100 cells whose sizes say 0.001 s each, each really taking 0.1 s (what starting a cell costs): the first
    # estimate, after one cell, must be within 3x of the 10 s the sweep takes (the sizes alone said 0.1 s).
    cells = [SimpleNamespace(estimated_seconds=lambda device: 0.001) for _ in range(100)]
    clock = CellClock(cells, "cpu")
    clock.finished(0.1)
    total = 0.1 + clock.seconds_left()
    assert 10 / 3 <= total <= 10 * 3
    lines = []
    from mpsimpact.reports.sweep import SweepConsole

    show = SweepConsole()
    show.console = SimpleNamespace(print=lambda text, **_: lines.append(text))
    from mpsimpact.config import SweepConfig

    show.plan("EMULATED MPS (torch 2.13.0) on cpu", "Judged as torch 2.13.0, as --torch-profile asked.",
              SweepConfig(index_bits=20), (10, 10, 10, 1 << 20), 1 << 30, Path(".x.partial"))
    assert lines[0].startswith("Judged as torch 2.13.0") and "about" not in lines[2]


def test_12_matrix_says_cannot_tell_for_the_unmeasured_one_package_and_no_product_of_a_division():
    from mpsimpact.engine.release import CONSERVATIVE
    from mpsimpact.reports.matrix import short_outcome
    from mpsimpact.upgrade.matrix import _attention_ops

    cell = {"outcome": "abort", "first_corrupted_text": None}
    assert short_outcome(cell, profile=CONSERVATIVE) == "cannot tell" and short_outcome(cell, profile="2.13.0") == "abort"
    operand = {"shape": [2, 12, 8, 8], "layout": "contiguous"}
    lines = _attention_ops([{"op": "div", "a": operand, "b": operand, "within_sdpa": True, "count": 1},
                            {"op": "bmm", "a": operand, "b": operand, "within_sdpa": False, "count": 2}])
    assert lines[0].startswith("div on [2,12,8,8]") and "@" not in lines[0] and "@" in lines[1]


def test_13_finetunes_headline_is_in_words_and_its_raw_op_only_in_verbose():
    from mpsimpact.runs.kinds import KINDS

    off = {"guard": "off", "status": "error", "phase": "backward", "corrupted_count": 6,
           "where": "the sum in the backward pass of a linear layer", "unmeasured": False,
           "message": "sum([4096, 1536] -> [1, 1536]) (float32, reduction): MPS sum_reduction: tensors requiring "
                      "64-bit indexing are not supported (numel=6291456) (emulated MPS 2.14.0; MPS raises)",
           "stop": {"by": "mps", "kind": "error", "release": "2.14.0", "phase": "backward",
                    "torch_text": "MPS sum_reduction: tensors requiring 64-bit indexing are not supported "
                                  "(numel=6291456)"}}
    report = {"geometry": {"batch_size": 16, "emulated": True, "profile": "2.14.0"}, "release": {"release": "2.14.0"},
              "conditions": [off]}
    plain = KINDS["training"].headline(report, plain=True)
    assert "sum([4096" not in plain and "the sum in the backward pass of a linear layer" in plain
    assert "in torch's own words: 'MPS sum_reduction" in plain and "then MPS raises" in plain
    assert "sum([4096, 1536]" in KINDS["training"].headline(report, plain=False)
