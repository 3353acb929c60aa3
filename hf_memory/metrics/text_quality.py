"""Generation quality beside a judge: how much a reply repeats itself.

Over-steered models fail by looping ("I'm so anxious, I am so anxious. I am so anxious, …");
these counts measure that from the words alone, with no model and no judge:

- :func:`distinct_n`: the share of a reply's word n-grams that are distinct (1 = no n-gram
  twice);
- :func:`repeated_ngram_fraction`: the share of a reply's word n-grams that already occurred
  earlier in the same reply (0 = no repetition);
- :func:`repetition`: both, averaged over replies (each reply weighs the same);
- :func:`lexicon_rate`: the share of the replies' words that belong to a persona's own
  vocabulary (a judge-free measure of how much of the persona the replies carry).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["distinct_n", "lexicon_rate", "repeated_ngram_fraction", "repetition", "words"]

_WORD = re.compile(r"\w+(?:['’]\w+)*")


def words(text: str) -> list[str]:
    """Lowercased word tokens: runs of letters, digits and ``_`` (``\\w``, any script), joined
    across inner apostrophes (``"I'm"`` → ``"i'm"``, ``"rock'n'roll"`` one word); all other
    punctuation and whitespace separate words and are dropped."""
    return _WORD.findall(text.lower())


def _ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    tokens = words(text)
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(text: str, n: int = 2) -> float:
    """Distinct word n-grams / word n-grams of ``text`` (its ``len(words) - n + 1`` overlapping
    n-grams). A reply with fewer than ``n`` words has no n-gram to repeat: 1.0."""
    grams = _ngrams(text, n)
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated_ngram_fraction(text: str, n: int = 4) -> float:
    """The share of ``text``'s overlapping word n-grams that occur at an earlier position of
    ``text`` too (the first occurrence of each n-gram is not counted, every later one is):
    ``"a b c d a b c d"`` has 5 4-grams, the last repeats the first: 1/5. So it equals
    ``1 - distinct_n(text, n)``; 0.0 for fewer than ``n`` words."""
    grams = _ngrams(text, n)
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def repetition(texts: Sequence[str]) -> dict[str, float]:
    """Mean distinct-2 (``distinct_2``) and mean repeated-4-gram fraction (``repeated_4gram``)
    over ``texts``, each reply weighing the same, and their number (``replies``).

    Raises:
        ValueError: ``texts`` is a single string, empty, or holds a non-string.
    """
    if isinstance(texts, str):
        raise ValueError("repetition takes a list of replies, not one string")
    texts = list(texts)
    if not texts:
        raise ValueError("repetition needs at least one reply, got none")
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise ValueError(f"replies must be strings; entry {bad[0]} is "
                         f"{type(texts[bad[0]]).__name__}")
    return {"distinct_2": sum(map(distinct_n, texts)) / len(texts),
            "repeated_4gram": sum(map(repeated_ngram_fraction, texts)) / len(texts),
            "replies": len(texts)}


def lexicon_rate(texts: Sequence[str], lexicon: Sequence[str]) -> float:
    """Words of ``texts`` that are in ``lexicon`` (lowercased words, matched whole; an entry
    ending in ``*`` matches every word it starts) / all their words; 0.0 without words.

    Raises:
        ValueError: ``texts`` is a single string or holds a non-string, or ``lexicon`` is
            empty.
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be a sequence of strings")
    entries = [e.lower() for e in lexicon if isinstance(e, str) and e.strip()]
    if not entries:
        raise ValueError("the lexicon is empty")
    exact = {e for e in entries if not e.endswith("*")}
    prefixes = tuple(e[:-1] for e in entries if e.endswith("*"))
    tokens = [w for t in texts for w in words(t)]
    hits = sum(w in exact or (bool(prefixes) and w.startswith(prefixes)) for w in tokens)
    return hits / len(tokens) if tokens else 0.0
