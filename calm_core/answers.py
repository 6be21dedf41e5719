"""Free-form answers: normalisation, correctness against gold aliases, and meaning-equivalent clusters (pure functions).

Normalisation (SQuAD/TriviaQA style, extended): lower case; number words zero–twenty and the tens written as digits;
punctuation removed (a comma or dot inside a number is kept: "3.5", "1,000" → "1000"); the articles a, an, the
dropped; whitespace collapsed.

An answer is correct when some gold alias, normalised, appears in the normalised answer as a run of whole words
("The capital of France is Paris." matches "Paris"; "Parisian" does not). Chatty models answer in sentences, so exact
match would call most right answers wrong; the price is that an answer listing several candidates can match. An alias
the question already contains must occur in the answer more often than in the question (an echo of the question is
not an answer).

Two answers to the same prompt say the same as far as their *new* words agree (`agreement`: the F1 of the normalised
words of each answer's start that are neither filler nor already in the prompt). A model that answers in sentences
repeats the question ("The director of X was ..."), and whole-text matching would call two answers naming different
people the same, or the same person in two sentences different.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

# A free-form answer judged against aliases is the greedy answer cut at this many tokens (offline evaluation, labels
# uploaded to the gateway): the base model answers in sentences; the entity comes early or not at all.
ANSWER_TOKENS = 48

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


AGREEMENT_WORDS = 24  # an answer's first words: the entity comes early or not at all, and samples stop at other points
_FILLER = {"is", "was", "are", "were", "be", "been", "of", "in", "on", "at", "to", "by", "for", "and", "or", "as", "it",
           "its", "this", "that", "which", "who", "what", "his", "her", "their", "he", "she", "they", "i"}


def new_words(text: str, context: str = "") -> list[str]:
    """The normalised words of an answer's start that carry information: not filler, not already in the context (the
    prompt). "The capital of France is Paris." to "What is the capital of France?" is just ["paris"]."""
    return _new_words(text, _known(context))


def _known(context: str) -> frozenset[str]:
    return frozenset(normalize_answer(context).split())


def _new_words(text: str, known: frozenset[str]) -> list[str]:
    words = normalize_answer(text).split()[:AGREEMENT_WORDS]
    return [w for w in words if w not in _FILLER and w not in known]


class AgreementReader:
    """Agreement between answers to one prompt, reading the prompt and each answer once (a request compares its
    answers with every sample, and the samples with each other to cluster them)."""

    def __init__(self, context: str = ""):
        self.known = _known(context)

    def words(self, text: str) -> Counter:
        return Counter(_new_words(text, self.known))

    @staticmethod
    def f1(wa: Counter, wb: Counter) -> float:
        common = sum((wa & wb).values())
        if common == 0:
            return 0.0
        precision, recall = common / sum(wb.values()), common / sum(wa.values())
        return 2 * precision * recall / (precision + recall)


def agreement(a: str, b: str, context: str = "") -> float:
    """How much two answers to the same prompt say the same: the F1 of their new words (SQuAD's word overlap, with
    what the prompt already said removed, so echoing the question is not agreeing). 1.0: the same information; 0.0:
    nothing in common, or one says nothing new."""
    reader = AgreementReader(context)
    return reader.f1(reader.words(a), reader.words(b))


@dataclass(frozen=True)
class Cluster:
    members: tuple[int, ...]  # indices of the answers in it
    representative: int  # index of the answer the others were compared with (its first member)

    @property
    def size(self) -> int:
        return len(self.members)


def semantic_clusters(answers: Sequence[str], context: str = "", threshold: float = 0.5,
                      words: Sequence[Counter] | None = None) -> list[Cluster]:
    """Groups of answers that say the same (agreement ≥ threshold with the group's first answer), largest first (ties:
    the group whose first member came first). `words`: the answers' `AgreementReader.words`, when already read."""
    if words is None:
        reader = AgreementReader(context)
        words = [reader.words(a) for a in answers]
    groups: list[list[int]] = []
    for i in range(len(answers)):
        for members in groups:
            if AgreementReader.f1(words[members[0]], words[i]) >= threshold:
                members.append(i)
                break
        else:
            groups.append([i])
    clusters = [Cluster(tuple(m), m[0]) for m in groups]
    return sorted(clusters, key=lambda c: (-c.size, c.members[0]))


def cluster_entropy(clusters: Sequence[Cluster]) -> float:
    n = sum(c.size for c in clusters)
    return float(-sum(c.size / n * math.log(c.size / n) for c in clusters)) if n else 0.0
