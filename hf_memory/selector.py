"""Automatic layer and unit selection (paper section 3.1, eq. 3, 11–12, algorithm 1, appendix C).

Calibration runs prompts through the *unsteered* model while every candidate site traces what it
would route (``steer(..., trace_only=True)``), and records per query head:

- the alignment margin a = max_j q̄·k⁺_j/√d − max_j q̄·k⁻_j/√d (eq. 3), pre-RoPE query q̄;
- the routing mass π of the target bank m⁺, the reference bank m⁻ and the prompt m^x.

Means over every non-padding calibration position give the unit score
U = ā + ξ·m̄⁺ − χ·m̄^x (eq. 11). Units are query heads, or KV groups (the mean over a group's
heads, expanded back to its heads at steering time). The top-k units of each layer are kept, the
layer score aggregates them (sum or mean, eq. 12), the top-m layers are kept, and layer gains ρ_ℓ
are assigned. The result is a frozen :class:`Selector` artifact: ``steer(model, banks,
selector=selector)`` applies it with no further search.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from tqdm.auto import tqdm

from .adapters import get_adapter
from .atomic_files import write_json, write_safetensors, write_text
from .bank_set import BankSet
from .calibration import neutral_control
from .capture import capture_outputs
from .chat import chat_messages
from .fingerprint import check_fingerprint, model_fingerprint
from .site_search import DEFAULT_COST_BUDGET
from .steering import steer

__all__ = ["Selector", "SelectorFormatError", "alignment_margin", "pairs_digest", "select_sites",
           "split_pairs", "unit_scores"]

FORMAT_VERSION = 1
CONFIG_NAME = "selector.json"
DIAGNOSTICS_NAME = "diagnostics.safetensors"
DIAGNOSTICS = ("alignment", "target_mass", "reference_mass", "prompt_mass", "score")
DEFAULT_GAINS = (0.5, 1.0, 2.0, 4.0)
VALIDATION_FRACTION = 1 / 3


def pairs_digest(pairs: Sequence[tuple[str, str, str]],
                 drift_pairs: Mapping[str, Sequence[tuple[str, str, str]]] | None = None) -> str:
    """SHA-256 of calibration pairs and drift groups (recorded by a behavioural selector)."""
    return hashlib.sha256(json.dumps(
        [[list(p) for p in pairs],
         {k: [list(p) for p in v] for k, v in (drift_pairs or {}).items()}],
        sort_keys=True).encode()).hexdigest()


class SelectorFormatError(ValueError):
    """A saved selector is missing, corrupt or inconsistent."""


def alignment_margin(
    queries: torch.Tensor, target_keys: torch.Tensor, reference_keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """Eq. 3 per query: ``max_j q·k⁺_j·scale − max_j q·k⁻_j·scale``.

    Args:
        queries: pre-RoPE queries ``[..., H, T, D]``.
        target_keys, reference_keys: bank keys per query head ``[H, M, D]``.
    Returns:
        margins ``[..., H, T]``.
    """
    best_target = torch.einsum("...htd,hmd->...htm", queries, target_keys).amax(-1)
    best_reference = torch.einsum("...htd,hmd->...htm", queries, reference_keys).amax(-1)
    return (best_target - best_reference) * scale


def unit_scores(alignment: torch.Tensor, target_mass: torch.Tensor, prompt_mass: torch.Tensor,
                *, xi: float, chi: float) -> torch.Tensor:
    """Eq. 11: U = ā + ξ·m̄⁺ − χ·m̄^x, elementwise over ``[layers, units]``."""
    return alignment + xi * target_mass - chi * prompt_mass


def select_sites(scores: torch.Tensor, *, top_units: int, top_layers: int,
                 aggregate: str = "sum", tie_break: torch.Tensor | None = None,
                 ) -> tuple[list[int], dict[int, list[int]], torch.Tensor]:
    """Eq. 12 on a ``[layers, units]`` table of ranking values.

    Returns ``(layer rows, units per layer row, layer scores)``: the top-``top_layers`` rows by the
    sum or mean of their top-``top_units`` unit values, in descending layer-score order. Equal
    values are ordered by ``tie_break`` (same shape, aggregated the same way), then by index.
    """
    if aggregate not in ("sum", "mean"):
        raise ValueError(f"aggregate must be 'sum' or 'mean', got {aggregate!r}")
    rows, units = scores.shape
    if not 1 <= top_units <= units:
        raise ValueError(f"top_units must be in [1, {units}], got {top_units}")
    if not 1 <= top_layers <= rows:
        raise ValueError(f"top_layers must be in [1, {rows}], got {top_layers}")
    tie = torch.zeros_like(scores) if tie_break is None else tie_break.to(scores.dtype)

    def ranked(values: torch.Tensor, ties: torch.Tensor) -> list[int]:
        return sorted(range(len(values)), key=lambda i: (-float(values[i]), -float(ties[i]), i))

    kept = {row: sorted(ranked(scores[row], tie[row])[:top_units]) for row in range(rows)}
    layer_scores = torch.stack([scores[row, kept[row]].sum() for row in range(rows)])
    layer_ties = torch.stack([tie[row, kept[row]].sum() for row in range(rows)])
    if aggregate == "mean":
        layer_scores, layer_ties = layer_scores / top_units, layer_ties / top_units
    chosen = ranked(layer_scores, layer_ties)[:top_layers]
    return chosen, {row: kept[row] for row in chosen}, layer_scores


@dataclass
class Selector:
    """A frozen selection: which layers and units to steer, with which layer gains.

    Attributes:
        layers: steered layers, ascending.
        units: per steered layer, the selected units (query heads or KV groups).
        unit_type: ``"head"`` or ``"kv_group"``.
        layer_gains: ρ_ℓ per steered layer.
        candidate_layers: the layers the calibration scored (rows of ``diagnostics``).
        diagnostics: ``[len(candidate_layers), units]`` tables: alignment, target_mass,
            reference_mass, prompt_mass, score.
        config: the calibration configuration (budgets, ξ, χ, aggregation, prompts' hash).
        fingerprint: the model the selector was calibrated on.
        strength: the steering strength dial the sites run at (``steer``'s ``strength``; 1: the
            full bank mixture); a cost-budgeted calibration sets it.
    """

    layers: list[int]
    units: dict[int, list[int]]
    unit_type: str
    layer_gains: dict[int, float]
    candidate_layers: list[int]
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] | None = None
    strength: float = 1.0

    def check_model(self, model: nn.Module) -> None:
        """Raise if the selector was calibrated on a different model."""
        if self.fingerprint is not None:
            check_fingerprint(self.fingerprint, model, "this selector")

    def summary(self) -> list[dict[str, Any]]:
        """One row per candidate layer: its diagnostics, averaged over units."""
        rows = []
        for i, layer in enumerate(self.candidate_layers):
            row = {"layer": layer, "selected": layer in self.layers}
            for name, table in self.diagnostics.items():
                row[name] = float(table[i].mean())
            rows.append(row)
        return rows

    @classmethod
    @torch.no_grad()
    def calibrate(
        cls,
        model: nn.Module,
        tokenizer,
        banks: BankSet,
        prompts: Sequence[str],
        *,
        top_layers: int = 5,
        top_units: int = 1,
        unit_type: str = "auto",
        candidate_layers: Sequence[int] | None = None,
        xi: float = 1.0,
        chi: float = 1.0,
        aggregate: str = "sum",
        layer_gains: str = "uniform",
        order: str = "alignment",
        positions: str = "user",
        chat_template: bool = True,
        batch_size: int = 4,
        progress: bool = True,
    ) -> Selector:
        """Algorithm 1: score every candidate unit on ``prompts`` and freeze the best sites.

        This is the paper's *diagnostic* selector. On the embedded SmolLM2-135M it picks sites
        where the banks take attention but do not steer (measured in BENCHMARKS.md);
        :meth:`calibrate_behavioural` picks sites by the movement they cause, and is what the
        evaluation and the demo use by default.

        Args:
            banks: a bank set with a target and a reference bank (auxiliary banks take part in
                the routing like at steering time).
            prompts: calibration prompts (wrapped in the chat template unless told otherwise).
            top_layers, top_units: the budgets m and k.
            unit_type: ``"head"``, ``"kv_group"``, or ``"auto"`` (KV groups for grouped-query
                models, heads for dense ones).
            xi, chi: weights of target mass and prompt mass in eq. 11.
            aggregate: ``"sum"`` or ``"mean"`` over a layer's top units (eq. 12).
            layer_gains: ``"uniform"`` (ρ = 1) or ``"relative"`` (ρ_ℓ = U_ℓ / max U over the
                selected layers, clipped to [0, 1]).
            order: ``"alignment"`` ranks units and layers by ā, with U of eq. 11 as the
                tie-break (appendix C: the dense questionnaire calibration orders primarily by
                ā); ``"score"`` ranks by U itself.
            positions: ``"user"`` averages the statistics over the user's text and the
                assistant prefix only (not the chat template's system prompt); ``"all"`` over
                every non-padding position.
        """
        config = model.config
        adapter = get_adapter(model)
        roles = [bank.role for bank in banks]
        if "target" not in roles or "reference" not in roles:
            raise ValueError("calibration needs a target and a reference bank")
        if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise ValueError("calibration needs a non-empty list of non-empty prompts")
        if order not in ("alignment", "score"):
            raise ValueError(f"order must be 'alignment' or 'score', got {order!r}")
        if positions not in ("user", "all"):
            raise ValueError(f"positions must be 'user' or 'all', got {positions!r}")
        if layer_gains not in ("uniform", "relative"):
            raise ValueError(f"layer_gains must be 'uniform' or 'relative', got {layer_gains!r}")
        if unit_type == "auto":
            grouped = config.num_key_value_heads < config.num_attention_heads
            unit_type = "kv_group" if grouped else "head"
        if unit_type not in ("head", "kv_group"):
            raise ValueError(f"unit_type must be 'head', 'kv_group' or 'auto', got {unit_type!r}")
        target, reference = (next(b for b in banks if b.role == role)
                             for role in ("target", "reference"))
        covered = sorted(set(target.layers) & set(reference.layers))
        candidates = covered if candidate_layers is None else sorted(set(candidate_layers))
        missing = sorted(set(candidates) - set(covered))
        if missing or not candidates:
            raise ValueError(f"candidate layers {missing or candidates} are not covered by both "
                             "the target and the reference bank")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        group = heads // kv_heads
        device = next(model.parameters()).device
        target_col, reference_col = 1 + roles.index("target"), 1 + roles.index("reference")

        sums = {name: torch.zeros(len(candidates), heads, dtype=torch.float64)
                for name in DIAGNOSTICS[:4]}
        count = 0
        texts = [tokenizer.apply_chat_template(chat_messages(p), add_generation_prompt=True,
                                               tokenize=False) if chat_template else p
                 for p in prompts]
        skipped = [_tokens_before(tokenizer, text, prompt)
                   if chat_template and positions == "user" else 0
                   for text, prompt in zip(texts, prompts, strict=True)]
        query_modules = {f"q{layer}": getattr(adapter.attention(model, layer),
                                              adapter.query_module) for layer in candidates}
        bank_keys = {}
        for layer in candidates:
            bank_keys[layer] = [
                bank.keys[bank.layer_index(layer)].to(device=device, dtype=torch.float64)
                .repeat_interleave(group, dim=0) for bank in (target, reference)]
        previous_side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            batches = range(0, len(texts), batch_size)
            for start in tqdm(batches, desc="calibrating", disable=not progress):
                batch = tokenizer(texts[start:start + batch_size], return_tensors="pt",
                                  padding=True, add_special_tokens=False).to(device)
                valid = batch["attention_mask"].bool()
                offsets = torch.tensor(skipped[start:start + batch_size], device=device)
                valid &= (valid.long().cumsum(-1) - 1) >= offsets[:, None]
                with steer(model, banks, layers=candidates, trace_only=True) as handle, \
                        capture_outputs(query_modules) as captured:
                    handle.record_routing()
                    model(**batch, use_cache=False)
                    routing = handle.routing()
                weights = valid[:, None, :].to(torch.float64)
                for row, layer in enumerate(candidates):
                    q = adapter.query(captured[f"q{layer}"], model.config).to(torch.float64)
                    margin = alignment_margin(q, *bank_keys[layer],
                                              scale=adapter.attention(model, layer).scaling)
                    (pi,) = routing[layer]
                    pi = pi.to(torch.float64)
                    for name, value in (("alignment", margin), ("target_mass", pi[..., target_col]),
                                        ("reference_mass", pi[..., reference_col]),
                                        ("prompt_mass", pi[..., 0])):
                        sums[name][row] += (value * weights).sum(dim=(0, 2)).cpu()
                count += int(valid.sum())
        finally:
            tokenizer.padding_side = previous_side

        per_head = {name: total / count for name, total in sums.items()}
        if unit_type == "kv_group":
            per_unit = {k: v.view(len(candidates), kv_heads, group).mean(-1)
                        for k, v in per_head.items()}
        else:
            per_unit = per_head
        scores = unit_scores(per_unit["alignment"], per_unit["target_mass"],
                             per_unit["prompt_mass"], xi=xi, chi=chi)
        ranking, tie_break = ((per_unit["alignment"], scores) if order == "alignment"
                              else (scores, None))
        rows, units, layer_scores = select_sites(ranking, top_units=top_units,
                                                 top_layers=top_layers, aggregate=aggregate,
                                                 tie_break=tie_break)
        layers = sorted(candidates[row] for row in rows)
        chosen_units = {candidates[row]: units[row] for row in rows}
        if layer_gains == "uniform":
            gains = {layer: 1.0 for layer in layers}
        else:
            best = max(float(layer_scores[row]) for row in rows)
            gains = {candidates[row]: (min(1.0, max(0.0, float(layer_scores[row]) / best))
                                       if best > 0 else 1.0) for row in rows}
        prompts_hash = hashlib.sha256("\x00".join(prompts).encode()).hexdigest()
        return cls(
            layers=layers, units=dict(sorted(chosen_units.items())), unit_type=unit_type,
            layer_gains=dict(sorted(gains.items())), candidate_layers=list(candidates),
            diagnostics={**{k: v.to(torch.float32) for k, v in per_unit.items()},
                         "score": scores.to(torch.float32)},
            config={"objective": "diagnostic", "order": order, "positions": positions,
                    "top_layers": top_layers, "top_units": top_units, "xi": xi, "chi": chi,
                    "aggregate": aggregate, "layer_gains": layer_gains,
                    "chat_template": chat_template, "num_prompts": len(prompts),
                    "num_positions": count, "prompts_sha256": prompts_hash,
                    "banks": banks.audit(), "layer_scores": layer_scores.tolist()},
            fingerprint=model_fingerprint(model))

    @classmethod
    @torch.no_grad()
    def calibrate_behavioural(
        cls,
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
    ) -> Selector:
        """Select sites by the movement they cause within a cost budget (the default): the most
        movement whose cost on neutral text stays within ``cost_budget``
        (:mod:`hf_memory.budget_search`: layers, then units, at the strongest dial setting the
        budget allows, net of a neutral bank's movement at the same sites), with the sites
        whose movement does not hold on a validation split of the pairs dropped;
        ``cost_budget=None``: the unbudgeted search of :mod:`hf_memory.site_search`.

        The one-line call is budgeted: ``Selector.calibrate_behavioural(model, tokenizer,
        banks, pairs)`` measures the cost on the shipped neutral text and builds the neutral
        control bank from the banks' own recipe (:func:`hf_memory.calibration.neutral_control`).

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
            cost: the :class:`~hf_memory.steering_cost.NeutralCost` to measure (default: the
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
        """
        from .site_search import ShiftObjective, search_sites

        config = model.config
        get_adapter(model)
        banks.check_model(model)
        covered = sorted({layer for bank in banks for layer in bank.layers})
        candidates = covered if candidate_layers is None else sorted(set(candidate_layers))
        missing = sorted(set(candidates) - set(covered))
        if missing or not candidates:
            raise ValueError(f"candidate layers {missing or candidates} are not covered by any "
                             "bank")
        if cost_budget is not None or cost_weight:
            from .site_search import check_weight
            from .steering_cost import NeutralCost

            check_weight("cost_weight", cost_weight)
            if cost_budget is not None:
                check_weight("cost_budget", cost_budget)
            cost = cost if cost is not None else NeutralCost(model, tokenizer,
                                                             batch_size=batch_size)
        held = 0
        if cost_budget is not None:  # the validation split: a budgeted search's alone
            if not (isinstance(validation, int | float) and 0 <= validation < 1):
                raise ValueError(f"validation must be a fraction in [0, 1), got {validation!r}")
            held = int(len(pairs) * validation) if len(pairs) * validation >= 2 else 0
        search_pairs, check_pairs = split_pairs(pairs, held)
        objective = ShiftObjective(model, tokenizer, search_pairs, dict(drift_pairs or {}),
                                   drift_weight=drift_weight,
                                   uncertainty_weight=uncertainty_weight, batch_size=batch_size,
                                   cost=cost, cost_weight=cost_weight)
        if cost_budget is not None:
            if isinstance(control_banks, str):
                if control_banks != "recipe":
                    raise ValueError("control_banks must be a BankSet, 'recipe' or None, got "
                                     f"{control_banks!r}")
                control_banks = neutral_control(model, tokenizer, banks)
            return cls._budgeted(model, tokenizer, banks, pairs, drift_pairs, objective,
                                 candidates, cost_budget=cost_budget,
                                 control_banks=control_banks, strengths=strengths,
                                 dial_gains=dial_gains, unit_search=unit_search,
                                 top_layers=top_layers, layer_stride=layer_stride,
                                 check_pairs=check_pairs, progress=progress)
        budget = (len(candidates) + top_layers + 2 * len(gains) if max_evaluations is None
                  else max_evaluations)
        best, history = search_sites(objective, banks, candidates, top_layers=top_layers,
                                     gains=gains, max_evaluations=budget, progress=progress)
        singles = {h.layers[0]: h for h in history[:len(candidates)]}
        diagnostics = {name: torch.tensor([[getattr(singles[layer], name)]
                                           for layer in candidates], dtype=torch.float32)
                       for name in ("target", "target_se", "drift", "score")}
        heads = config.num_attention_heads
        return cls(
            layers=list(best.layers), units={layer: list(range(heads)) for layer in best.layers},
            unit_type="head", layer_gains={layer: best.gain for layer in best.layers},
            candidate_layers=list(candidates), diagnostics=diagnostics,
            config={"objective": "behavioural", "top_layers": top_layers,
                    "gains": sorted(float(g) for g in gains), "drift_weight": drift_weight,
                    "uncertainty_weight": uncertainty_weight, "cost_weight": cost_weight,
                    "max_evaluations": budget, "evaluations": objective.evaluations,
                    "num_pairs": len(pairs), "drift_groups": sorted(drift_pairs or {}),
                    "pairs_sha256": pairs_digest(pairs, drift_pairs), "banks": banks.audit(),
                    "best": best.as_dict(), "history": [h.as_dict() for h in history]},
            fingerprint=model_fingerprint(model))

    @classmethod
    def _budgeted(cls, model, tokenizer, banks, pairs, drift_pairs, objective, candidates, *,
                  cost_budget, control_banks, strengths, dial_gains, unit_search, top_layers,
                  layer_stride, check_pairs, progress) -> Selector:
        """:meth:`calibrate_behavioural` under a cost budget (``objective`` over the search
        pairs; ``check_pairs``: the validation split, possibly empty)."""
        from .budget_search import DEFAULT_STRENGTHS, PROMPT_LIKE_GAINS, BudgetSearch
        from .site_search import ShiftObjective, SiteScore

        config = model.config
        if control_banks is not None:
            control_banks.check_model(model)
        grouped = config.num_key_value_heads < config.num_attention_heads
        unit_type = "kv_group" if grouped else "head"
        concatenated = not banks.size_normalize
        search = BudgetSearch(
            objective, banks, cost_budget, unit_type,
            config.num_key_value_heads if grouped else config.num_attention_heads,
            control=control_banks, strengths=strengths or DEFAULT_STRENGTHS,
            base_gain=0.0 if concatenated else 1.0,
            gains=(PROMPT_LIKE_GAINS if concatenated else ()) if dial_gains is None
            else dial_gains)
        screened = sorted(candidates)[::layer_stride]
        best = search.run(candidates, top_layers=min(top_layers, len(screened)),
                          unit_search=unit_search, layer_stride=layer_stride, progress=progress)
        singles = {h.layers[0]: h for h in search.history[:len(screened)]}
        checked = None
        if check_pairs and best.units:
            best, checked = _prune_on_validation(search, best, ShiftObjective(
                model, tokenizer, check_pairs, uncertainty_weight=objective.uncertainty_weight,
                batch_size=objective.batch_size, cost=objective.cost), singles)
        nan = SiteScore((), math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
        diagnostics = {name: torch.tensor([[float(getattr(singles.get(layer, nan), name))]
                                           for layer in candidates], dtype=torch.float32)
                       for name in ("target", "target_se", "drift", "score", "cost",
                                    "strength", "gain")}
        units = {layer: list(u) for layer, u in best.units or ()}
        heads_per_unit = config.num_attention_heads // search.num_units
        return cls(
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
                    "evaluations": objective.evaluations, "cost_probes": search.cost_probes,
                    "steered_heads": sum(len(u) for u in units.values()) * heads_per_unit,
                    "num_pairs": len(pairs), "search_pairs": len(objective.pairs),
                    "validation": checked,
                    "drift_groups": sorted(drift_pairs or {}),
                    "pairs_sha256": pairs_digest(pairs, drift_pairs), "banks": banks.audit(),
                    "cost_texts": {"passages": len(objective.cost.passages),
                                   "replies": len(objective.cost.replies),
                                   "tokens": objective.cost.tokens},
                    "best": best.as_dict(), "history": [h.as_dict() for h in search.history]},
            fingerprint=model_fingerprint(model))

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write ``selector.json``, ``diagnostics.safetensors`` and a ``README.md`` card."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        record = {
            "format_version": FORMAT_VERSION, "kind": "memory_inception_selector",
            "layers": self.layers, "units": {str(k): v for k, v in self.units.items()},
            "unit_type": self.unit_type,
            "layer_gains": {str(k): v for k, v in self.layer_gains.items()},
            "candidate_layers": self.candidate_layers, "strength": self.strength,
            "config": self.config, "fingerprint": self.fingerprint,
        }
        # one atomic file each; the statistics first, the record that steers last
        write_safetensors(directory / DIAGNOSTICS_NAME,
                          {k: v.contiguous() for k, v in self.diagnostics.items()})
        write_json(directory / CONFIG_NAME, record)
        write_text(directory / "README.md", _card(self))
        return directory

    @classmethod
    def from_pretrained(cls, path_or_repo: str | os.PathLike, *,
                        model: nn.Module | None = None, revision: str | None = None,
                        token: str | None = None,
                        cache_dir: str | os.PathLike | None = None) -> Selector:
        """Load a saved selector (a local directory, or a Hub repo id at ``revision`` through
        the Hub cache); with ``model``, check it was calibrated on that model."""
        directory = Path(path_or_repo)
        if not directory.is_dir() and not directory.is_absolute() and (
                str(path_or_repo).count("/") == 1):
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(
                str(path_or_repo), revision=revision, token=token, cache_dir=cache_dir,
                allow_patterns=[CONFIG_NAME, DIAGNOSTICS_NAME, "README.md"]))
        for name in (CONFIG_NAME, DIAGNOSTICS_NAME):  # safetensors names no missing file
            if not (directory / name).is_file():
                raise SelectorFormatError(f"{directory} lacks {name}")
        try:
            record = json.loads((directory / CONFIG_NAME).read_text())
            diagnostics = load_file(directory / DIAGNOSTICS_NAME)
        except (ValueError, SafetensorError, OSError) as error:
            raise SelectorFormatError(f"{directory} holds a corrupt selector: {error}") from None
        if record.get("kind") != "memory_inception_selector" or (
                record.get("format_version") != FORMAT_VERSION):
            raise SelectorFormatError(f"{directory / CONFIG_NAME} is not a version "
                                      f"{FORMAT_VERSION} memory-inception selector")
        try:
            selector = cls(
                layers=list(record["layers"]),
                units={int(k): list(v) for k, v in record["units"].items()},
                unit_type=record["unit_type"],
                layer_gains={int(k): float(v) for k, v in record["layer_gains"].items()},
                candidate_layers=list(record["candidate_layers"]), diagnostics=diagnostics,
                config=record["config"], fingerprint=record["fingerprint"],
                strength=float(record.get("strength", 1.0)))
        except KeyError as error:
            raise SelectorFormatError(f"{directory / CONFIG_NAME} lacks {error}") from None
        except (TypeError, ValueError) as error:
            raise SelectorFormatError(f"{directory / CONFIG_NAME} holds a malformed entry: "
                                      f"{error}") from None
        if sorted(selector.units) != selector.layers or sorted(selector.layer_gains) != (
                selector.layers):
            raise SelectorFormatError(f"{directory / CONFIG_NAME}: layers, units and gains "
                                      "disagree")
        if not 0.0 <= selector.strength <= 1.0:
            raise SelectorFormatError(f"{directory / CONFIG_NAME}: strength must be in [0, 1], "
                                      f"got {selector.strength}")
        if model is not None:
            selector.check_model(model)
        return selector

    def push_to_hub(self, repo_id: str, *, private: bool | None = None,
                    token: str | None = None,
                    commit_message: str = "Upload memory-inception selector") -> str:
        """Create (if needed) a Hub model repo and upload the saved selector to it."""
        from .hub_upload import upload_saved

        return upload_saved(self.save_pretrained, repo_id, private=private, token=token,
                            commit_message=commit_message)


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


def _tokens_before(tokenizer, text: str, prompt: str) -> int:
    """How many tokens of templated ``text`` come before the user's ``prompt`` in it."""
    offset = text.rfind(prompt)
    if offset < 0:
        raise ValueError("the chat template does not render the prompt verbatim; calibrate "
                         "with positions='all'")
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    return sum(1 for a, b in encoded["offset_mapping"] if b <= offset or (a < offset < b))


def _card(selector: Selector) -> str:
    config = selector.config
    model = (selector.fingerprint or {}).get("name_or_path") or "unspecified"
    if config.get("objective") == "behavioural_budgeted":
        best = config["best"]
        how = (f"cost-budgeted behavioural search on `{model}` over "
               f"{len(selector.candidate_layers)} candidate layers with {config['num_pairs']} "
               f"calibration pairs: strength {selector.strength:g} within a budget of "
               f"{config['cost_budget']:g} nats/token of neutral text (cost "
               f"{best['cost']:+.3f}), calibration target shift net of a neutral bank "
               f"{best['target']:+.2f}, drift {best['drift']:.2f}, "
               f"{config['steered_heads']} query heads steered, {config['evaluations']} "
               "configurations scored.")
    elif config.get("objective") == "behavioural":
        best = config["best"]
        how = (f"behavioural search on `{model}` over {len(selector.candidate_layers)} candidate "
               f"layers with {config['num_pairs']} calibration pairs (drift groups "
               f"{config['drift_groups']}): calibration target shift {best['target']:+.2f}, "
               f"drift {best['drift']:.2f}, {config['evaluations']} configurations scored.")
    else:
        how = (f"diagnostic calibration (algorithm 1) on `{model}` with "
               f"{config.get('num_prompts')} prompts (ξ = {config.get('xi')}, "
               f"χ = {config.get('chi')}, order {config.get('order', 'score')}, "
               f"{config.get('aggregate')} over the top {config.get('top_units')} units).")
    lines = ["---", "library_name: hf-memory", "tags:", "- memory-inception", "- selector", "---",
             "", "# Memory-inception selector", "",
             f"Frozen sites: unit type `{selector.unit_type}`; {how}", "",
             "| layer | units | ρ |", "| --- | --- | --- |"]
    lines += [f"| {layer} | {selector.units[layer]} | {selector.layer_gains[layer]:.3f} |"
              for layer in selector.layers]
    return "\n".join(lines) + "\n"
