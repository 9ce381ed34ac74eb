"""metrics.summarize on a hand-made batch of 6 texts x 3 classes, every figure worked out by hand."""

import numpy as np
import pytest

from mpsimpact.runs.metrics import relative_error, summarize

LABELS = ("negative", "neutral", "positive")
INF = np.inf
REFERENCE = np.array([
    [2.0, 0.0, -1.0],  # max |ref| 2, predicts negative
    [0.0, 2.0, -1.0],  # max 2, neutral
    [-1.0, 0.0, 4.0],  # max 4, positive
    [0.0, 4.0, 1.0],  # max 4, neutral
    [0.0, 1.0, 2.0],  # max 2, positive
    [1.0, -2.0, 0.0],  # max 2, negative
])
LOGITS = np.array([
    [2.0, 0.0, -1.0],  # identical: error 0
    [0.0, 2.001, -1.0],  # 0.001 / 2 = 0.0005 <= 1e-3: clean, still neutral
    [-1.0, 5.0, 4.0],  # 5 / 4 = 1.25: corrupted, neutral (flip)
    [0.0, 4.0, 2.0],  # 1 / 4 = 0.25: corrupted, neutral (no flip)
    [0.0, 3.0, 2.0],  # 2 / 2 = 1.0: corrupted, neutral (flip)
    [INF, -2.0, 0.0],  # not finite: corrupted (error inf), negative (no flip)
])
GOLD = np.array([0, 1, 2, 1, 2, 1])
# device predictions [0, 1, 1, 1, 1, 0], reference predictions [0, 1, 2, 1, 2, 0]


def test_relative_error_per_text():
    expected = [0.0, 0.0005, 1.25, 0.25, 1.0, INF]
    np.testing.assert_allclose(relative_error(LOGITS, REFERENCE), expected, rtol=1e-9)


def test_summary_of_the_hand_made_batch():
    s = summarize(LOGITS, REFERENCE, GOLD, LABELS)
    assert s["corrupted_count"] == 4  # texts 2, 3, 4, 5
    assert s["corrupted_fraction"] == pytest.approx(4 / 6)
    assert s["first_corrupted_index"] == 2
    assert s["corrupted_contiguous_to_end"] is True  # 2..5 without a gap, up to the last text
    assert s["flips"] == 2  # texts 2 (positive -> neutral) and 4 (positive -> neutral)
    assert s["accuracy"] == pytest.approx(3 / 6)  # right: texts 0, 1, 3
    assert s["reference_accuracy"] == pytest.approx(5 / 6)  # wrong: text 5 only
    assert s["non_finite_count"] == 1
    assert s["max_relative_error"] == INF
    # corrupted texts 2..5: device [1, 1, 1, 0] -> negative 1, neutral 3; reference [2, 1, 2, 0]
    assert s["corrupted_class_counts"] == {
        "device": {"negative": 1, "neutral": 3, "positive": 0},
        "reference": {"negative": 1, "neutral": 1, "positive": 2},
    }
    assert s["collapse"] == {"class": "neutral", "device_share": 0.75, "reference_share": 0.25}  # 3/4, 1/4
    # right only on the device: none; right only in the reference: texts 2 and 4
    assert s["significance"]["mcnemar_discordant"] == {"device_only_right": 0, "reference_only_right": 2}
    assert s["significance"]["mcnemar_p"] == pytest.approx(0.5)  # two-sided binomial: 2 * 0.5**2


@pytest.mark.parametrize(
    ("corrupted_rows", "first", "to_end"),
    [
        ([2, 3], 2, False),  # contiguous but stops before the last text
        ([3, 5], 3, False),  # reaches the last text with a gap at 4
        ([5], 5, True),
        ([], None, False),
    ],
)
def test_corrupted_contiguous_to_end(corrupted_rows, first, to_end):
    logits = REFERENCE.copy()
    logits[corrupted_rows, 0] += 10.0  # error >= 10 / 4 = 2.5 on each of those rows
    s = summarize(logits, REFERENCE, GOLD, LABELS)
    assert s["corrupted_count"] == len(corrupted_rows)
    assert s["first_corrupted_index"] == first
    assert s["corrupted_contiguous_to_end"] is to_end


def test_a_clean_batch_has_no_collapse():
    s = summarize(REFERENCE.copy(), REFERENCE, GOLD, LABELS)
    assert (s["corrupted_count"], s["flips"], s["max_relative_error"]) == (0, 0, 0.0)
    assert s["collapse"] == {"class": None, "device_share": None, "reference_share": None}


def test_non_finite_logits_are_corrupted_at_any_threshold():
    logits = REFERENCE.copy()
    logits[1, 2] = np.nan
    logits[4, 0] = -INF
    s = summarize(logits, REFERENCE, GOLD, LABELS, threshold=1e30)
    assert s["corrupted_count"] == s["non_finite_count"] == 2
    assert s["first_corrupted_index"] == 1 and s["corrupted_contiguous_to_end"] is False


def test_threshold_is_strictly_greater():
    reference = np.array([[2.0, 0.0, 0.0]])
    logits = np.array([[2.5, 0.0, 0.0]])  # 0.5 / 2 = 0.25, exact in binary
    assert relative_error(logits, reference)[0] == 0.25
    gold = np.array([0])
    assert summarize(logits, reference, gold, LABELS, threshold=0.25)["corrupted_count"] == 0
    assert summarize(logits, reference, gold, LABELS, threshold=0.2499)["corrupted_count"] == 1
