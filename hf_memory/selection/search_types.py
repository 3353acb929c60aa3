"""Typed configuration and results of the two selection searches.

:func:`~hf_memory.selection.behavioural_calibration.calibrate_by_behaviour` takes a
:class:`BehaviouralConfig` (its two algorithms named: :data:`BUDGETED`, the default, and
:data:`UNBUDGETED`, what ``cost_budget=None`` runs) and
:func:`~hf_memory.selection.attention_search.calibrate_by_attention` an :class:`AttentionConfig`,
as ``config=`` or as the flat keywords they always took (``from_keywords`` builds the one from the
other). Both return a :class:`SelectionResult`: typed fields, and the read-only mapping of the
:class:`~hf_memory.selection.selector.Selector` fields callers index (``Selector(**result)``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hf_memory.selection.defaults import DEFAULT_COST_BUDGET

__all__ = ["BUDGETED", "DEFAULT_GAINS", "SEARCH_ALGORITHMS", "UNBUDGETED", "VALIDATION_FRACTION",
           "AttentionConfig", "AttentionScoring", "BehaviouralConfig", "BudgetedSettings",
           "ScoreWeights", "SelectionResult", "UnbudgetedSettings"]

BUDGETED = "budgeted"  # the most movement within a cost budget (budget_search)
UNBUDGETED = "unbudgeted"  # the best score over a gain grid, no budget (behavioural_search)
SEARCH_ALGORITHMS = (BUDGETED, UNBUDGETED)
DEFAULT_GAINS = (0.5, 1.0, 2.0, 4.0)
VALIDATION_FRACTION = 1 / 3


def keyword_defaults(search: Callable[..., Any]) -> dict[str, Any]:
    """The defaults of ``search``'s keyword-only knobs (all but ``config`` and the data)."""
    return {p.name: p.default for p in inspect.signature(search).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name not in ("config", "drift_pairs")}


def config_from(config: Any, cls: type, keywords: dict[str, Any],
                defaults: dict[str, Any]) -> Any:
    """``config``, or ``cls.from_keywords(**keywords)`` where it is None; raises when both
    ``config`` and a keyword other than its default were given."""
    given = sorted(name for name, value in keywords.items() if value is not defaults[name]
                   and not (type(value) is type(defaults[name]) and value == defaults[name]))
    if config is None:
        return cls.from_keywords(**keywords)
    if given:
        raise ValueError(f"give config= or the keywords it holds, not both (also given: "
                         f"{', '.join(given)})")
    if not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__}, got {type(config).__name__}")
    return config


@dataclass(frozen=True)
class ScoreWeights:
    """The behavioural score's weights: target − uncertainty·se − drift·drift − cost·cost."""

    drift_weight: float = 1.0
    uncertainty_weight: float = 1.0
    cost_weight: float = 0.0


@dataclass(frozen=True)
class BudgetedSettings:
    """The :data:`BUDGETED` search's knobs (meanings as in ``calibrate_by_behaviour``)."""

    cost_budget: float = DEFAULT_COST_BUDGET
    control_banks: Any = "recipe"  # a BankSet, "recipe" or None
    strengths: Sequence[float] | None = None
    dial_gains: Sequence[float] | None = None
    unit_search: bool = True
    layer_stride: int = 3
    validation: float = VALIDATION_FRACTION
    kv_ceiling: int | None = None
    capability: Any = None  # an AnswerCost
    capability_ceiling: float | None = None
    probes: Any = None  # a DialProbes shared with an earlier search of the same banks
    every_layer: bool = True
    workers: int | None = None  # threads for independent probes (None: DEFAULT_WORKERS)


@dataclass(frozen=True)
class UnbudgetedSettings:
    """The :data:`UNBUDGETED` search's knobs: the layer-gain grid and the evaluation cap."""

    gains: Sequence[float] = DEFAULT_GAINS
    max_evaluations: int | None = None


@dataclass(frozen=True)
class BehaviouralConfig:
    """What ``calibrate_by_behaviour`` searches with, beyond the model, banks and pairs.

    Attributes:
        algorithm: :data:`BUDGETED` (``budgeted`` is read) or :data:`UNBUDGETED`
            (``unbudgeted`` is read).
        top_layers, candidate_layers: the layer budget m and the layers considered.
        weights: the score's weights.
        cost: the ``NeutralCost`` measured (None: the shipped neutral text where needed).
        batch_size, progress: pairs per forward pass; a progress bar (or a tqdm bar to advance).
    """

    algorithm: str = BUDGETED
    top_layers: int = 5
    candidate_layers: Sequence[int] | None = None
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    budgeted: BudgetedSettings = field(default_factory=BudgetedSettings)
    unbudgeted: UnbudgetedSettings = field(default_factory=UnbudgetedSettings)
    cost: Any = None
    batch_size: int = 16
    progress: Any = True

    def __post_init__(self) -> None:
        if self.algorithm not in SEARCH_ALGORITHMS:
            raise ValueError(f"algorithm must be one of {SEARCH_ALGORITHMS}, "
                             f"got {self.algorithm!r}")

    @classmethod
    def from_keywords(cls, *, cost_budget: float | None = DEFAULT_COST_BUDGET,
                      top_layers: int = 5, candidate_layers: Sequence[int] | None = None,
                      gains: Sequence[float] = DEFAULT_GAINS, drift_weight: float = 1.0,
                      uncertainty_weight: float = 1.0, max_evaluations: int | None = None,
                      batch_size: int = 16, progress: Any = True, cost_weight: float = 0.0,
                      cost: Any = None, **budgeted: Any) -> BehaviouralConfig:
        """The config of ``calibrate_by_behaviour``'s flat keywords (``cost_budget=None``:
        :data:`UNBUDGETED`; ``budgeted``: the :class:`BudgetedSettings` other than the
        budget)."""
        return cls(
            algorithm=UNBUDGETED if cost_budget is None else BUDGETED,
            top_layers=top_layers, candidate_layers=candidate_layers,
            weights=ScoreWeights(drift_weight, uncertainty_weight, cost_weight),
            budgeted=BudgetedSettings(**({} if cost_budget is None
                                         else {"cost_budget": cost_budget}), **budgeted),
            unbudgeted=UnbudgetedSettings(gains, max_evaluations),
            cost=cost, batch_size=batch_size, progress=progress)

    @property
    def cost_budget(self) -> float | None:
        """The budget in nats per neutral token; None for the :data:`UNBUDGETED` search."""
        return self.budgeted.cost_budget if self.algorithm == BUDGETED else None


@dataclass(frozen=True)
class AttentionScoring:
    """How ``calibrate_by_attention`` ranks units and layers (eq. 11-12) and sets their gains."""

    xi: float = 1.0
    chi: float = 1.0
    aggregate: str = "sum"
    order: str = "alignment"
    layer_gains: str = "uniform"


@dataclass(frozen=True)
class AttentionConfig:
    """What ``calibrate_by_attention`` searches with, beyond the model, banks and prompts.

    Attributes:
        top_layers, top_units: the budgets m and k.
        unit_type: ``"head"``, ``"kv_group"`` or ``"auto"``.
        candidate_layers: the layers considered (None: every layer both banks cover).
        scoring: the unit score and the layer ranking.
        positions, chat_template: the positions averaged over; the prompts templated.
        batch_size, progress: prompts per forward pass; a progress bar.
    """

    top_layers: int = 5
    top_units: int = 1
    unit_type: str = "auto"
    candidate_layers: Sequence[int] | None = None
    scoring: AttentionScoring = field(default_factory=AttentionScoring)
    positions: str = "user"
    chat_template: bool = True
    batch_size: int = 4
    progress: bool = True

    @classmethod
    def from_keywords(cls, *, xi: float = 1.0, chi: float = 1.0, aggregate: str = "sum",
                      order: str = "alignment", layer_gains: str = "uniform",
                      **rest: Any) -> AttentionConfig:
        """The config of ``calibrate_by_attention``'s flat keywords."""
        return cls(scoring=AttentionScoring(xi, chi, aggregate, order, layer_gains), **rest)


@dataclass(frozen=True, eq=False)
class SelectionResult(Mapping[str, Any]):
    """A search's result: the :class:`~hf_memory.selection.selector.Selector` fields, typed and
    as a read-only mapping (``result["layers"]``, ``.get``, iteration, ``Selector(**result)``;
    equal to the dict of the same items).

    Attributes:
        layers: steered layers, ascending.
        units: per steered layer, its units (query heads or KV groups).
        unit_type: ``"head"`` or ``"kv_group"``.
        layer_gains: ρ_ℓ per steered layer.
        candidate_layers: the layers scored (rows of ``diagnostics``).
        diagnostics: ``[len(candidate_layers), units | 1]`` float32 tables by name.
        config: the search's record (JSON-serialisable; ``config["best"]`` etc.).
        fingerprint: the model's fingerprint.
        strength: the dial the sites run at (the :data:`BUDGETED` search); None: not set
            (no ``"strength"`` key; a selector runs at 1.0).
    """

    layers: list[int]
    units: dict[int, list[int]]
    unit_type: str
    layer_gains: dict[int, float]
    candidate_layers: list[int]
    diagnostics: dict[str, Any]
    config: dict[str, Any]
    fingerprint: dict[str, Any] | None
    strength: float | None = None

    def __iter__(self) -> Iterator[str]:  # the order the searches' dicts had
        return (name for name in _RESULT_KEYS if name != "strength" or self.strength is not None)

    def __len__(self) -> int:
        return len(_RESULT_KEYS) - (self.strength is None)

    def __getitem__(self, key: str) -> Any:
        if key not in _RESULT_KEYS or (key == "strength" and self.strength is None):
            raise KeyError(key)
        return getattr(self, key)


_RESULT_KEYS = ("layers", "units", "unit_type", "layer_gains", "candidate_layers", "diagnostics",
                "strength", "config", "fingerprint")
