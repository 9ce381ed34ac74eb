"""`plan --versions`: the outcome on every torch release, per attention implementation and workload, at
the published demo's geometry (2048 x 512, all-MiniLM-L6-v2's 12 heads), from shapes alone."""

import json

from typer.testing import CliRunner

from mpsimpact.cli import app
from said import flat

runner = CliRunner()


def cells(rows, attention, workload):
    return {r["release"]: r for r in rows if r["attention"] == attention and r["workload"] == workload}


def test_version_table_at_the_demo_geometry(tmp_path):
    out = tmp_path / "plan"
    result = runner.invoke(app, ["plan", "sentiment", "--batch-size", "2048", "--versions", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["versions"]
    assert set(rows[0]) == {"release", "attention", "workload", "outcome", "first_corrupted_text", "corrupted_count", "message", "note"}
    releases = list(dict.fromkeys(r["release"] for r in rows))
    # 2.13.0 and 2.14.0 part ways on purpose: the study saw eager attention at 4.49e9 scores die on 2.13.0
    # (SIGSEGV), where 2.14.0 is wrong; the rules put the crash at the scale on the scores (inferred).
    assert releases == ["2.4.1", "2.5.1-2.8.0", "2.9.1-2.12.1", "2.13.0", "2.14.0", "unmeasured newer"]
    # Eager inference: P V wraps from batch-head 16384, divmod(16384, 12) = (1365, 4): 683 texts; on 2.13.0
    # the scale on the 2048 * 12 * 512 * 512 = 6,442,450,944 > 2**32 scores aborts first.
    eager = cells(rows, "eager", "inference")
    wrong = {r for r, c in eager.items()
             if (c["outcome"], c["first_corrupted_text"], c["corrupted_count"]) == ("wrong", 1365, 683)}
    assert wrong == {"2.4.1", "2.5.1-2.8.0", "2.9.1-2.12.1", "2.14.0"}
    crash = eager["2.13.0"]
    assert crash["outcome"] == "abort" and crash["first_corrupted_text"] is None
    assert "SIGSEGV" in crash["message"] and "rule int32-kernel, inferred" in crash["message"]
    assert eager["unmeasured newer"]["outcome"] == "abort"  # the newest measured fault, conservatively
    assert "unexplained" in eager["2.4.1"]["note"] and "signal 11" in crash["note"]
    # SDPA inference: the fused op is wrong above 2**32 score elements up to 2.12.1, texts unknown; correct
    # from 2.13.0; an unmeasured release takes the math path, whose softmax aborts on 2.13.0.
    sdpa = cells(rows, "sdpa", "inference")
    assert [sdpa[r]["outcome"] for r in releases] == [
        "wrong", "wrong_other", "wrong_other", "clean", "clean", "abort"]
    assert sdpa["2.9.1-2.12.1"]["first_corrupted_text"] is None and "not characterised" in sdpa["2.9.1-2.12.1"]["message"]
    # One training step: logits wrong, then grad P^T @ dO reads P through a transposed view of
    # 2048 * 12 * 512**2 > 2**31 elements: the INT_MAX error (misspelt on 2.9.1 .. 2.12.1); on
    # 2.5.1 .. 2.8.0 a view above 2**32 wraps instead, silently.
    train = cells(rows, "eager", "training")
    assert train["2.14.0"]["outcome"] == "error" and "MPSGraph does not support" in train["2.14.0"]["message"]
    assert train["2.13.0"]["outcome"] == "abort"  # in forward, at the scale
    assert train["2.9.1-2.12.1"]["outcome"] == "error" and "MPSGaph does not support" in train["2.9.1-2.12.1"]["message"]
    assert train["2.5.1-2.8.0"]["outcome"] == "wrong" and "silently wrong in backward" in train["2.5.1-2.8.0"]["message"]
    assert (out / "versions.md").read_text().startswith("| torch | eager, inference |")
    assert (out / "versions.png").read_bytes()[:4] == b"\x89PNG" and json.loads((out / "plan.json").read_text())["versions"] == rows


def test_the_profile_decides_the_plan_and_bad_profiles_are_refused(tmp_path):
    result = runner.invoke(app, ["plan", "sentiment", "--batch-size", "2048", "--torch-profile", "2.5.1", "--json"])
    report = json.loads(result.stdout)
    assert report["profile"]["release"] == "2.5.1" and report["prediction"]["first_wrong_sample"] == 1365
    result = runner.invoke(app, ["plan", "sentiment", "--torch-profile", "newest", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--torch-profile: 'newest' is not a torch release" in flat(result.stderr)
    assert not (tmp_path / "x").exists()
