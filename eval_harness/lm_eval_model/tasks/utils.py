"""Datasets of the offline lm-eval tasks, built from the repository's own data (no downloads):
the capability questions (:func:`eval_harness.capability.task.capability_questions`) and the
held-out trait likelihood pairs (``eval_harness/trait_steering/trait_pairs.json``)."""

from __future__ import annotations

import json
from typing import Any

from datasets import Dataset

from eval_harness.capability.task import capability_questions
from eval_harness.trait_steering.task import EVAL_PATH

__all__ = ["capability", "trait_pairs"]


def capability(additions: int = 20, seed: int = 0, **_: Any) -> dict[str, Dataset]:
    """Seeded additions and the capitals: question, four choices, the right one's index."""
    rows = [{"kind": q["kind"], "question": q["question"], "choices": q["options"],
             "answer": q["answer"], "target": q["options"][q["answer"]]}
            for q in capability_questions(int(additions), int(seed))]
    return {"test": Dataset.from_list(rows)}


def trait_pairs(per_trait: int = 4, **_: Any) -> dict[str, Dataset]:
    """The first ``per_trait`` held-out pairs of each Big Five trait: choice 0 is the
    trait-high reply, choice 1 the trait-low one (accuracy = share where high is likelier)."""
    rows, counts = [], {}
    for item in json.loads(EVAL_PATH.read_text())["items"]:
        if counts.get(item["trait"], 0) < int(per_trait):
            counts[item["trait"]] = counts.get(item["trait"], 0) + 1
            rows.append({"trait": item["trait"], "question": item["question"],
                         "choices": [item["high"], item["low"]], "answer": 0})
    return {"test": Dataset.from_list(rows)}
