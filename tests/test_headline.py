"""The talk's headline: one plain sentence per run, computed from the guard-off condition, honest about
what happened (silent, clean, a crash, MPS's error, values nobody characterised, a release nobody
measured) and about emulation; a figure says the same in a few words."""

import pytest

from mpsimpact.runs.kinds import kind_of

SCALE = "the scaling of the attention scores"


def report(kind="inference", emulated=True, release=None, **off):
    condition = {"guard": "off", "status": "completed", "corrupted_count": 2731, "flips": 1387,
                 "non_finite_count": 0, "collapse": {"class": "neutral", "device_share": 0.804}} | off
    run = {"kind": kind, "geometry": {"batch_size": 4096, "emulated": emulated, "profile": "2.14.0"},
           "conditions": [condition, {"guard": "chunk", "status": "completed", "corrupted_count": 0}]}
    return run | ({"release": release} if release else {})


def headline(**kwargs):
    run = report(**kwargs)
    return kind_of(run).headline(run)


def test_a_silent_corruption_says_so_with_its_numbers():
    # Outputs (the logits) go wrong; a prediction (the label) is said to change only where it did.
    assert headline(emulated=False) == ("Silent: 2731 of 4096 outputs came back wrong, no error, no warning, no "
                                        "NaN; 1387 predictions changed class; most (80%) collapsed onto 'neutral'.")
    assert headline().startswith("EMULATED MPS. Silent:")
    assert "1 prediction changed class" in headline(flips=1)


# A pass that did not complete has no outputs to count (corrupted_count None, as runs write it); a training step's
# logits wrong before its backward stops are counted (tests/test_audience_text.py).
ABORTED = {"status": "error", "where": SCALE, "message": "mul(...): SIGSEGV (signal 11) (emulated MPS 2.13.0)",
           "altered_calls": [{"fault": {"kind": "abort"}}], "corrupted_count": None}


@pytest.mark.parametrize(("off", "said"), [
    ({"corrupted_count": 0, "flips": 0}, "Clean: without a guard every output matches"),
    (ABORTED, f"Not silent: the process would die at {SCALE}: torch 2.14.0 aborts there, no result at all."),
    ({"status": "skipped_predicted_abort", "where": SCALE, "corrupted_count": None}, f"Not silent: the process would die at {SCALE}"),
    ({"status": "error", "where": "eager attention's P V product",
      "message": "MPSGraph does not support tensor dims larger than INT_MAX", "corrupted_count": None},
     "Not silent: MPS raises an error at eager attention's P V product"),
    ({"status": "not_emulated", "where": "fused attention (SDPA)"},
     "Silent on MPS, but not shown: torch 2.14.0 returns wrong values at fused attention"),
    ({"status": "not_emulated", "unmeasured": True, "where": SCALE},
     f"Cannot tell: nobody measured torch 2.14.0 on MPS at {SCALE}, so nobody can tell what it does there; "
     "`mpsimpact sweep` on a Mac measures it."),
    ({"status": "error", "message": "MPSGraph does not support tensor dims larger than INT_MAX",
      "corrupted_count": None}, "Not silent: without a guard the run did not complete (error: MPSGraph"),  # a report from before "where"
    ({"non_finite_count": 3}, "Not silent: 3 outputs came back NaN or infinite."),
    ({"collapse": {"class": "neutral", "device_share": 0.4}}, "Silent: 2731 of 4096 outputs came back wrong"),
])
def test_the_headline_never_claims_silence_that_was_not_there(off, said):
    text = headline(emulated=False, **off)
    assert text.startswith(said), text
    if "device_share" in str(off):
        assert "collapsed" not in text  # 40% is not "most"


def test_a_release_nobody_measured_is_never_said_to_crash_or_corrupt():
    unmeasured = {"release": "2.15.0", "measured": False}
    completed = headline(emulated=False, release=unmeasured)
    assert completed.startswith("Cannot tell: nobody measured torch 2.15.0 on MPS. If it behaves as the worst "
                                "measured release does: 2731 of 4096 outputs came back wrong"), completed
    assert "`mpsimpact sweep` on a Mac measures it." in completed
    stopped = headline(emulated=False, release=unmeasured, **ABORTED | {"unmeasured": True})
    assert stopped.startswith("Cannot tell: nobody measured torch 2.15.0") and "die" not in stopped


def test_a_figure_says_what_the_headline_says():
    for off, line in [({}, "guard off, silent: 2731 of 4096 outputs came back wrong"),
                      (ABORTED, f"guard off: the process would die at {SCALE}"),
                      ({"status": "not_emulated", "unmeasured": True, "where": SCALE}, "guard off: cannot tell"),
                      ({"corrupted_count": 0}, "guard off: clean")]:
        run = report(**off)
        assert kind_of(run).figure_line(run).startswith(line), off


def test_other_kinds_speak_their_own_words():
    embed = report(kind="embedding", emulated=False, self_retrieval={"failures": 2678})
    assert kind_of(embed).headline(embed) == (
        "Silent: 2731 of 4096 embeddings came back wrong, no error, no warning, no NaN; 2678 documents no longer "
        "find themselves as their own nearest neighbour.")
    train = report(kind="training", emulated=False, corrupted_count=683, corrupted_gradient_tensors=0)
    assert kind_of(train).headline(train) == (
        "Silent: 683 of 4096 logits and 0 gradient tensors came back wrong, no error, no warning, no NaN.")
