"""Tables (Markdown) and plots (PNG) from a results JSON, for a person to look at."""

from __future__ import annotations

import json
from pathlib import Path

from .registry import tasks

__all__ = ["render_report"]


def render_report(results_path: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write ``report.md`` and PNG plots next to (or into ``out`` for) a results JSON."""
    path = Path(results_path)
    if path.is_dir():
        path = path / "results.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read results from {path}: {error}") from None
    out = Path(out) if out is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    name = record.get("task")
    task = tasks().get(name) if isinstance(name, str) else None
    if task is None:
        raise ValueError(f"{path} holds results of an unknown task {name!r}")
    return task.render(record, out)
