"""Heuristic-card banks for structured reasoning (HARDMath / PHYSICS)."""
