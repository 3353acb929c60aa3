"""The bank recipes of a user's persona (:mod:`hf_memory.recipes.persona`), as data: what each
builds, and which :func:`~hf_memory.recipes.persona.calibrate_persona` tries by default. Imports
nothing heavy, so the command line can list them without loading torch."""

from __future__ import annotations

__all__ = ["DEFAULT_RECIPES", "RECIPES", "check_recipes"]

RECIPES = {
    "descriptor": {"placement": "free", "size_normalize": True, "exemplars": False},
    "prompt_like": {"placement": "before", "size_normalize": False, "exemplars": False},
    "exemplars": {"placement": "before", "size_normalize": False, "exemplars": True},
    "contrast": {"placement": "before", "size_normalize": False, "exemplars": True,
                 "contrast": True},
}
DEFAULT_RECIPES = ("prompt_like", "exemplars", "contrast")


def check_recipes(names, what: str = "recipes") -> list[str]:
    """``names`` as a list, or a ValueError naming ``what`` unless it is a non-empty list of
    known recipes."""
    names = list(names)
    if not names or any(name not in RECIPES for name in names):
        raise ValueError(f"{what} must be among {sorted(RECIPES)}, got {names}")
    return names
