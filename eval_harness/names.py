"""Names shared by the tasks and the CLI (kept free of heavy imports so ``--help`` is fast)."""

from __future__ import annotations

__all__ = ["FACTORS", "METHODS", "TASKS"]

FACTORS = ("O", "C", "E", "A", "N")
METHODS = ("plain", "prompt", "caa", "memory")
TASKS = ("bigfive", "bigfive-gen", "kv-footprint")
