"""The ``hf-memory`` command line (``hf-memory --help``), kept apart from the libraries it drives:
``hf_memory`` (memory inception and its analysis tools), ``modeling`` (our model families),
``eval_harness`` and ``hub_cards``. Each command group is one module; ``main`` assembles them."""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
