"""Declarative tasks, ``evaluate`` metrics, model adapters, runners and plotted reports."""

from __future__ import annotations

__all__: list[str] = []
