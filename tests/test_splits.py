"""Domain split configs: every shipped config validates, roles don't overlap, no test question leaks."""

from __future__ import annotations

from pathlib import Path

import pytest

from calm_core.data import normalize_text
from calm_core.errors import ConfigError
from calm_core.splits import ROLES, SourceSpec, load_split, materialize, select

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "splits").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_split_configs_materialize_without_leakage(path, shared_data):
    m = materialize(load_split(path), root=shared_data)
    for role in ROLES:
        assert m.role(role), role
    ids = {role: {q.id for q in m.role(role)} for role in ROLES}
    for i, a in enumerate(ROLES):
        for b in ROLES[i + 1 :]:
            assert not ids[a] & ids[b], (a, b)
    test_texts = {normalize_text(q.question) for r in ("test_in_domain", "test_out_of_domain") for q in m.role(r)}
    for role in ("train", "calibration"):
        assert not any(normalize_text(q.question) in test_texts for q in m.role(role))


def test_science_split_is_what_it_says(shared_data):
    m = materialize(load_split(CONFIGS[[p.name for p in CONFIGS].index("science.toml")]), root=shared_data)
    assert {q.dataset for q in m.role("train")} == {"arc_easy", "arc_challenge", "openbookqa"}
    ood = m.sources["test_out_of_domain"]
    assert {q.category for q in ood["mmlu[humanities+social_sciences]"]} == {"humanities", "social_sciences"}
    assert len(ood["commonsenseqa"]) == 300
    # openbookqa feeds three roles from one file through disjoint fractions: 200 + 100 + 200 of 500.
    assert len(m.sources["train"]["openbookqa"]) + m.dropped["train"] >= 190


def test_fractions_of_one_file_partition_it(shared_data):
    parts = [select(SourceSpec(dataset="arc_easy", split="dev", fraction=f), 3, shared_data)
             for f in [(0.0, 0.3), (0.3, 0.8), (0.8, 1.0)]]
    ids = [q.id for part in parts for q in part]
    assert len(ids) == len(set(ids)) == 570


def test_leaking_config_is_cleaned(tmp_path, shared_data):
    cfg = tmp_path / "leak.toml"
    cfg.write_text("""
name = "leak"
[[train]]
dataset = "mmlu"
split = "val"
[[calibration]]
dataset = "arc_easy"
split = "dev"
[[test_in_domain]]
dataset = "mmlu"
split = "test"
[[test_out_of_domain]]
dataset = "commonsenseqa"
split = "dev"
limit = 10
""")
    m = materialize(load_split(cfg), root=shared_data)
    assert m.dropped["train"] >= 39  # MMLU val questions that reappear in test (data README)


@pytest.mark.parametrize(
    "body, message",
    [
        ('name = "x"\n[[train]]\ndataset = "nope"\nsplit = "dev"', "unknown dataset 'nope'"),
        ('name = "x"\ntrain = []\ncalibration = []\ntest_in_domain = []\ntest_out_of_domain = []', "at least one source"),
        ('name = "x"\n[[train]]\ndataset = "arc_easy"\nsplit = "dev"\nfraction = [0.5, 0.2]', "fraction"),
        ('name = "x" = y', "invalid TOML"),
    ],
)
def test_invalid_configs_are_named(tmp_path, body, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_split(cfg)
