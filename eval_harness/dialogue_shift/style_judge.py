"""An offline judge of the six dialogue styles, for the generation form of ``dialogue-shift``.

The paper scores post-shift replies with GPT-4o-mini; that judge is unreachable here. Any object
with ``name`` and ``score(style, text) -> float`` can be plugged in; :class:`StyleJudge` is the
offline default. Each style's evidence is counted in words, from validated lexicons where they
fit and from documented cue lists where none exists:

- **warm**: NRC trust / joy / positive words (``nrclex``) + 2 × VADER's positive valence;
- **anxious**: NRC fear / sadness words + worry cues ("worried", "not sure", "hope", "...");
- **cautious**: hedges and risk cues ("maybe", "might", "probably", "check", "risk", "careful");
- **formal**: words of three or more syllables-worth (≥ 8 letters) + polite formulae ("I would
  recommend", "I suggest", "please"), minus contractions;
- **assertive**: sentences opening with a verb in the imperative (the first word is not a
  pronoun, article, interjection or hedge) + directive cues ("today", "now", "stop", "must");
- **dismissive**: minimisers ("just", "fine", "no big deal", "whatever", "move on", "honestly").

A style's score is 3 + 2·(e − ē)/(e + ē + 1) against its pair partner's evidence ē (1–5, 3 = no
evidence either way), so a transition old → new is judged by score(new) − score(old).
:func:`validate_style_judge` reports its agreement on the case bank's labelled style pairs (the
new-style reply must be judged more new-style than the same content in the old style). It sees
words, not meaning: a weak judge, reported as such.

A user's styles (``--styles``) have no lexicons: :class:`FittedStyleJudge` fits a reply judge
(:class:`~hf_memory.metrics.reply_judge.ReplyJudge`) per pair on its calibration items, and a
style's score is the judge's probability that the reply is on that style's side (0–1), so a
transition is judged by score(new) − score(old) in [−1, 1].
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import cached_property
from importlib import resources
from typing import Any

from .cases import STYLES, style_pairs

__all__ = ["FittedStyleJudge", "StyleJudge", "validate_style_judge"]

PARTNER = {"warm": "assertive", "assertive": "warm", "formal": "cautious",
           "cautious": "formal", "dismissive": "anxious", "anxious": "dismissive"}
CUES = {
    "anxious": ("worried", "worry", "worries", "nervous", "afraid", "scared", "not sure",
                "i hope", "hopefully", "oh no", "what if", "i'm not sure", "..."),
    "cautious": ("maybe", "might", "probably", "perhaps", "could", "check", "double-check",
                 "risk", "careful", "first", "just in case", "though", "i think", "unless",
                 "hold off", "before you"),
    "formal": ("i would recommend", "i suggest", "i would suggest", "please", "therefore",
               "additionally", "it would be", "you may wish", "i recommend", "advisable"),
    "assertive": ("today", "now", "stop", "must", "do it", "right away", "immediately",
                  "tonight", "don't wait", "commit", "decide"),
    "dismissive": ("just", "fine", "no big deal", "whatever", "move on", "honestly",
                   "not a big deal", "relax", "don't overthink", "happens", "so what",
                   "who cares", "it's nothing", "done"),
}
NOT_IMPERATIVE = frozenset(
    "i you we he she it they this that these those the a an my your our their oh honestly "
    "maybe perhaps probably it's that's i'm you're there there's well so yes no if when "
    "what how why one some".split())


class StyleJudge:
    """Offline style judge (see the module docstring)."""

    name = "style-lexicon-v1"

    @cached_property
    def _nrc(self) -> dict[str, list[str]]:
        return json.loads(resources.files("nrclex.data").joinpath("nrc_en.json")
                          .read_text(encoding="utf-8"))

    @cached_property
    def _vader(self):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        return SentimentIntensityAnalyzer()

    def evidence(self, text: str) -> dict[str, float]:
        """Evidence per style (counts, see the module docstring)."""
        lower = text.lower()
        words = re.findall(r"[a-z']+", lower)
        emotions: Counter[str] = Counter()
        for word in words:
            emotions.update(self._nrc.get(word, ()))
        valence = self._vader.polarity_scores(text)["compound"]
        cues = {style: sum(len(re.findall(r"(?<![a-z'])" + re.escape(cue) + r"(?![a-z'])",
                                          lower)) if cue[0].isalpha() else lower.count(cue)
                           for cue in cues)
                for style, cues in CUES.items()}
        sentences = [s.strip() for s in re.split(r"[.!?]+\s*", lower) if s.strip()]
        imperative = sum(1 for s in sentences
                         if (first := re.match(r"[a-z']+", s)) and first.group()
                         not in NOT_IMPERATIVE and not first.group().endswith("ly"))
        contractions = sum(1 for w in words if "'" in w)
        return {
            "warm": emotions["trust"] + emotions["joy"] + emotions["positive"]
            + 2.0 * max(0.0, valence),
            "anxious": emotions["fear"] + emotions["sadness"] + cues["anxious"],
            "cautious": float(cues["cautious"]),
            "formal": max(0.0, sum(len(w) >= 8 for w in words) + 2.0 * cues["formal"]
                          - contractions),
            "assertive": imperative + cues["assertive"],
            "dismissive": float(cues["dismissive"]),
        }

    def score(self, style: str, text: str) -> float:
        """1–5: evidence for ``style`` against its pair partner's."""
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r}; known: {', '.join(STYLES)}")
        evidence = self.evidence(text)
        mine, theirs = evidence[style], evidence[PARTNER[style]]
        return 3.0 + 2.0 * (mine - theirs) / (mine + theirs + 1.0)


def validate_style_judge(judge) -> dict[str, Any]:
    """Per style pair and overall: the share of the case bank's labelled reply pairs (every
    turn of every branch, and the calibration items) where the judge scores each style's reply
    higher on that style than the other style's reply (ties count as misses)."""
    per_pair = {}
    for pair in style_pairs():
        a, b = pair["pair"]
        items = [turn for root in pair["roots"] for turns in root["branches"].values()
                 for turn in turns] + pair["calibration"]
        right = sum(judge.score(a, i[a]) > judge.score(a, i[b]) for i in items)
        right += sum(judge.score(b, i[b]) > judge.score(b, i[a]) for i in items)
        per_pair[f"{a}/{b}"] = {"agreement": right / (2 * len(items)), "pairs": 2 * len(items)}
    total = sum(v["pairs"] for v in per_pair.values())
    return {"judge": judge.name, "styles": per_pair,
            "overall": sum(v["agreement"] * v["pairs"] for v in per_pair.values()) / total}


class FittedStyleJudge:
    """A user's styles judged by a reply judge fitted per pair on the pair's calibration items
    (the first style's replies against the second's); a style's score is the mean, over the pairs
    holding it, of the probability that the reply is on its side. A pair whose judge is under
    0.8 held-out accuracy is refused at construction, naming the pair (its generations could not
    be told apart)."""

    name = "reply-judge-per-pair"

    def __init__(self, book: dict[str, Any]) -> None:
        from hf_memory.metrics.reply_judge import JudgeTooWeakError, ReplyJudge

        self.judges, self.record = {}, {}
        self._last: tuple[str | None, dict] = (None, {})
        for pair in book["pairs"]:
            a, b = pair["pair"]
            triples = [(i["question"], i[a], i[b]) for i in pair["calibration"]]
            try:
                judge = ReplyJudge.fit(triples)
            except JudgeTooWeakError as error:
                raise ValueError(f"the styles {a}/{b}: {error}; their generations cannot be "
                                 "judged (add calibration items, or run without --generate)"
                                 ) from None
            self.judges[a, b] = judge
            self.record[f"{a}/{b}"] = {"agreement": judge.held_out_accuracy,
                                       "pairs": 2 * len(triples), **judge.as_dict()}

    def score(self, style: str, text: str) -> float:
        """0–1: how far ``text`` is on ``style``'s side of its pairs."""
        sides = [((first, second), first == style) for first, second in self.judges
                 if style in (first, second)]
        if not sides:
            raise ValueError(f"unknown style {style!r}")
        # score(new) and score(old) of one reply: each pair's judge runs once; read into a
        # local first, so a thread sharing the judge never mixes two replies' scores
        last = self._last
        if last[0] != text:
            last = (text, {})
        for pair, _ in sides:
            if pair not in last[1]:
                last[1][pair] = self.judges[pair].score([text])[0]
        self._last = last
        probabilities = [last[1][pair] for pair, _ in sides]
        return sum(p if first else 1.0 - p
                   for p, (_, first) in zip(probabilities, sides, strict=True)) / len(sides)

    def validation(self) -> dict[str, Any]:
        """Each pair's judge: held-out accuracy over folds (``agreement``), as the shipped
        judge's validation reports its agreement."""
        total = sum(v["pairs"] for v in self.record.values())
        return {"judge": self.name, "styles": self.record,
                "overall": sum(v["agreement"] * v["pairs"] for v in self.record.values()) / total}
