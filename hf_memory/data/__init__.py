"""The data shipped with the package, read from one place.

``calibration_pairs.json``, ``neutral_texts.json`` (Big Five calibration, control banks),
``cost_texts.json`` (the neutral text of the cost budget), ``selectors/<direction>/`` (frozen
shipped selectors), ``personas/<name>/`` (shipped personas).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from functools import cache
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

__all__ = ["as_path", "load_json", "resource"]


def resource(*parts: str) -> Traversable:
    """A file or folder of the shipped data (it may live inside a zip: see :func:`as_path`)."""
    return resources.files(__name__).joinpath(*parts)


@cache
def load_json(*parts: str) -> Any:
    """A shipped JSON file, parsed once per process."""
    return json.loads(resource(*parts).read_text())


def as_path(traversable: Traversable) -> AbstractContextManager[Path]:
    """A real filesystem path for a shipped file or folder for the ``with`` block's duration."""
    return resources.as_file(traversable)
