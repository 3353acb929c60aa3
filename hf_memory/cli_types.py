"""Argument types shared by the ``hf-memory`` subcommands (argparse reports their errors)."""

from __future__ import annotations

import argparse

__all__ = ["non_negative", "positive_int", "unit_interval"]


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def unit_interval(text: str) -> float:
    """A float in [0, 1)."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def non_negative(text: str) -> float:
    """A finite float >= 0."""
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value
