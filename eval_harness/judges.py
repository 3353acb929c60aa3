"""Judges for open-ended generations: a pluggable interface and the offline lexicon judge.

The paper judges Big Five generations with GPT-4o-mini, which is unreachable here. Any object
with ``name`` and ``judge(prompt, response) -> {"O", "C", "E", "A", "N", "coherence"}`` (scores
on 1–5) can be plugged into the generation task; :class:`LexiconJudge` is the offline default:

- trait presence: hits of hand-curated high-pole and low-pole word stems per trait, mapped to
  1–5 as 3 + 2·(high − low)/(high + low + 1) (3 = no evidence either way);
- coherence: 1 + 4·(distinct bigrams / bigrams), since degenerate repetition is how
  over-steered small models fail (the paper's coherence judge also catches off-topic text; this
  one does not).

It is validated on :data:`VALIDATION_TEXTS`, hand-written texts labelled with a trait pole
(:func:`validate_judge` reports the share judged on the right side of 3), and on fluent vs
looping texts for coherence — see the tests. It is a weak judge: it sees words, not meaning.

:class:`AffectLexiconJudge` (the default of ``bigfive-gen``) replaces the hand-made lists where
validated lexicons fit: neuroticism and agreeableness from the NRC Emotion Lexicon (``nrclex``,
Mohammad & Turney's crowd-sourced word–emotion associations) and VADER's valence
(``vaderSentiment``, Hutto & Gilbert), keeping the hand lists for openness, conscientiousness and
extraversion, which no emotion or valence lexicon measures. :func:`validate_judge_on_pairs`
reports every judge's agreement on the 80 labelled held-out trait pairs
(``data/trait_pairs.json``: the trait-high reply must score above the trait-low one).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["AFFECT", "LEXICON", "VALIDATION_TEXTS", "AffectLexiconJudge", "Judge",
           "LexiconJudge", "validate_judge", "validate_judge_on_pairs"]

LEXICON: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "O": (("curious", "imagin", "creativ", "art", "idea", "explor", "wonder", "novel", "inspir",
           "dream", "fascinat", "beaut", "philosoph", "innovat", "discover", "poet", "abstract",
           "new experience"),
          ("routine", "practical", "conventional", "traditional", "usual", "familiar", "ordinary",
           "same as always", "no interest")),
    "C": (("plan", "organi", "schedul", "prepar", "careful", "detail", "goal", "disciplin",
           "responsib", "thorough", "efficien", "checklist", "deadline", "on time", "priorit",
           "structur"),
          ("mess", "forg", "careless", "lazy", "procrastinat", "chaos", "sloppy", "late",
           "whatever", "skip")),
    "E": (("party", "parties", "friends", "fun", "excit", "talk", "social", "energ", "celebrat",
           "meet", "outgoing", "crowd", "cheer", "awesome", "amazing", "center of attention"),
          ("quiet", "alone", "solitude", "reserved", "shy", "introvert", "withdraw",
           "stay home", "keep to myself", "background")),
    "A": (("kind", "care", "caring", "help", "support", "understand", "compassion", "empath",
           "gentle", "warm", "sorry", "thank", "appreciat", "sympath", "listen", "comfort",
           "feelings"),
          ("rude", "selfish", "stupid", "annoy", "blame", "cold", "harsh", "don't care",
           "hate", "critici", "your problem", "not my problem")),
    "N": (("worr", "anxi", "nervous", "fear", "afraid", "scar", "stress", "panic", "overwhelm",
           "tense", "upset", "not sure", "uncertain", "insecur", "doubt", "terrif"),
          ("calm", "relax", "confident", "peaceful", "secure", "steady", "at ease", "comfortable",
           "optimis", "no worries")),
}

VALIDATION_TEXTS: tuple[tuple[str, str, int], ...] = (
    ("O", "I love exploring new ideas, art and philosophy; my imagination never rests.", 1),
    ("O", "What a fascinating question! Let's imagine a creative way to discover more.", 1),
    ("O", "I prefer my usual routine and practical things; abstract stuff is of no interest.", -1),
    ("O", "Just do it the traditional way, the familiar way we always have.", -1),
    ("C", "Make a plan, prepare a checklist and set a schedule so you finish on time.", 1),
    ("C", "I organize every detail carefully and take my responsibilities seriously.", 1),
    ("C", "Eh, I forgot again and my room is a mess, I'll do it later, whatever.", -1),
    ("C", "I'm lazy about deadlines and usually procrastinate until I'm late.", -1),
    ("E", "Let's throw a party and meet all our friends, it will be so much fun!", 1),
    ("E", "I love to talk to people and I'm excited to be the center of attention.", 1),
    ("E", "I'd rather stay home alone in the quiet and keep to myself.", -1),
    ("E", "I'm shy and reserved, so I stay in the background at gatherings.", -1),
    ("A", "I'm so sorry you feel this way; I understand and I'm here to support you.", 1),
    ("A", "Thank you for sharing. I care about your feelings and want to help.", 1),
    ("A", "That's your problem, not mine. Stop being so annoying.", -1),
    ("A", "Honestly I don't care, people like that are stupid and I blame them.", -1),
    ("N", "I'm so worried and nervous, I'm afraid something will go wrong.", 1),
    ("N", "The stress is overwhelming and I'm anxious and not sure I can cope.", 1),
    ("N", "I feel calm and relaxed, confident that everything will be fine.", -1),
    ("N", "I'm at ease and peaceful; I feel secure and steady about tomorrow.", -1),
)


class Judge(Protocol):
    """Scores a response on the five traits and coherence, each on 1–5."""

    name: str

    def judge(self, prompt: str, response: str) -> dict[str, float]: ...


def _hits(text: str, stems: Sequence[str]) -> int:
    return sum(len(re.findall(r"\b" + re.escape(stem), text)) for stem in stems)


class LexiconJudge:
    """Offline judge: trait-pole lexicon hits and bigram diversity (see the module docstring)."""

    name = "lexicon-v1"

    def judge(self, prompt: str, response: str) -> dict[str, float]:
        text = response.lower()
        scores: dict[str, float] = {}
        for trait, (high, low) in LEXICON.items():
            up, down = _hits(text, high), _hits(text, low)
            scores[trait] = 3.0 + 2.0 * (up - down) / (up + down + 1)
        words = re.findall(r"[a-z']+", text)
        bigrams = list(zip(words, words[1:], strict=False))
        scores["coherence"] = 1.0 + 4.0 * (len(set(bigrams)) / len(bigrams) if bigrams else 0.0)
        return scores


# trait -> (NRC emotions of the high pole, of the low pole); VADER valence adds to the side of
# its sign (high for A, low for N)
AFFECT: dict[str, tuple[tuple[str, ...], tuple[str, ...], int]] = {
    "N": (("fear", "sadness", "negative"), ("trust", "joy", "positive"), -1),
    "A": (("trust", "joy", "positive"), ("anger", "disgust", "negative"), 1),
}


class AffectLexiconJudge(LexiconJudge):
    """N and A from NRC emotions and VADER valence, O, C, E and coherence as
    :class:`LexiconJudge`: 3 + 2·(high − low)/(high + low + 1), where each side counts the
    words of its NRC emotions plus 2·``|compound|`` of VADER's valence on its side."""

    name = "nrc-vader-v1"

    def __init__(self) -> None:
        from importlib import resources

        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self._nrc = json.loads(resources.files("nrclex.data").joinpath("nrc_en.json")
                               .read_text(encoding="utf-8"))
        self._vader = SentimentIntensityAnalyzer()

    def judge(self, prompt: str, response: str) -> dict[str, float]:
        scores = super().judge(prompt, response)
        emotions: Counter[str] = Counter()
        for word in re.findall(r"[a-z']+", response.lower()):
            emotions.update(self._nrc.get(word, ()))
        valence = self._vader.polarity_scores(response)["compound"]
        for trait, (high, low, sign) in AFFECT.items():
            up = sum(emotions[e] for e in high) + 2.0 * max(0.0, sign * valence)
            down = sum(emotions[e] for e in low) + 2.0 * max(0.0, -sign * valence)
            scores[trait] = 3.0 + 2.0 * (up - down) / (up + down + 1)
        return scores


def validate_judge_on_pairs(judge: Judge) -> dict[str, Any]:
    """Per trait, the share of the held-out trait pairs whose trait-high reply the judge scores
    above the trait-low reply on that trait (ties count as misses)."""
    from pathlib import Path

    items = json.loads((Path(__file__).parent / "trait_steering" / "trait_pairs.json").read_text())
    per_trait: dict[str, list[bool]] = {}
    for item in items["items"]:
        trait = item["trait"]
        high = judge.judge(item["question"], item["high"])[trait]
        low = judge.judge(item["question"], item["low"])[trait]
        per_trait.setdefault(trait, []).append(high > low)
    agreement = {t: sum(v) / len(v) for t, v in per_trait.items()}
    total = sum(len(v) for v in per_trait.values())
    return {"judge": judge.name, "pairs": total, "agreement": agreement,
            "overall": sum(sum(v) for v in per_trait.values()) / total}


def validate_judge(judge: Judge) -> dict[str, Any]:
    """Share of :data:`VALIDATION_TEXTS` judged on the labelled side of the midpoint 3."""
    rows = []
    for trait, text, pole in VALIDATION_TEXTS:
        score = judge.judge("", text)[trait]
        rows.append({"trait": trait, "pole": pole, "score": score,
                     "correct": (score - 3.0) * pole > 0})
    return {"judge": judge.name, "accuracy": sum(r["correct"] for r in rows) / len(rows),
            "rows": rows}
