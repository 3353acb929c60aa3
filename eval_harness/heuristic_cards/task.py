"""Heuristic-card banks for structured reasoning (the paper's HARDMath / PHYSICS tasks, D.4–D.5),
kept for users' models and data: the 135M embedded model cannot solve either benchmark, so this
module is a harness, not a measured result.

- :data:`CARDS`: a process-only card per HARDMath category and PHYSICS subject (trigger, action,
  check), written for this package (no problem text, no answers);
- :func:`load_problems`: problems from a local JSON / JSONL file or a Hub dataset, with the field
  names the user's copy uses;
- :class:`BoxedAnswerGrader`: the last ``\\boxed{…}`` of a reply against the reference, 1 / 0.5 / 0
  points as the paper grades (an automatic stand-in for its LLM-plus-human regrade: equal after
  normalisation or numerically within ``rtol`` scores 1; a reply matching some but not all of a
  reference's comma-separated components scores 0.5 — our guess at its partial credit);
- :func:`run_heuristic_cards`: plain (the problem only), prompt (the card in the system prompt)
  and memory (the card as a bank at the sites the user gives: a selector, or layers and a gain);
  beside the grade, the replies' repetition (:func:`~hf_memory.metrics.text_quality.repetition`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_memory import BankSet, MemoryBank, MemoryMethod, PlainMethod, PromptMethod
from hf_memory.baselines.methods import generate_with_each
from hf_memory.metrics.text_quality import repetition

__all__ = ["CARDS", "BoxedAnswerGrader", "extract_boxed", "load_problems",
           "run_heuristic_cards"]

CARDS: dict[str, dict[str, str]] = {
    "hardmath": {
        "integral": "Before manipulating an integral, find the parameter it depends on and where "
                    "it converges; pick a substitution or a known form that fits that regime. "
                    "Check the result in a limit or by differentiating it.",
        "laplace_integral": "For an integral dominated by a large parameter, locate where the "
                            "exponent peaks, expand around that point, and keep the leading "
                            "term with its prefactor. Check the scaling against the parameter.",
        "ode": "Classify the differential equation first (linear or not, order, singular "
               "points), find the general family of solutions, and only then fit the boundary "
               "data. Substitute the answer back into the equation.",
        "polynomial_roots": "Prefer structure to brute force: relations between roots and "
                            "coefficients, dominant balances for small or large parameters, "
                            "symmetry. Check each candidate root in the original polynomial.",
        "nondimensionalization": "List the dimensions of every quantity, form independent "
                                 "dimensionless groups, and choose scales that remove as many "
                                 "parameters as possible. Check each group is dimensionless.",
    },
    "physics": {
        "classical_mechanics": "Decide what kind of mechanics problem it is (forces, energy, "
                               "collision, constraint, oscillation, orbit) before writing "
                               "equations; use conserved quantities first. Check units and "
                               "limits.",
        "electromagnetism": "Write the boundary conditions at every interface and the material "
                            "relations before solving inside each region. Check that fields "
                            "match across interfaces and fall off correctly far away.",
        "quantum_mechanics": "Say whether the question asks for energies, time evolution, "
                             "measurement probabilities or a small correction, and choose the "
                             "basis that makes that operator simple. Check normalisation.",
        "thermodynamics": "Choose the ensemble from what is held fixed (energy, temperature, "
                          "particle number, pressure) and differentiate the matching potential "
                          "in its own variables. Check signs and limiting cases.",
        "atomic_physics": "Start from the dominant interaction, then add corrections in order "
                          "of size and name each one. Check that every splitting comes from a "
                          "stated interaction.",
        "optics": "Decide whether wavelength matters at the scale asked (waves: phase, "
                  "interference, diffraction) or rays suffice (imaging). Check the answer's "
                  "dependence on wavelength.",
    },
}


def load_problems(source: str | Path, *, question_field: str = "question",
                  answer_field: str = "answer", category_field: str = "category",
                  split: str = "test", limit: int | None = None) -> list[dict[str, str]]:
    """Problems as ``{"question", "answer", "category"}`` dicts from a local ``.json`` (a list)
    or ``.jsonl`` file, or a Hub dataset id (``split``), reading the user's field names.

    Raises:
        ValueError: the file is missing or not JSON, a field is absent, or the Hub dataset
            cannot be loaded (offline, unknown id).
    """
    path = Path(source)
    if path.suffix in (".json", ".jsonl"):
        try:
            text = path.read_text()
            rows = (json.loads(text) if path.suffix == ".json"
                    else [json.loads(line) for line in text.splitlines() if line.strip()])
        except OSError as error:
            raise ValueError(f"cannot read problems from {path}: {error.strerror}") from None
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
            raise ValueError(f"{path} is not valid JSON: {error}") from None
    else:
        from datasets import load_dataset

        try:
            rows = list(load_dataset(str(source), split=split))
        except Exception as error:  # offline, unknown id, gated: one line for all of them
            raise ValueError(f"cannot load the dataset {source!r} (split {split!r}): "
                             f"{str(error).splitlines()[0]}") from None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{source} holds no problems")
    problems = []
    for index, row in enumerate(rows[:limit]):
        missing = [f for f in (question_field, answer_field, category_field)
                   if not isinstance(row, dict) or f not in row]
        if missing:
            raise ValueError(f"problem {index} of {source} lacks {', '.join(missing)}")
        problems.append({"question": str(row[question_field]),
                         "answer": str(row[answer_field]),
                         "category": str(row[category_field])})
    return problems


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return None


def _number(text: str) -> float | None:
    text = text.replace(" ", "").replace("$", "")
    fraction = re.fullmatch(r"(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", text)
    if fraction:
        text = f"{fraction.group(1)}({fraction.group(2)})/({fraction.group(3)})"
    match = re.fullmatch(r"(-?)\(?(-?[\d.]+(?:e-?\d+)?)\)?(?:/\(?(-?[\d.]+(?:e-?\d+)?)\)?)?",
                         text)
    if not match:
        return None
    try:
        value = float(match.group(2)) / (float(match.group(3)) if match.group(3) else 1.0)
    except (ValueError, ZeroDivisionError):
        return None
    return -value if match.group(1) else value


def _normalise(text: str) -> str:
    return re.sub(r"\s+|\\left|\\right|\\,|\\!|\$", "", text).lower()


class BoxedAnswerGrader:
    """0, 0.5 or 1 point per reply (see the module docstring)."""

    name = "boxed-answer-v1"

    def __init__(self, rtol: float = 1e-6) -> None:
        self.rtol = rtol

    def _same(self, answer: str, reference: str) -> bool:
        a, b = _number(answer), _number(reference)
        if a is not None and b is not None:
            return math.isclose(a, b, rel_tol=self.rtol, abs_tol=self.rtol)
        return _normalise(answer) == _normalise(reference)

    def grade(self, response: str, reference: str) -> float:
        answer = extract_boxed(response)
        if answer is None:
            return 0.0
        if self._same(answer, reference):
            return 1.0
        parts = [p for p in reference.split(",") if p.strip()]
        given = [p for p in answer.split(",") if p.strip()]
        if len(parts) > 1 and any(self._same(g, p) for g in given for p in parts):
            return 0.5
        return 0.0


def run_heuristic_cards(model, tokenizer, problems: Sequence[dict[str, str]],
                        cards: dict[str, str], *, selector=None,
                        layers: Sequence[int] | None = None, gain: float = 1.0,
                        grader: BoxedAnswerGrader | None = None, max_new_tokens: int = 512,
                        batch_size: int = 8) -> dict[str, Any]:
    """Plain, prompt and memory on ``problems``; each category's card from ``cards`` (e.g.
    ``CARDS["hardmath"]``). Memory sites: ``selector``, else ``layers`` at ``gain``. Returns
    per-problem replies and points, and per category and method the mean points (``scores``)
    and the replies' repetition (``repetition``: mean distinct-2 and repeated-4-gram share).

    Raises:
        ValueError: a problem's category has no card, or no memory sites were given.
    """
    if selector is None and not layers:
        raise ValueError("give the memory sites: a selector, or layers (and a gain)")
    unknown = sorted({p["category"] for p in problems} - set(cards))
    if unknown:
        raise ValueError(f"no card for the categories {unknown}; cards exist for "
                         f"{sorted(cards)}")
    grader = grader or BoxedAnswerGrader()
    steering = ({"selector": selector} if selector is not None
                else {"layers": list(layers), "layer_gains": dict.fromkeys(layers, gain)})
    rows, scores, repeats = [], {}, {}
    for category in sorted({p["category"] for p in problems}):
        mine = [p for p in problems if p["category"] == category]
        bank = MemoryBank.from_text(model, tokenizer, cards[category], role="target",
                                    name="card", template="{text}", context="system")
        methods = {"plain": PlainMethod(),
                   "prompt": PromptMethod(cards[category], tokenizer=tokenizer),
                   "memory": MemoryMethod(BankSet([bank], model=model), **steering)}
        answered = generate_with_each(list(methods.values()), model, tokenizer,
                                      [p["question"] for p in mine], batch_size=batch_size,
                                      max_new_tokens=max_new_tokens, do_sample=False)
        for name, replies in zip(methods, answered, strict=True):
            points = [grader.grade(r, p["answer"]) for r, p in zip(replies, mine, strict=True)]
            scores.setdefault(category, {})[name] = sum(points) / len(points)
            repeats.setdefault(category, {})[name] = repetition(replies)
            rows += [{"category": category, "method": name, "question": p["question"],
                      "reply": r, "points": s}
                     for p, r, s in zip(mine, replies, points, strict=True)]
    return {"scores": scores, "rows": rows, "grader": grader.name, "repetition": repeats}
