"""Names shared by the tasks and the CLI (kept free of heavy imports so ``--help`` is fast)."""

from __future__ import annotations

__all__ = ["DIRECTIONS", "FACTORS", "METHODS", "TASKS"]

FACTORS = ("O", "C", "E", "A", "N")
METHODS = ("plain", "prompt", "caa", "memory")
TASKS = ("trait-steering", "layer-ablation", "bigfive", "bigfive-gen", "kv-footprint")
DIRECTIONS = tuple(f"{t}{s}" for t in FACTORS for s in "+-")
