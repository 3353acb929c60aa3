"""Argument types shared by the ``hf-memory`` subcommands (argparse reports their errors); the
generic ones are :mod:`eval_harness.arguments`' (the eval tasks declare their flags there)."""

from __future__ import annotations

import argparse

from eval_harness.arguments import (
    finite,
    layer_spec,
    non_negative,
    non_negative_int,
    parse_layers,
    persona_recipes,
    positive_int,
    unit_interval,
)

__all__ = ["capability_ceiling", "device", "finite", "kv_ceiling", "layer_spec", "non_negative",
           "non_negative_int", "parse_layers", "persona_recipes", "positive_float",
           "positive_int", "strength", "unit_interval", "voice_budget"]


def device(text: str) -> str:
    """A torch device string such as ``cpu``, ``cuda`` or ``cuda:1``."""
    import torch

    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device") from None
    return text


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


def voice_budget(text: str) -> float | str:
    """``prompt`` (the visible prompt's own cost) or nats per token."""
    return "prompt" if text.strip().lower() == "prompt" else finite(text)
