"""Datasets of the offline lm-eval tasks, built from the repository's own data (no downloads):
the capability questions (:func:`eval_harness.capability.task.capability_questions`), the
held-out trait likelihood pairs (``eval_harness/trait_steering/trait_pairs.json``) and the
persona A/B sets (``eval_harness/persona_ab/data``)."""

from __future__ import annotations

import json
from itertools import chain, zip_longest
from typing import Any

from datasets import Dataset

from eval_harness.capability.task import capability_questions
from eval_harness.directions import EVAL_PATH

__all__ = ["capability", "persona_ab", "trait_pairs"]


def _round_robin(groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row of each group in turn, so that lm-eval's ``--limit`` keeps every kind."""
    return [row for row in chain.from_iterable(zip_longest(*groups)) if row is not None]


def capability(additions: int = 30, seed: int = 0, **_: Any) -> dict[str, Dataset]:
    """Seeded additions and the 30 capitals, alternating: question, four choices, the right
    one's index and text."""
    rows = [{"kind": q["kind"], "question": q["question"], "choices": q["options"],
             "answer": q["answer"], "target": q["options"][q["answer"]]}
            for q in capability_questions(int(additions), int(seed))]
    return {"test": Dataset.from_list(_round_robin([[r for r in rows if r["kind"] == kind]
                                                    for kind in ("arithmetic", "factual")]))}


def trait_pairs(per_trait: int = 4, **_: Any) -> dict[str, Dataset]:
    """The first ``per_trait`` held-out pairs of each Big Five trait, the traits in turn:
    choice 0 is the trait-high reply, choice 1 the trait-low one (accuracy = share where the
    high reply is the likelier)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for item in json.loads(EVAL_PATH.read_text())["items"]:
        group = groups.setdefault(item["trait"], [])
        if len(group) < int(per_trait):
            group.append({"trait": item["trait"], "question": item["question"],
                          "choices": [item["high"], item["low"]], "answer": 0})
    return {"test": Dataset.from_list(_round_robin(list(groups.values())))}


def persona_ab(persona_set: str = "agreeableness", **_: Any) -> dict[str, Dataset]:
    """Every item of the persona A/B set ``persona_set`` in the shipped order: the prompt, the
    choices ``["(A)", "(B)"]`` and the index of the persona's (positive) answer (accuracy =
    steering-bench's ``mcq_acc``: share where the positive answer is the likelier)."""
    from eval_harness.persona_ab.task import ANSWERS, load_persona_set

    return {"test": Dataset.from_list([
        {"set": persona_set, "prompt": item["prompt"], "choices": list(ANSWERS),
         "answer": ANSWERS.index(item["positive"])}
        for item in load_persona_set(str(persona_set))])}
