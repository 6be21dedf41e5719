"""Free-form answers: normalisation, correctness against gold aliases, and meaning-equivalent clusters (pure functions).

Normalisation (SQuAD/TriviaQA style, extended): lower case; number words zero–twenty and the tens written as digits;
punctuation removed (a comma or dot inside a number is kept: "3.5", "1,000" → "1000"); the articles a, an, the
dropped; whitespace collapsed.

An answer is correct when some gold alias, normalised, appears in the normalised answer as a run of whole words
("The capital of France is Paris." matches "Paris"; "Parisian" does not). Chatty models answer in sentences, so exact
match would call most right answers wrong; the price is that an answer listing several candidates can match. An alias
the question already contains must occur in the answer more often than in the question (an echo of the question is
not an answer).

Two sampled answers mean the same when one's normalised words appear as a run inside the other's ("Paris" and
"It is Paris"): clusters are built greedily, shortest answers first, each answer joining the first cluster whose
representative it contains or is contained in.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                      "ninety": "90", "hundred": "100", "thousand": "1000"})
_ARTICLES = {"a", "an", "the"}
_PUNCT = re.compile(f"[{re.escape(string.punctuation)}‘’“”–—]")


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000
    text = re.sub(r"(?<=\d)\.(?=\d)", "\u2063", text)  # keep decimal points through the punctuation pass
    text = _PUNCT.sub(" ", text).replace("\u2063", ".")
    words = [_NUMBER_WORDS.get(w, w) for w in text.split()]
    return " ".join(w for w in words if w not in _ARTICLES)


def _contains(haystack: str, needle: str) -> bool:
    """Whether needle's words appear as a run of whole words in haystack (both normalised)."""
    if not needle:
        return False
    return f" {needle} " in f" {haystack} "


def _count(haystack: str, needle: str) -> int:
    return f" {haystack} ".count(f" {needle} ") if needle else 0


def is_correct(answer: str, aliases: Sequence[str], question: str | None = None) -> bool:
    """Some gold alias appears, normalised, as a run of whole words in the normalised answer. Given the question, an
    alias the question itself contains must appear in the answer more often than there: an answer that only repeats
    the question ("The capital of Muyinga Province is Kuala Lumpur" for gold "Muyinga") is not credited."""
    norm = normalize_answer(answer)
    asked = normalize_answer(question) if question else ""
    for alias in aliases:
        a = normalize_answer(alias)
        if _contains(norm, a) and _count(norm, a) > _count(asked, a):
            return True
    return False


@dataclass(frozen=True)
class Cluster:
    members: tuple[int, ...]  # indices of the answers in it
    representative: str  # normalised text of its shortest answer

    @property
    def size(self) -> int:
        return len(self.members)


def semantic_clusters(answers: Sequence[str]) -> list[Cluster]:
    """Meaning-equivalent groups of answers, largest first (ties: the one whose first member came first)."""
    norms = [normalize_answer(a) for a in answers]
    order = sorted(range(len(answers)), key=lambda i: (len(norms[i].split()), i))
    groups: list[tuple[str, list[int]]] = []
    for i in order:
        for rep, members in groups:
            if norms[i] == rep or _contains(norms[i], rep) or _contains(rep, norms[i]):
                members.append(i)
                break
        else:
            groups.append((norms[i], [i]))
    clusters = [Cluster(tuple(sorted(m)), rep) for rep, m in groups]
    return sorted(clusters, key=lambda c: (-c.size, c.members[0]))


def in_cluster(answer: str, cluster: Cluster) -> bool:
    norm = normalize_answer(answer)
    return norm == cluster.representative or _contains(norm, cluster.representative) or _contains(
        cluster.representative, norm)


@dataclass(frozen=True)
class SemanticChoice:
    """The answer semantic confidence returns: the largest cluster's most probable member, with the cluster's share."""

    clusters: list[Cluster]
    best: list[int]  # per cluster, the index of its most probable member
    n: int

    @property
    def answer(self) -> int:
        return self.best[0]

    @property
    def confidence(self) -> float:
        return self.clusters[0].size / self.n

    @property
    def entropy(self) -> float:
        shares = [c.size / self.n for c in self.clusters]
        return float(-sum(p * math.log(p) for p in shares))


def semantic_choice(answers: Sequence[str], probabilities: Sequence[float]) -> SemanticChoice:
    """Cluster n sampled answers by meaning; each cluster's representative answer is its most probable member
    (`probabilities`: each answer's own, e.g. its length-normalised sequence probability)."""
    if not answers:
        raise ValueError("semantic confidence needs at least one sampled answer")
    clusters = semantic_clusters(answers)
    best = [max(c.members, key=lambda i: probabilities[i]) for c in clusters]
    return SemanticChoice(clusters, best, len(answers))
