"""Names shared by the tasks and the CLI (kept free of heavy imports so ``--help`` is fast)."""

from __future__ import annotations

from typing import Any

__all__ = ["DIRECTIONS", "FACTORS", "FAMILY_TASKS", "METHODS", "PERSONA_SETS", "RULES",
           "check_persona_knobs", "check_positive_ints", "checked_directions"]

FACTORS = ("O", "C", "E", "A", "N")
METHODS = ("plain", "prompt", "caa", "memory")
RULES = ("one_word", "number_only", "french")  # guidance: answer-format rules
# tasks of our own model families -> the model_type each needs
FAMILY_TASKS = {"air-sudoku": "air", "air-maze": "air", "arith-splits": "arith", "asm-lm": "asm",
                "asm-refinement": "asm"}
# persona-ab: steering-bench's persona A/B sets (eval_harness/persona_ab/data)
PERSONA_SETS = ("agreeableness", "conscientiousness", "extraversion", "neuroticism", "openness",
                "machiavellianism", "politically-conservative", "interest-in-art",
                "interest-in-music", "risk-averse", "subscribes-to-Buddhism",
                "believes-in-gun-rights")
DIRECTIONS = tuple(f"{t}{s}" for t in FACTORS for s in "+-")


def __getattr__(name: str):
    """``TASKS``: the names of the ``hf-memory eval`` tasks, read from
    :func:`eval_harness.registry.tasks` (each task folder declares its own)."""
    if name == "TASKS":
        from .registry import tasks

        return tuple(tasks())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checked_directions(directions) -> list[str]:
    """``directions`` as a list, or a ``ValueError`` naming the accepted ones."""
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise ValueError(f"directions must be among {', '.join(DIRECTIONS)}; got "
                         f"{list(directions)}")
    return list(directions)


def check_positive_ints(config, names) -> None:
    """A ``ValueError`` naming the first of ``config``'s fields ``names`` that is not an integer
    >= 1 (booleans refused)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive integer, got "
                             f"{value!r}")


def check_persona_knobs(recipes, examples: Any, examples_name: str, cost_budget: Any):
    """The persona-call knobs a task config shares: ``recipes`` as a list (None stays None; the
    exemplar recipes need at least 3 calibration examples, ``examples`` of them, called
    ``examples_name``) and ``cost_budget`` a number of nats per token >= 0; else one
    ``ValueError``."""
    from hf_memory.recipes.persona_recipes import RECIPES, check_recipes

    if recipes is not None:
        recipes = check_recipes(recipes, "persona_recipes")
        if any(RECIPES[r]["exemplars"] for r in recipes) and not (
                isinstance(examples, int) and examples >= 3):
            raise ValueError(f"the exemplars and contrast recipes take example replies from the "
                             f"{examples_name}: give at least 3 {examples_name}, got "
                             f"{examples!r}")
    if isinstance(cost_budget, bool) or not isinstance(cost_budget, int | float) \
            or not cost_budget >= 0:
        raise ValueError(f"cost_budget must be a number of nats per token >= 0, got "
                         f"{cost_budget!r}")
    return recipes
