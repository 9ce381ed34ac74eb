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
