"""The talk's headline: one plain sentence per run, computed from the guard-off condition, honest about
what happened (silent, clean, not completed, NaN) and about emulation."""

import pytest

from mpsimpact.reports.run import kind_of


def report(kind="inference", emulated=True, **off):
    condition = {"guard": "off", "status": "completed", "corrupted_count": 2731, "flips": 1387,
                 "non_finite_count": 0, "collapse": {"class": "neutral", "device_share": 0.804}} | off
    return {"kind": kind, "geometry": {"batch_size": 4096, "emulated": emulated},
            "conditions": [condition, {"guard": "chunk", "status": "completed", "corrupted_count": 0}]}


def headline(**kwargs):
    run = report(**kwargs)
    return kind_of(run).headline(run)


def test_a_silent_corruption_says_so_with_its_numbers():
    assert headline(emulated=False) == ("Silent: no error, no warning, no NaN. 2731 of 4096 predictions came back "
                                        "wrong; 1387 changed class; most (80%) collapsed onto 'neutral'.")
    assert headline().startswith("EMULATED MPS. Silent:")


@pytest.mark.parametrize(("off", "start"), [
    ({"corrupted_count": 0, "flips": 0}, "Clean: without a guard every output matches"),
    ({"status": "error", "message": "MPSGraph does not support tensor dims larger than INT_MAX"},
     "Not silent: without a guard the run did not complete (error: MPSGraph"),
    ({"non_finite_count": 3}, "Not silent: 3 outputs came back NaN or infinite."),
    ({"collapse": {"class": "neutral", "device_share": 0.4}}, "Silent: no error, no warning, no NaN. 2731 of 4096"),
])
def test_the_headline_never_claims_silence_that_was_not_there(off, start):
    text = headline(emulated=False, **off)
    assert text.startswith(start), text
    if "device_share" in str(off):
        assert "collapsed" not in text  # 40% is not "most"


def test_other_kinds_speak_their_own_words():
    embed = report(kind="embedding", emulated=False, self_retrieval={"failures": 2678})
    assert kind_of(embed).headline(embed).endswith(
        "2731 of 4096 embeddings came back wrong; 2678 documents no longer find themselves as their own nearest "
        "neighbour.")
    train = report(kind="training", emulated=False, corrupted_count=683, corrupted_gradient_tensors=0)
    assert "683 of 4096 logits and 0 gradient tensors came back wrong." in kind_of(train).headline(train)
