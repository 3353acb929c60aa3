"""Behavioural site selection frozen into a selector: the search by the movement sites cause.

The default is the cost-budgeted search (:mod:`hf_memory.selection.budget_search`): the most
movement of the calibration pairs whose cost on neutral text stays within the budget, net of a
neutral control bank's movement, with sites whose movement does not hold on a validation split
of the pairs dropped (the ``"budgeted"`` algorithm). ``cost_budget=None`` runs the
``"unbudgeted"`` search of :mod:`hf_memory.selection.behavioural_search`. The knobs also come
typed (:class:`~hf_memory.selection.search_types.BehaviouralConfig`), and so does the result
(:class:`~hf_memory.selection.search_types.SelectionResult`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hf_memory.banks.bank_set import BankSet
from hf_memory.banks.neutral_control import neutral_control
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.models.adapters import get_adapter
from hf_memory.models.fingerprint import model_fingerprint
from hf_memory.selection.behavioural_search import (
    ShiftObjective,
    SiteScore,
    check_weight,
    objective_key,
    pairs_digest,
    search_sites,
)
from hf_memory.selection.budget_search import DEFAULT_STRENGTHS, PROMPT_LIKE_GAINS, BudgetSearch
from hf_memory.selection.defaults import DEFAULT_COST_BUDGET
from hf_memory.selection.probe_threads import check_workers
from hf_memory.selection.search_types import (
    BUDGETED,
    DEFAULT_GAINS,
    VALIDATION_FRACTION,
    BehaviouralConfig,
    SelectionResult,
    config_from,
    keyword_defaults,
)

__all__ = ["DEFAULT_GAINS", "VALIDATION_FRACTION", "calibrate_by_behaviour", "pairs_digest",
           "split_pairs", "validation_split"]


@torch.no_grad()
def calibrate_by_behaviour(
    model: nn.Module,
    tokenizer,
    banks: BankSet,
    pairs: Sequence[tuple[str, str, str]],
    *,
    drift_pairs: Mapping[str, Sequence[tuple[str, str, str]]] | None = None,
    top_layers: int = 5,
    candidate_layers: Sequence[int] | None = None,
    gains: Sequence[float] = DEFAULT_GAINS,
    drift_weight: float = 1.0,
    uncertainty_weight: float = 1.0,
    max_evaluations: int | None = None,
    batch_size: int = 16,
    progress: bool = True,
    cost_budget: float | None = DEFAULT_COST_BUDGET,
    cost_weight: float = 0.0,
    cost: Any = None,
    control_banks: BankSet | str | None = "recipe",
    strengths: Sequence[float] | None = None,
    dial_gains: Sequence[float] | None = None,
    unit_search: bool = True,
    layer_stride: int = 3,
    validation: float = VALIDATION_FRACTION,
    kv_ceiling: int | None = None,
    capability: Any = None,
    capability_ceiling: float | None = None,
    probes: Any = None,
    every_layer: bool = True,
    workers: int | None = None,
    config: BehaviouralConfig | None = None,
) -> SelectionResult:
    """Select sites by the movement they cause within a cost budget (the default); returns the
    :class:`~hf_memory.selection.selector.Selector` fields. The most
    movement whose cost on neutral text stays within ``cost_budget``
    (:mod:`hf_memory.selection.budget_search`: layers, then units, at the strongest dial
    setting the
    budget allows, net of a neutral bank's movement at the same sites), with the sites
    whose movement does not hold on a validation split of the pairs dropped;
    ``cost_budget=None``: the unbudgeted search of
    :mod:`hf_memory.selection.behavioural_search`.

    The one-line call is budgeted: ``Selector.calibrate_behavioural(model, tokenizer,
    banks, pairs)`` measures the cost on the shipped neutral text and builds the neutral
    control bank from the banks' own recipe
    (:func:`hf_memory.banks.neutral_control.neutral_control`).

    Args:
        banks: any bank set (target only, contrastive, with auxiliaries): the search scores
            it as it will be applied.
        pairs: ``(prompt, target reply, reference reply)`` calibration triples, disjoint
            from whatever the selector will be evaluated on.
        drift_pairs: triples of other dimensions, by name, whose movement is penalised.
        top_layers: the layer budget m (the search may keep fewer).
        candidate_layers: layers to consider (default: every layer a bank covers).
        gains: candidate layer gains ρ (multiplying every bank gain).
        drift_weight: weight of drift in the score.
        uncertainty_weight: weight of the target movement's standard error over the pairs
            in the score (target − uncertainty_weight · se − drift_weight · drift): a
            lower confidence bound, so a site must move the pairs consistently.
        max_evaluations: scored configurations allowed in the unbudgeted search (default:
            candidates + top_layers + 2·len(gains)); each is one batch of forward passes
            over the pairs. The budgeted search's count is fixed by its stages.
        cost_budget: nats per token of neutral text a configuration may cost (default
            ``DEFAULT_COST_BUDGET`` = 0.1; None: no budget, the unbudgeted search over
            ``gains``, which can buy movement by breaking the model).
        cost_weight: weight of the cost in the score, in either search.
        cost: the :class:`~hf_memory.metrics.steering_cost.NeutralCost` to measure (default: the
            shipped neutral text, when a budget or a cost weight needs one).
        control_banks: a neutral bank set built like ``banks`` (budgeted search): its
            movement at the same sites and strength is subtracted from the target's;
            ``"recipe"`` (default): built from the banks' own recipe on neutral text of
            about the same length; None: raw movement.
        strengths: the dial's grid (budgeted search; default ``DEFAULT_STRENGTHS``).
        dial_gains: layer gains ρ tried at full strength above the strength grid
            (budgeted search). Default: none for size-normalised banks (the dial is the
            strength at ρ = 1); for banks without size normalisation (concatenated
            attention, e.g. the ``prompt_like`` recipe) the strengths run at ρ = 0 (no
            bias: the prompt's own attention) and ``PROMPT_LIKE_GAINS`` follow.
        validation: fraction of the pairs held out inside the calibration (budgeted
            search; needs at least ``2 / validation`` pairs, else 0): the search runs on
            the rest, then each chosen layer whose removal does not lower the validation
            pairs' net movement is dropped; calibration and validation movement are
            recorded (``config["validation"]``). 0 turns it off.
        unit_search: after layers, remove units (KV groups of grouped-query models, else
            query heads) while the score improves (budgeted search).
        layer_stride: the budgeted search scores every k-th candidate layer alone (default
            3: a third of the calibration time of scoring each; 1 scores every layer).
        progress: show a progress bar (budgeted search: or a tqdm bar of a longer job, which
            every scored configuration advances).
        kv_ceiling: bytes of bank keys and values the selected sites may carry (budgeted
            search; None: no ceiling): configurations over it are never scored.
        capability, capability_ceiling: a cost on answers the steering should not touch
            (:class:`~hf_memory.metrics.factual.AnswerCost`) and the nats per answer it may
            reach (budgeted search; both or neither): a dial setting is within budget only
            when it is within both ceilings.
        probes: a :class:`~hf_memory.selection.budget_search.DialProbes` an earlier search of
            the same banks, costs and ceilings filled (budgeted search): nothing it measured
            is measured again, scores included where the search pairs and weights are the
            same and ``control_banks`` is ``"recipe"`` (built once, kept in the probes) or
            None, and the objective's plain pass where its pairs are the same
            (``DialProbes.objectives``; None: the search's own).
        every_layer: for banks in concatenated attention, also try every layer whose bank
            alone is within budget, the visible prompt's configuration (budgeted search;
            False: the greedy stages' choice only, e.g. a cheap screen).
        workers: threads that measure configurations side by side (budgeted search: its
            single layers, and the greedy stages' next trials against the same best,
            :meth:`~hf_memory.selection.budget_search.BudgetSearch.greedy`;
            :mod:`hf_memory.selection.probe_threads`; None: 2 where the process may use two
            cores, 1: one after the other). The history and the choice are the same either
            way.
        config: the knobs above as one :class:`~hf_memory.selection.search_types.BehaviouralConfig`
            (its ``algorithm`` names the search), instead of the keywords.

    Returns:
        A :class:`~hf_memory.selection.search_types.SelectionResult` (a read-only mapping of
        the selector fields; ``"strength"`` from the budgeted search only).
    """
    search = config_from(config, BehaviouralConfig,
                         {name: value for name, value in locals().items()
                          if name in _KEYWORDS}, _KEYWORDS)
    weights, budgeted = search.weights, search.budgeted
    check_workers(budgeted.workers)  # before any pass
    cost_budget, cost = search.cost_budget, search.cost
    model_config = model.config
    get_adapter(model)
    banks.check_model(model)
    covered = sorted({layer for bank in banks for layer in bank.layers})
    candidates = (covered if search.candidate_layers is None
                  else sorted(set(search.candidate_layers)))
    missing = sorted(set(candidates) - set(covered))
    if missing or not candidates:
        raise ValueError(f"candidate layers {missing or candidates} are not covered by any "
                         "bank")
    if cost_budget is not None or weights.cost_weight:
        check_weight("cost_weight", weights.cost_weight)
        if cost_budget is not None:
            check_weight("cost_budget", cost_budget)
        cost = cost if cost is not None else NeutralCost(model, tokenizer,
                                                         batch_size=search.batch_size)
    # the validation split: a budgeted search's alone
    search_pairs, check_pairs = (validation_split(pairs, budgeted.validation)
                                 if cost_budget is not None else (list(pairs), []))
    def build_objective() -> ShiftObjective:
        return ShiftObjective(model, tokenizer, search_pairs, dict(drift_pairs or {}),
                              drift_weight=weights.drift_weight,
                              uncertainty_weight=weights.uncertainty_weight,
                              batch_size=search.batch_size, cost=cost,
                              cost_weight=weights.cost_weight)

    shared = budgeted.probes.objectives if (cost_budget is not None
                                             and budgeted.probes is not None) else None
    if shared is None:
        objective = build_objective()
    else:  # one plain pass for every search of the same pairs that shares the probes
        key = (objective_key(search_pairs, dict(drift_pairs or {}), weights.drift_weight,
                             weights.uncertainty_weight, weights.cost_weight,
                             search.batch_size), id(model), id(tokenizer), id(cost))
        if key not in shared:
            shared[key] = build_objective()
        objective = shared[key]
    if cost_budget is None and (budgeted.kv_ceiling is not None
                                or budgeted.capability is not None):
        raise ValueError("kv_ceiling and capability apply to the budgeted search: give a "
                         "cost_budget")
    if search.algorithm == BUDGETED:
        control_banks = budgeted.control_banks
        if isinstance(control_banks, str):
            if control_banks != "recipe":
                raise ValueError("control_banks must be a BankSet, 'recipe' or None, got "
                                 f"{control_banks!r}")
            probes = budgeted.probes
            if probes is None:
                control_banks = neutral_control(model, tokenizer, banks)
            else:  # one control for every search sharing the probes: their scores are shared
                if probes.recipe_control is None:
                    probes.recipe_control = neutral_control(model, tokenizer, banks)
                control_banks = probes.recipe_control
        return _budgeted(model, tokenizer, banks, pairs, drift_pairs, objective,
                         candidates, cost_budget=cost_budget,
                         control_banks=control_banks, strengths=budgeted.strengths,
                         dial_gains=budgeted.dial_gains, unit_search=budgeted.unit_search,
                         top_layers=search.top_layers, layer_stride=budgeted.layer_stride,
                         check_pairs=check_pairs, progress=search.progress,
                         limits={"kv_ceiling": budgeted.kv_ceiling,
                                 "capability": budgeted.capability,
                                 "capability_ceiling": budgeted.capability_ceiling,
                                 "probes": budgeted.probes, "workers": budgeted.workers},
                         every_layer=budgeted.every_layer)
    top_layers, gains = search.top_layers, search.unbudgeted.gains
    max_evaluations = search.unbudgeted.max_evaluations
    budget = (len(candidates) + top_layers + 2 * len(gains) if max_evaluations is None
              else max_evaluations)
    best, history = search_sites(objective, banks, candidates, top_layers=top_layers,
                                 gains=gains, max_evaluations=budget, progress=search.progress)
    singles = {h.layers[0]: h for h in history[:len(candidates)]}
    diagnostics = {name: torch.tensor([[getattr(singles[layer], name)]
                                       for layer in candidates], dtype=torch.float32)
                   for name in ("target", "target_se", "drift", "score")}
    heads = model_config.num_attention_heads
    return SelectionResult(
        layers=list(best.layers), units={layer: list(range(heads)) for layer in best.layers},
        unit_type="head", layer_gains={layer: best.gain for layer in best.layers},
        candidate_layers=list(candidates), diagnostics=diagnostics,
        config={"objective": "behavioural", "top_layers": top_layers,
                "gains": sorted(float(g) for g in gains),
                "drift_weight": weights.drift_weight,
                "uncertainty_weight": weights.uncertainty_weight,
                "cost_weight": weights.cost_weight,
                "max_evaluations": budget, "evaluations": objective.evaluations,
                "num_pairs": len(pairs), "drift_groups": sorted(drift_pairs or {}),
                "pairs_sha256": pairs_digest(pairs, drift_pairs), "banks": banks.audit(),
                "best": best.as_dict(), "history": [h.as_dict() for h in history]},
        fingerprint=model_fingerprint(model))


_KEYWORDS = keyword_defaults(calibrate_by_behaviour)


def _budgeted(model, tokenizer, banks, pairs, drift_pairs, objective, candidates, *,
              cost_budget, control_banks, strengths, dial_gains, unit_search, top_layers,
              layer_stride, check_pairs, progress, limits, every_layer) -> SelectionResult:
    """:func:`calibrate_by_behaviour` under a cost budget (``objective`` over the search
    pairs; ``check_pairs``: the validation split, possibly empty; ``limits``: the KV and
    capability ceilings of :class:`BudgetSearch`)."""
    config = model.config
    evaluated = objective.evaluations  # a shared objective counts other searches' too
    if control_banks is not None:
        control_banks.check_model(model)
    grouped = config.num_key_value_heads < config.num_attention_heads
    unit_type = "kv_group" if grouped else "head"
    concatenated = not banks.size_normalize
    bar = progress if hasattr(progress, "update") else None
    search = BudgetSearch(
        objective, banks, cost_budget, unit_type,
        config.num_key_value_heads if grouped else config.num_attention_heads,
        control=control_banks, strengths=strengths or DEFAULT_STRENGTHS,
        base_gain=0.0 if concatenated else 1.0,
        gains=(PROMPT_LIKE_GAINS if concatenated else ()) if dial_gains is None
        else dial_gains, progress_bar=bar, **limits)
    screened = sorted(candidates)[::layer_stride]
    best = search.run(candidates, top_layers=min(top_layers, len(screened)),
                      unit_search=unit_search, layer_stride=layer_stride,
                      progress=bool(progress))
    singles = {h.layers[0]: h for h in search.history[:len(screened)]}
    checked, prompt_trial = None, None
    check = (ShiftObjective(model, tokenizer, check_pairs,
                            uncertainty_weight=objective.uncertainty_weight,
                            batch_size=objective.batch_size, cost=objective.cost)
             if check_pairs else None)
    if check is not None and best.units:
        best, checked = _prune_on_validation(search, best, check, singles)
    if concatenated and every_layer:
        best, checked, prompt_trial = _try_every_layer(search, best, checked, check, candidates)
    nan = SiteScore((), math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
    diagnostics = {name: torch.tensor([[float(getattr(singles.get(layer, nan), name))]
                                       for layer in candidates], dtype=torch.float32)
                   for name in ("target", "target_se", "drift", "score", "cost",
                                "strength", "gain")}
    units = {layer: list(u) for layer, u in best.units or ()}
    heads_per_unit = config.num_attention_heads // search.num_units
    return SelectionResult(
        layers=list(best.layers), units=units, unit_type=unit_type,
        layer_gains=dict.fromkeys(best.layers, best.gain),
        candidate_layers=list(candidates),
        diagnostics=diagnostics, strength=best.strength,
        config={"objective": "behavioural_budgeted", "top_layers": top_layers,
                "cost_budget": cost_budget, "cost_weight": objective.cost_weight,
                "strengths": list(search.strengths),
                "dial": [list(setting) for setting in search.settings],
                "unit_search": unit_search,
                "layer_stride": layer_stride, "screened_layers": screened,
                "drift_weight": objective.drift_weight,
                "uncertainty_weight": objective.uncertainty_weight,
                "control": control_banks.audit() if control_banks is not None else None,
                "within_budget": best.strength > 0,
                "kv_ceiling": search.kv_ceiling,
                "kv_bytes": search.kv_bytes(dict(best.units or ())),
                "capability_ceiling": search.capability_ceiling,
                "evaluations": objective.evaluations - evaluated,
                "cost_probes": search.cost_probes,
                "steered_heads": sum(len(u) for u in units.values()) * heads_per_unit,
                "num_pairs": len(pairs), "search_pairs": len(objective.pairs),
                "validation": checked, "every_layer_trial": prompt_trial,
                "drift_groups": sorted(drift_pairs or {}),
                "pairs_sha256": pairs_digest(pairs, drift_pairs), "banks": banks.audit(),
                "cost_texts": {"passages": len(objective.cost.passages),
                               "replies": len(objective.cost.replies),
                               "tokens": objective.cost.tokens},
                "best": best.as_dict(), "history": [h.as_dict() for h in search.history]},
        fingerprint=model_fingerprint(model))


def validation_split(pairs: Sequence[tuple[str, str, str]], validation: float
                     ) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(search pairs, validation pairs) of a budgeted search holding out ``validation`` of
    ``pairs`` (:func:`split_pairs`; none where that would be fewer than 2)."""
    if isinstance(validation, bool) or not (isinstance(validation, int | float)
                                            and 0 <= validation < 1):
        raise ValueError(f"validation must be a fraction in [0, 1), got {validation!r}")
    held = int(len(pairs) * validation) if len(pairs) * validation >= 2 else 0
    return split_pairs(pairs, held)


def split_pairs(pairs: Sequence[tuple[str, str, str]], held: int
                ) -> tuple[list[tuple[str, str, str]], list[tuple[str, str, str]]]:
    """(search pairs, validation pairs): ``held`` pairs spread evenly over the list (every
    k-th, so that kinds of pairs that alternate in the list land on both sides), the rest
    searched on; disjoint, deterministic."""
    pairs = list(pairs)
    if not held:
        return pairs, []
    if not 0 < held < len(pairs):
        raise ValueError(f"cannot hold out {held} of {len(pairs)} pairs")
    picked = {round((i + 0.5) * len(pairs) / held - 0.5) for i in range(held)}
    return ([p for i, p in enumerate(pairs) if i not in picked],
            [p for i, p in enumerate(pairs) if i in picked])


def _try_every_layer(search, best, checked, check, candidates):
    """The visible prompt's configuration as a candidate (:meth:`BudgetSearch.every_layer`):
    kept over ``best`` when it moves the validation pairs further (the search pairs' score
    where there is no validation split). Returns ``(best, checked, record or None)``."""
    trial = search.every_layer(candidates)
    if trial is None or trial.strength <= 0:
        return best, checked, None
    record = {**trial.as_dict(), "kept": False}
    if check is not None:
        judged = search.judged_by(check).score(dict(trial.units))
        current = checked["kept_validation_target"] if checked else None
        record.update(validation_target=judged.target, greedy_validation_target=current)
        if current is None or judged.target > current:
            record["kept"] = True
            checked = {**(checked or {"pairs": len(check.pairs), "dropped_layers": [],
                                      "calibration_target": best.target,
                                      "validation_target": current}),
                       "kept_validation_target": judged.target,
                       "kept_calibration_target": trial.target, "every_layer": True}
    elif trial.score > best.score:
        record["kept"] = True
    return (trial if record["kept"] else best), checked, record


def _prune_on_validation(search, best, check, singles) -> tuple[Any, dict[str, Any]]:
    """Drop each chosen layer (weakest single first) whose removal does not lower the
    validation pairs' net movement; returns the kept configuration, re-scored on the search
    pairs at its strongest setting within budget, and the record of the check."""

    judge = search.judged_by(check)
    before = judge.score(dict(best.units))
    current, dropped = before, []
    order = sorted(best.layers, key=lambda layer: getattr(singles.get(layer), "score", 0.0))
    for layer in order:
        units = {k: v for k, v in dict(current.units).items() if k != layer}
        if not units:
            continue
        trial = judge.score(units)
        if trial.target >= current.target:
            current, dropped = trial, [*dropped, layer]
    final = search.score(dict(current.units)) if dropped else best
    return final, {"pairs": len(check.pairs), "dropped_layers": dropped,
                   "calibration_target": best.target, "validation_target": before.target,
                   "kept_validation_target": current.target,
                   "kept_calibration_target": final.target}
