"""Free-form answer normalisation, alias matching and semantic clusters, on tricky cases."""

from __future__ import annotations

import numpy as np
import pytest

from calm_core.answers import in_cluster, is_correct, normalize_answer, semantic_choice, semantic_clusters


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


def test_semantic_clusters_group_answers_that_say_the_same():
    answers = ["Paris", "It is Paris.", "London", "paris", "The answer is London", "Rome"]
    clusters = semantic_clusters(answers)
    assert [c.members for c in clusters] == [(0, 1, 3), (2, 4), (5,)]
    assert [c.size for c in clusters] == [3, 2, 1] and clusters[0].representative == "paris"
    assert in_cluster("Definitely Paris", clusters[0]) and not in_cluster("Rome", clusters[0])
    assert semantic_clusters([]) == []


def test_semantic_choice_answers_the_largest_clusters_most_probable_member():
    answers = ["Paris", "It is Paris.", "Lyon", "paris", "Marseille", "The answer is Paris"]
    probs = [0.5, 0.9, 0.99, 0.4, 0.3, 0.2]
    choice = semantic_choice(answers, probs)
    assert [c.size for c in choice.clusters] == [4, 1, 1]
    assert choice.answer == 1  # the most probable member of the Paris cluster, not the most probable answer overall
    assert choice.confidence == pytest.approx(4 / 6)
    assert choice.entropy == pytest.approx(-(4 / 6) * np.log(4 / 6) - 2 * (1 / 6) * np.log(1 / 6))
    assert semantic_choice(["x"], [0.1]).confidence == 1.0
    with pytest.raises(ValueError):
        semantic_choice([], [])


@pytest.mark.parametrize("answer, aliases, question, correct", [
    ("The capital of Muyinga Province is Kuala Lumpur.", ["Muyinga"], "What is the capital of Muyinga Province?", False),
    ("The capital of Muyinga Province is Muyinga.", ["Muyinga"], "What is the capital of Muyinga Province?", True),
    ("The capital of Utah is Salt Lake City.", ["Salt Lake City"], "What is the capital of Utah?", True),
    ("Salt Lake City", ["Salt Lake City"], None, True),
])
def test_an_echo_of_the_question_is_not_an_answer(answer, aliases, question, correct):
    assert is_correct(answer, aliases, question) is correct
