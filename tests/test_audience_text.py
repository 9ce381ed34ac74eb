"""What the audience reads (issue 48, in part): sentences that never print an empty list or a count that differs
from the items listed."""

from mpsimpact.runs.runner import truncated_words


def stats(positions, texts=100):
    return {"truncated_by_reduced_length": positions, "truncated_by_reduced_length_fraction": len(positions) / texts}


def test_the_reduced_lengths_cut_is_said_in_words_never_as_an_empty_list():
    assert truncated_words(stats([]), 64) == "no text is longer than 64 tokens, so the reduction cut none"
    assert truncated_words(stats([7]), 64) == "1 text (1.00%) longer than 64 tokens was cut by the reduction (positions 7)"
    many = truncated_words(stats(list(range(26))), 64)  # 26 texts, 20 listed: said so
    assert many.startswith("26 texts (26.00%)") and "the first 20 at positions 0, 1," in many and "19)" in many
    assert "[" not in many and "None" not in many


def test_each_guard_mode_gets_one_plain_line_in_the_runs_summary():
    from mpsimpact.runs.kinds import KINDS

    kind = KINDS["inference"]
    conditions = [
        {"guard": "off", "status": "completed", "corrupted_count": 6},
        {"guard": "raise", "status": "stopped_by_guard", "where": "eager attention's P V product"},
        {"guard": "chunk", "status": "completed", "corrupted_count": 0},
        {"guard": "chunk", "status": "error", "buffer_refused": "Invalid buffer size: 8.19 GB",
         "attention": "blocked_eager"},
    ]
    assert kind.guard_lines({"conditions": conditions}) == [
        "guard raise: stopped before any wrong value, at eager attention's P V product.",
        "guard chunk: 0 wrong, every output matches the reference.",
        "guard chunk (blocked_eager attention): cannot help: MPS refuses the allocation ('Invalid buffer size: "
        "8.19 GB').",
    ]


def test_a_release_nobody_measured_is_cannot_tell_in_plan_and_in_the_version_table():
    import json

    from typer.testing import CliRunner

    from mpsimpact.cli import app

    result = CliRunner().invoke(app, ["plan", "sentiment", "--torch-profile", "2.15.0", "--json"])
    assert result.exit_code == 0, result.output
    describe = json.loads(result.stdout)["prediction"]["describe"]
    assert describe.startswith("cannot tell: nobody measured torch 2.15.0 on MPS at ") and "`mpsimpact sweep`" in describe
    said = " ".join(CliRunner().invoke(app, ["plan", "sentiment", "--torch-profile", "2.15.0"],
                                       env={"COLUMNS": "200"}).stdout.split())
    assert "Cannot tell what torch 2.15.0 does: nobody measured it on MPS" in said
    assert "MPS aborts the process at call" not in said.split("Judged as the worst measured release would be")[0]


def test_a_headline_counts_the_outputs_silently_wrong_before_a_later_error():
    from mpsimpact.runs.kinds import KINDS

    report = {"geometry": {"batch_size": 16, "emulated": True, "profile": "2.14.0"}, "release": {"release": "2.14.0"},
              "conditions": [{"guard": "off", "status": "error", "phase": "backward", "corrupted_count": 6,
                              "message": "sum(...): MPS sum_reduction: tensors requiring 64-bit indexing"}]}
    said = KINDS["training"].headline(report, plain=True)
    assert said.startswith("EMULATED MPS. Silent, then stopped: 6 of 16 outputs came back wrong with no error")
    assert "then without a guard the run did not complete (error: sum(...)" in said
    report["conditions"][0]["corrupted_count"] = 0  # nothing wrong before the stop: not silent at all
    assert KINDS["training"].headline(report, plain=True).startswith("EMULATED MPS. Not silent: ")


def test_retrieval_lines_say_no_corruption_in_words_never_none():
    from mpsimpact.runs.embed_kind import retrieval_lines

    clean = {"guard": "chunk", "status": "completed", "corrupted_count": 0, "first_corrupted_index": None,
             "predicted_first_corrupted_index": 10, "self_retrieval": {"failures": 0, "median_failed_rank": None,
                                                                     "max_rank": 1},
             "query_results": {"recall_at_10": 1.0, "top1_changed": 0, "queries": 256}, "hubs": {}, "direction": {}}
    (line,) = retrieval_lines({"conditions": [clean]})
    assert line == ("guard chunk: no corrupted vector (predicted 10); self-retrieval: every document is still its "
                    "own nearest neighbour; queries: mean recall@10 1.0000, top-1 changed for 0 of 256.")


def test_a_site_is_said_in_words_and_its_shapes_only_when_asked():
    from mpsimpact.engine.call import CallRecord
    from mpsimpact.engine.faults import OK, TensorSpec
    from mpsimpact.prediction.outcome import site

    scores = TensorSpec.contiguous((16, 12, 256, 256))
    call = CallRecord(13, "mul", scores, scores, OK, module="encoder.layer.0.attention.self")
    assert site(call) == "the scaling of the attention scores"
    assert site(call, shapes=True) == "the scaling of the attention scores (mul on 16x12x256x256)"


def test_the_reports_prediction_line_says_where_the_run_stops_and_what_nobody_measured():
    # A run that stops has no wrong text to count ("first corrupted text -, 0 of 16" read as clean).
    from mpsimpact.reports.run import _predicted

    stop = {"kind": "abort", "call": {"op": "mul", "index": 4, "phase": "forward"}}
    stopped = {"stops": stop, "first_corrupted_text": None, "first_corrupted_head": None, "corrupted_count": 0}
    assert _predicted(stopped, 16, {"measured": True, "release": "2.13.0"}) == (
        "Predicted from shapes alone: no text comes back: the process dies at mul (call 4, forward).")
    raised = dict(stopped, stops=dict(stop, kind="error"))
    assert "no text comes back: MPS raises at mul" in _predicted(raised, 16, {})
    wrong = {"stops": None, "first_corrupted_text": 10, "first_corrupted_head": 8, "corrupted_count": 6}
    assert _predicted(wrong, 16, {"measured": True}) == (
        "Predicted from shapes alone: 6 of 16 texts wrong, from text 10 (head 8).")
    clean = dict(wrong, first_corrupted_text=None, first_corrupted_head=None, corrupted_count=0)
    assert _predicted(clean, 16, {"measured": True}) == "Predicted from shapes alone: none of the 16 texts wrong."
    assert _predicted(stopped, 16, {"measured": False, "release": "2.15.0"}).endswith(
        "Nobody measured torch 2.15.0 on MPS: judged conservatively.")
