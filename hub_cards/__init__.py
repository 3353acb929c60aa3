"""Model cards and bank cards rendered from metadata and measured evaluation results."""

from __future__ import annotations

__all__: list[str] = []
