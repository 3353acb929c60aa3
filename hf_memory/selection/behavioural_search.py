"""Behavioural site selection: steer where the banks move the model towards the target and
nowhere else (the task-level selector that the paper's appendix C names as the general form).

The diagnostic selector ranks sites by what the banks *would* receive (alignment, routing mass);
on small models that ranking can be inverted — any bank shifts the model, and the sites that take
the most bank mass are not the ones where the content steers. This selector instead measures the
effect directly on calibration contrast pairs (:mod:`hf_memory.metrics.likelihood`)::

    target(S) = mean over target pairs of the margin shift under steering at sites S
    se(S)     = its standard error over the pairs (sample std / √n)
    drift(S)  = mean over drift groups g of |mean shift of g's pairs|
    score(S)  = target(S) − uncertainty_weight · se(S) − drift_weight · drift(S)

The standard-error term makes the score a lower confidence bound on the movement: per-pair
shifts on a 135M model are large and of both signs (a bank at one layer moves single pairs by
±5 nats), so the plain mean rewards sites that shake the model more than ones that move it
consistently, and picking the best of ~30 noisy means overfits the calibration pairs.

Search, with a fixed budget of scored configurations (each one batch of forward passes):

1. every candidate layer alone (all units) at the largest gain;
2. greedy: walk the layers by their stage-1 score and keep adding one while the joint score
   improves, up to ``top_layers`` layers;
3. the chosen layers at each gain (the layer gain ρ_ℓ, which multiplies every bank gain).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from hf_memory.banks.bank_set import BankSet
from hf_memory.baselines.methods import MemoryMethod, Method
from hf_memory.metrics.likelihood import ContrastPair, check_pairs, pair_margins
from hf_memory.metrics.plain_states import PlainStates
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.selection.defaults import DEFAULT_COST_BUDGET

__all__ = ["DEFAULT_COST_BUDGET", "ShiftObjective", "SiteScore", "best_strength", "check_weight",
           "objective_key", "search_sites", "summarize_shifts"]


@dataclass(frozen=True)
class SiteScore:
    """One scored configuration: layers, gain ρ, target movement, drift, score, and the
    standard error of the target movement; a cost-budgeted search adds the strength dial, the
    steered units, the cost (ΔNLL per token of neutral text), the neutral bank's movement at
    the same sites (``presence``; ``target`` is then net of it) and, under a capability
    ceiling, the cost on factual answers (``capability``, nats per answer)."""

    layers: tuple[int, ...]
    gain: float
    target: float
    drift: float
    score: float
    target_se: float = 0.0
    strength: float = 1.0
    cost: float | None = None
    presence: float | None = None
    units: tuple[tuple[int, tuple[int, ...]], ...] | None = None
    capability: float | None = None

    def as_dict(self) -> dict[str, Any]:
        record = {"layers": list(self.layers), "gain": self.gain, "target": self.target,
                  "target_se": self.target_se, "drift": self.drift, "score": self.score}
        if self.strength != 1.0 or self.cost is not None:
            record["strength"] = self.strength
        for name in ("cost", "presence", "capability"):
            if getattr(self, name) is not None:
                record[name] = getattr(self, name)
        if self.units is not None:
            record["units"] = {str(layer): list(units) for layer, units in self.units}
        return record


@dataclass
class ShiftObjective:
    """Scores a steering method by margin shifts against the unsteered model.

    Args:
        pairs: ``(prompt, target reply, reference reply)`` triples of the steered dimension.
        drift_pairs: other dimensions' pairs by name; their absolute mean shifts are drift.
        drift_weight: weight of drift in the score.
        uncertainty_weight: weight of the target's standard error in the score (0: the mean).
        cost: what a method costs on neutral text
            (:class:`~hf_memory.metrics.steering_cost.NeutralCost`; None: not measured).
        cost_weight: weight of the cost in the score (nats of target movement per nat per
            token of neutral text; needs ``cost``).
    """

    model: nn.Module
    tokenizer: Any
    pairs: Sequence[ContrastPair]
    drift_pairs: Mapping[str, Sequence[ContrastPair]] = field(default_factory=dict)
    drift_weight: float = 1.0
    uncertainty_weight: float = 1.0
    batch_size: int = 16
    cost: NeutralCost | None = None
    cost_weight: float = 0.0
    evaluations: int = 0
    # measured from several threads at once (a search's probe threads)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def __post_init__(self) -> None:
        check_pairs(self.pairs)
        for name in ("drift_weight", "uncertainty_weight", "cost_weight"):
            check_weight(name, getattr(self, name))
        if self.cost_weight and self.cost is None:
            raise ValueError("cost_weight > 0 needs a cost (NeutralCost) to weigh")
        for name, group in self.drift_pairs.items():
            if not group:
                raise ValueError(f"drift group {name!r} has no pairs")
            check_pairs(group)
        self._key: tuple | None = None
        self._all = list(self.pairs) + [p for g in self.drift_pairs.values() for p in g]
        sizes = [len(self.pairs)] + [len(g) for g in self.drift_pairs.values()]
        self._bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        # measured again and again at other sites: steered passes start at their lowest site
        self.plain_states = PlainStates(self.model)
        self.plain = pair_margins(self.model, self.tokenizer, self._all,
                                  batch_size=self.batch_size, plain_states=self.plain_states)

    @property
    def key(self) -> tuple:
        """What :meth:`measure` depends on beside the method (and the cost it is given): the
        pairs, the drift groups, the weights and the batch size. Two objectives with the same
        key score a method alike, to the bit."""
        if self._key is None:
            self._key = objective_key(self.pairs, self.drift_pairs, self.drift_weight,
                                      self.uncertainty_weight, self.cost_weight,
                                      self.batch_size)
        return self._key

    def split(self, shift: torch.Tensor) -> tuple[float, float, float]:
        """(target movement, its standard error, drift) of per-pair shifts ordered as pairs,
        then drift groups."""
        return summarize_shifts(shift, self._bounds)

    def score(self, target: float, se: float, drift: float, cost: float | None = None) -> float:
        return (target - self.uncertainty_weight * se - self.drift_weight * drift
                - self.cost_weight * (cost or 0.0))

    def measure(self, method: Method, *, control: Method | None = None,
                cost: float | None = None) -> dict[str, float]:
        """``target``, ``target_se``, ``drift`` and ``score`` of ``method`` against the plain
        model; with a ``cost``, also ``cost`` (``cost`` given: already measured). With a
        ``control`` (the same sites carrying a neutral bank), the target pairs' shifts are net
        of the control's (``presence``: its mean), so what any bank does there cannot score."""
        with self._lock:
            self.evaluations += 1
        shift = pair_margins(self.model, self.tokenizer, self._all, method=method,
                             batch_size=self.batch_size,
                             plain_states=self.plain_states) - self.plain
        extra: dict[str, float] = {}
        if control is not None:
            count = len(self.pairs)
            presence = pair_margins(self.model, self.tokenizer, self.pairs, method=control,
                                    batch_size=self.batch_size,
                                    plain_states=self.plain_states) - self.plain[:count]
            shift = torch.cat([shift[:count] - presence, shift[count:]])
            extra["presence"] = float(presence.double().mean())
        if cost is None and self.cost is not None:
            cost = self.cost.measure(method)
        if cost is not None:
            extra["cost"] = cost
        target, se, drift = self.split(shift)
        return {"target": target, "target_se": se, "drift": drift,
                "score": self.score(target, se, drift, cost), **extra}


def objective_key(pairs: Sequence[ContrastPair], drift_pairs: Mapping[str, Sequence[ContrastPair]],
                  drift_weight: float, uncertainty_weight: float, cost_weight: float,
                  batch_size: int) -> tuple:
    """:attr:`ShiftObjective.key` of an objective with these arguments, before it is built."""
    return (pairs_digest(pairs, drift_pairs), float(drift_weight), float(uncertainty_weight),
            float(cost_weight), batch_size)


def pairs_digest(pairs: Sequence[tuple[str, str, str]],
                 drift_pairs: Mapping[str, Sequence[tuple[str, str, str]]] | None = None) -> str:
    """SHA-256 of calibration pairs and drift groups (recorded by a behavioural selector)."""
    return hashlib.sha256(json.dumps(
        [[list(p) for p in pairs],
         {k: [list(p) for p in v] for k, v in (drift_pairs or {}).items()}],
        sort_keys=True).encode()).hexdigest()


def check_weight(name: str, value: float) -> float:
    """A score weight or budget: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def summarize_shifts(shift: torch.Tensor, bounds: Sequence[int]) -> tuple[float, float, float]:
    """(mean, standard error, drift) of per-pair margin shifts: ``shift[bounds[0]:bounds[1]]``
    are the target pairs (mean and sample std / √n; 0 for one pair), each further
    ``shift[bounds[i]:bounds[i + 1]]`` a drift group (drift: mean of the groups' ``|mean|``)."""
    groups = [shift[a:b].double() for a, b in zip(bounds, bounds[1:], strict=False)]
    target = groups[0]
    se = float(target.std() / len(target) ** 0.5) if len(target) > 1 else 0.0
    drift = (sum(abs(float(g.mean())) for g in groups[1:]) / len(groups[1:])
             if len(groups) > 1 else 0.0)
    return float(target.mean()), se, drift


def best_strength(objective: ShiftObjective, make_method: Callable[[float], Method],
                  strengths: Sequence[float], *,
                  cost_budget: float | None = DEFAULT_COST_BUDGET
                  ) -> tuple[float, list[dict[str, float]]]:
    """The strength (e.g. a CAA scale) whose method scores best; and every strength's scores.

    Only strengths whose cost (nats per token of neutral text; the objective needs a cost)
    stays within ``cost_budget`` compete; if none does, the answer is 0 (no steering).
    ``cost_budget=None``: every strength competes, however much it breaks the model.
    """
    if not strengths:
        raise ValueError("give at least one strength to try")
    if cost_budget is not None:
        check_weight("cost_budget", cost_budget)
        if objective.cost is None:
            raise ValueError("a cost budget needs an objective with a cost (ShiftObjective(..., "
                             "cost=NeutralCost(model, tokenizer))); cost_budget=None chooses "
                             "without one")
    rows = []
    for strength in strengths:
        rows.append({"strength": float(strength),
                     **objective.measure(make_method(float(strength)))})
    allowed = [r for r in rows if cost_budget is None or r["cost"] <= cost_budget]
    if not allowed:
        return 0.0, rows
    best = max(allowed, key=lambda r: (r["score"], -r["strength"]))
    return best["strength"], rows


def search_sites(objective: ShiftObjective, banks: BankSet, candidates: Sequence[int], *,
                 top_layers: int, gains: Sequence[float], max_evaluations: int,
                 progress: bool = True) -> tuple[SiteScore, list[SiteScore]]:
    """The three-stage search of the module docstring over memory steering with ``banks`` at
    all heads of the chosen layers; returns (best, every scored configuration)."""
    candidates = sorted({int(i) for i in candidates})
    gains = sorted({float(g) for g in gains})
    if not candidates:
        raise ValueError("the search needs at least one candidate layer")
    if not gains or min(gains) <= 0:
        raise ValueError(f"gains must be positive, got {list(gains)}")
    if not 1 <= top_layers <= len(candidates):
        raise ValueError(f"top_layers must be in [1, {len(candidates)}], got {top_layers}")
    needed = len(candidates) + len(gains)
    if max_evaluations < needed:
        raise ValueError(f"max_evaluations must be at least {needed} (every candidate layer once "
                         f"and every gain once), got {max_evaluations}")
    history: list[SiteScore] = []
    bar = tqdm(total=max_evaluations, desc="site search", disable=not progress)

    def score(layers, gain) -> SiteScore:
        layers = tuple(sorted({int(i) for i in layers}))
        method = MemoryMethod(banks, layers=list(layers),
                              layer_gains={layer: gain for layer in layers})
        result = SiteScore(layers, gain, **objective.measure(method))
        history.append(result)
        bar.update()
        bar.set_postfix_str(f"best {max(h.score for h in history):+.2f}")
        return result

    probe = gains[-1]
    singles = [score([layer], probe) for layer in candidates]
    order = [s.layers[0] for s in sorted(singles, key=lambda s: (-s.score, s.layers))]
    best = max(singles, key=lambda s: (s.score, -s.layers[0]))
    spare = max_evaluations - len(candidates) - (len(gains) - 1)
    for layer in order:
        if len(best.layers) >= top_layers or spare <= 0:
            break
        if layer in best.layers:
            continue
        trial = score([*best.layers, layer], probe)
        spare -= 1
        if trial.score > best.score:
            best = trial
    for gain in gains[:-1]:
        trial = score(best.layers, gain)
        if trial.score > best.score:
            best = trial
    bar.close()
    return best, history
