"""Argument types shared by the ``hf-memory`` subcommands (argparse reports their errors)."""

from __future__ import annotations

import argparse
import math

__all__ = ["capability_ceiling", "device", "finite", "kv_ceiling", "layer_spec", "non_negative",
           "non_negative_int", "parse_layers", "persona_recipes", "positive_float",
           "positive_int", "strength", "unit_interval"]


def device(text: str) -> str:
    """A torch device string such as ``cpu``, ``cuda`` or ``cuda:1``."""
    import torch

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device") from None
    return text


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def unit_interval(text: str) -> float:
    """A float in [0, 1)."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def finite(text: str) -> float:
    """Any finite float."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def non_negative(text: str) -> float:
    """A finite float >= 0."""
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite and >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (a learning rate)."""
    value = float(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be finite and > 0, got {text}")
    return value


def strength(text: str) -> float:
    """The strength dial: a float in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def parse_layers(spec: str) -> list[int]:
    """``"18-22"`` → [18, …, 22]; ``"3,5,9-10"`` → [3, 5, 9, 10]."""
    layers: set[int] = set()
    try:
        for part in spec.split(","):
            low, _, high = part.strip().partition("-")
            layers.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"layers must look like '18-22' or '3,5,9-10', got {spec!r}") from None
    if not layers:
        raise ValueError(f"no layers in {spec!r}")
    return sorted(layers)


def layer_spec(text: str) -> list[int]:
    """Layers as ``18-22`` or ``3,5,9-10`` (for argparse)."""
    try:
        return parse_layers(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def persona_recipes(text: str) -> list[str]:
    """Comma-separated persona bank recipes (:data:`hf_memory.recipes.persona_recipes.RECIPES`)."""
    from hf_memory.recipes.persona_recipes import check_recipes

    try:
        return check_recipes(name.strip() for name in text.split(",") if name.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def kv_ceiling(text: str) -> float | None:
    """A share of the prompt's KV above 0, or ``none`` (no ceiling)."""
    if text.strip().lower() == "none":
        return None
    return positive_float(text)


def capability_ceiling(text: str) -> float | str | None:
    """``prompt`` (the visible prompt's own cost), nats per answer, or ``none``."""
    if text.strip().lower() in ("none", "prompt"):
        return None if text.strip().lower() == "none" else "prompt"
    return finite(text)
