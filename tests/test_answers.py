"""Free-form answer normalisation, alias matching and semantic clusters, on tricky cases."""

from __future__ import annotations

import numpy as np
import pytest

from calm_core.answers import (AGREEMENT_WORDS, agreement, cluster_entropy, is_correct, new_words, normalize_answer,
                               semantic_clusters)


@pytest.mark.parametrize("text, norm", [
    ("The Beatles!", "beatles"),
    ("  An   apple, a day ", "apple day"),
    ("Twenty-one", "20 1"),  # hyphenated number words split into words: "twenty one"
    ("Seven", "7"),
    ("It costs $3.50.", "it costs 3.50"),
    ("1,000 people", "1000 people"),
    ("“Hamlet” — Shakespeare’s play", "hamlet shakespeare s play"),
    ("U.S.A.", "u s"),
])
def test_normalize_answer(text, norm):
    assert normalize_answer(text) == norm


@pytest.mark.parametrize("answer, aliases, correct", [
    ("The capital of France is Paris.", ["Paris"], True),
    ("Parisian food", ["Paris"], False),  # whole words only
    ("There are seven days in a week.", ["7"], True),  # number words as digits
    ("7 days", ["seven"], True),
    ("The Beatles", ["Beatles", "The Fab Four"], True),
    ("the fab four", ["The Fab Four"], True),
    ("London", ["Paris", "City of Light"], False),
    ("", ["Paris"], False),
    ("Paris", [""], False),  # an empty alias matches nothing
])
def test_is_correct(answer, aliases, correct):
    assert is_correct(answer, aliases) is correct


def test_agreement_reads_what_the_answers_add_to_the_prompt():
    prompt = "Who was the director of How I Spent My Summer Vacation?"
    # Both echo the question and name different people: whole-text overlap would call them close; they disagree.
    assert agreement("The director of How I Spent My Summer Vacation was John Fisher.",
                     "The director of How I Spent My Summer Vacation is Theo Jones.", prompt) == 0.0
    assert agreement("The director was John Fisher.", "John Fisher directed it", prompt) == pytest.approx(0.8)
    assert agreement("Paris", "It is Paris.", "What is the capital of France?") == 1.0
    assert agreement("The capital of France is Paris.", "Paris", "What is the capital of France?") == 1.0
    assert agreement("Twenty", "20", "") == 1.0  # normalised
    assert agreement("It is.", "Paris", "") == 0.0  # an answer that says nothing new agrees with nothing
    assert new_words("word " * 100, "") == ["word"] * AGREEMENT_WORDS  # only the start is read


def test_semantic_clusters_group_answers_that_say_the_same():
    answers = ["Paris", "It is Paris.", "London", "paris", "The answer is London", "Rome"]
    clusters = semantic_clusters(answers, "Which city?")
    assert [c.members for c in clusters] == [(0, 1, 3), (2, 4), (5,)]
    assert [c.size for c in clusters] == [3, 2, 1] and clusters[0].representative == 0
    assert cluster_entropy(clusters) == pytest.approx(-(3 / 6) * np.log(3 / 6) - (2 / 6) * np.log(2 / 6) - (1 / 6) * np.log(1 / 6))
    assert semantic_clusters([]) == [] and cluster_entropy([]) == 0.0
