"""Reading a user's JSON input file (cases, styles, rules) with one clear error for an unreadable
or malformed file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_user_json"]


def read_user_json(path: str | Path, what: str) -> Any:
    """The JSON in ``path``, or a ``ValueError`` naming ``what`` (e.g. "the cases") and the file
    when it cannot be read or is not valid JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror}") from None
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise ValueError(f"{what} {path} is not valid JSON: {error}") from None
