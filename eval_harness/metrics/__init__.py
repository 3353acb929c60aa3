"""The harness's metrics, each an ``evaluate`` module with a card (``<name>/README.md``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

__all__ = ["METRICS_DIR", "load_metric"]

METRICS_DIR = Path(__file__).parent


@cache
def load_metric(name: str):
    """``evaluate.load`` of a metric module shipped here (works offline)."""
    import evaluate

    path = METRICS_DIR / name
    if not (path / f"{name}.py").is_file():
        raise ValueError(f"no metric {name!r} in {METRICS_DIR}")
    return evaluate.load(str(path))
