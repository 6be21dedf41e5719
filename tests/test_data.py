"""Loaders on the real benchmark files, prompt building, and the errors for bad data."""

from __future__ import annotations

import json

import pytest

from calm_core.data import (
    DATASET_FILES, MC_DATASETS, load_mc, load_mc_file, load_open, normalize_text,
)
from calm_core.errors import DataError
from calm_core.prompts import letter_user_message, option_letters

EXPECTED_ROWS = {
    ("mmlu", "dev"): 285, ("mmlu", "val"): 1531, ("arc_challenge", "dev"): 299, ("arc_easy", "dev"): 570,
    ("openbookqa", "test"): 500, ("commonsenseqa", "dev"): 1221, ("medmcqa", "dev"): 2816,
}


@pytest.mark.parametrize("dataset, split", sorted(EXPECTED_ROWS))
def test_real_mc_sets_load_with_documented_sizes(shared_data, dataset, split):
    qs = load_mc(dataset, split, root=shared_data)
    assert len(qs) == EXPECTED_ROWS[(dataset, split)]
    assert all(2 <= q.n_options <= 13 and 0 <= q.answer < q.n_options for q in qs)
    assert len({q.id for q in qs}) == len(qs)


def test_open_ended_sets_load(shared_data):
    trivia = load_open("triviaqa", root=shared_data)
    assert len(trivia) == 3000 and all(t.answer in t.answers for t in trivia)
    popqa = load_open("popqa", "test", root=shared_data)
    assert len(popqa) == 1000 and "s_pop" in popqa[0].extra


def test_every_declared_file_exists(shared_data):
    for name, splits in DATASET_FILES.items():
        for rel in splits.values():
            assert (shared_data / rel).is_file(), rel


def test_unknown_dataset_and_split_are_named():
    with pytest.raises(DataError, match="unknown dataset 'arc_medium'"):
        load_mc("arc_medium")
    with pytest.raises(DataError, match="has no split 'train'"):
        load_mc("arc_easy", "train")
    with pytest.raises(DataError, match="open-ended"):
        load_mc("triviaqa")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*arc_easy_test.jsonl"):
        load_mc("arc_easy", "test", root=tmp_path)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"id": "x", "dataset": "d", "question": "q", "choices": ["a", "b"]}), "missing field 'answer'"),
        (json.dumps({"id": "x", "dataset": "d", "question": "q", "choices": ["a", "b"], "answer": 2}), "out of range"),
        (json.dumps({"id": "x", "dataset": "d", "question": "q", "choices": ["a"], "answer": 0}), "1 choices"),
        (json.dumps({"id": "x", "dataset": "d", "question": "q", "choices": "ab", "answer": 0}), "must be list"),
    ],
)
def test_malformed_line_names_file_and_line(shared_data, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = (shared_data / "arc_easy/arc_easy_dev.jsonl").read_text().splitlines()[:2]
    path.write_text("\n".join(good + [line]) + "\n")
    with pytest.raises(DataError, match=f"bad.jsonl:3: .*{message}"):
        load_mc_file(path)


@pytest.mark.parametrize("n", [2, 4, 5, 13])
def test_letter_prompt_lists_every_option(n):
    text = letter_user_message("Which?", [f"option {i}" for i in range(n)])
    letters = option_letters(n)
    for i, letter in enumerate(letters):
        assert f"\n{letter}. option {i}" in text
    assert f"({', '.join(letters)})" in text


@pytest.mark.parametrize("n", [1, 14])
def test_unsupported_option_counts_are_refused(n):
    with pytest.raises(ValueError, match="between 2 and 13 options"):
        option_letters(n)


def test_normalize_text():
    assert normalize_text("  What's  the   Answer?\n") == normalize_text("what s the answer")


def test_bundled_subset_is_real_rows_with_licenses(shared_data):
    """The subset shipped in the package (for fresh machines) is unchanged rows of the real sets, licensed."""
    from calm_core.data import default_split
    from calm_core.paths import BUNDLED_DATA_DIR

    for name in MC_DATASETS:
        split = default_split(name)
        bundled = load_mc(name, split, root=BUNDLED_DATA_DIR)
        full = {q.id: q for q in load_mc(name, split, root=shared_data)}
        assert len(bundled) == 100 and all(full[q.id] == q for q in bundled)
        folder = BUNDLED_DATA_DIR / DATASET_FILES[name][split]
        assert list(folder.parent.glob("LICENSE*")), f"no license file shipped for {name}"
