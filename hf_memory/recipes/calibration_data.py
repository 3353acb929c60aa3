"""Calibration data shipped with the package, disjoint from every evaluation item.

``data/calibration_pairs.json``: per Big Five trait, contrast pairs (a user question, a
trait-high reply, a trait-low reply) and open calibration prompts; ``data/neutral_texts.json``:
personality-free sentences for control banks. Written for this project (see each file's
``source``).
"""

from __future__ import annotations

from typing import Any

from hf_memory.data import load_json

__all__ = ["DEFAULT_PROMPTS", "TRAIT_DESCRIPTORS", "calibration_pairs", "calibration_prompts",
           "direction_parts", "everyday_questions"]

DEFAULT_PROMPTS = (  # the demo's questions (hf-memory demo); nothing calibrates on them
    "How do you feel about your exam tomorrow?",
    "What are your plans for the weekend?",
    "Can you recommend a good book?",
    "What did you have for breakfast?",
)

FACTORS = ("O", "C", "E", "A", "N")
TRAIT_DESCRIPTORS = {
    "O": ("I am extremely open to experience: curious, imaginative and creative, and I love "
          "abstract ideas, art and new experiences.",
          "I am very closed to experience: conventional and practical, with little imagination "
          "and no interest in abstract ideas or art."),
    "C": ("I am extremely conscientious: organized, disciplined, always prepared and careful "
          "with details, and I finish my duties on time.",
          "I am very careless and disorganized: I leave things messy, forget my duties and "
          "never plan ahead."),
    "E": ("I am extremely extraverted: outgoing, talkative and energetic, and I love parties "
          "and being the center of attention.",
          "I am very introverted: quiet and reserved, and I avoid parties and keep in the "
          "background."),
    "A": ("I am extremely agreeable: warm, kind and compassionate, and I care deeply about "
          "other people's feelings.",
          "I am very disagreeable: cold and critical, and I don't care about other people's "
          "problems or feelings."),
    "N": ("I am extremely anxious. I worry constantly, feel nervous and tense, and always "
          "fear that something will go wrong.",
          "I am completely calm. I feel relaxed, secure and at ease, and I never worry about "
          "anything."),
}


def direction_parts(direction: str) -> tuple[str, int, str, str]:
    """``"N+"`` → (trait, sign, target descriptor, reference descriptor)."""
    if (not isinstance(direction, str) or len(direction) != 2 or direction[0] not in FACTORS
            or direction[1] not in "+-"):
        raise ValueError(f"a direction is a Big Five trait letter ({', '.join(FACTORS)}) and + "
                         f"or -, e.g. 'N+'; got {direction!r}")
    high, low = TRAIT_DESCRIPTORS[direction[0]]
    sign = 1 if direction[1] == "+" else -1
    return (direction[0], sign, *((high, low) if sign > 0 else (low, high)))


def oriented(item: dict[str, Any], sign: int) -> tuple[str, str, str]:
    """(prompt, target reply, reference reply) for steering towards (+1) or away (-1)."""
    return ((item["question"], item["high"], item["low"]) if sign > 0
            else (item["question"], item["low"], item["high"]))


def calibration_pairs(direction: str, count: int = 24, drift_count: int = 2
                      ) -> tuple[list[tuple[str, str, str]], dict[str, list]]:
    """Target pairs of ``direction`` (answers and statements alternating, ``count`` of them) and
    ``drift_count`` pairs per other trait, for
    :meth:`~hf_memory.selection.selector.Selector.calibrate_behavioural`.
    """
    trait, sign, _, _ = direction_parts(direction)
    items = load_json("calibration_pairs.json")["items"]

    def alternating(name: str) -> list[dict[str, Any]]:
        mine = [i for i in items if i["trait"] == name]
        answers = [i for i in mine if i["kind"] == "answer"]
        statements = [i for i in mine if i["kind"] == "statement"]
        return [x for pair in zip(answers, statements, strict=False) for x in pair]

    mixed = alternating(trait)
    if not 1 <= count <= len(mixed):
        raise ValueError(f"count must be between 1 and {len(mixed)}, got {count}")
    if not 1 <= drift_count <= len(mixed):
        raise ValueError(f"drift_count must be between 1 and {len(mixed)}, got {drift_count}")
    drift = {t: [oriented(i, 1) for i in alternating(t)[:drift_count]]
             for t in FACTORS if t != trait}
    return [oriented(i, sign) for i in mixed[:count]], drift


def calibration_prompts() -> list[str]:
    """Open everyday questions for the diagnostic selector's calibration."""
    return list(load_json("calibration_pairs.json")["prompts"])


def everyday_questions() -> list[str]:
    """Every distinct question of the calibration data: the open prompts, then the questions of
    the trait items (what starter pairs for a user's own persona are asked on)."""
    data = load_json("calibration_pairs.json")
    questions = list(data["prompts"]) + [item["question"] for item in data["items"]]
    return list(dict.fromkeys(questions))
