"""One Big Five steering direction, frozen for every task that scores it: the shared piece.

``calibrate_direction`` freezes a direction's prompt, memory (the behavioural selector, reused
from a saved or shipped one calibrated for the same banks and objective) and CAA (layer and the
largest scale within the cost budget) on calibration data only; :class:`TraitSteeringConfig`
holds its knobs. Trait steering, layer ablation, capability, persistence, trade-off, guidance
and dialogue shift all build their methods here. ``eval_pairs``: the held-out contrast pairs
(``trait_steering/trait_pairs.json``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_memory import (
    BankSet,
    CAAMethod,
    CAAVectors,
    FingerprintMismatchError,
    MemoryBank,
    MemoryMethod,
    Method,
    PromptMethod,
    Selector,
)
from hf_memory.banks.neutral_control import neutral_text
from hf_memory.metrics.steering_cost import NeutralCost, neutral_sample
from hf_memory.recipes.calibration_data import (
    calibration_pairs,
    calibration_prompts,
    direction_parts,
)
from hf_memory.recipes.persona_recipes import check_recipes
from hf_memory.recipes.shipped import selectors_dir
from hf_memory.selection.behavioural_calibration import DEFAULT_GAINS, pairs_digest
from hf_memory.selection.behavioural_search import ShiftObjective, best_strength, check_weight

from .bigfive.task import CAA_FRAMES
from .names import DIRECTIONS, FACTORS, checked_directions

__all__ = ["DIRECTIONS", "EVAL_PATH", "CAAFromStart", "FrozenDirection", "TraitSteeringConfig",
           "direction_bank", "direction_memory", "site_mass",
           "bank_sources", "behavioural_selector", "calibrate_direction", "eval_pairs",
           "neutral_control"]

EVAL_PATH = Path(__file__).parent / "trait_steering" / "trait_pairs.json"


def eval_pairs(limit: int | None = None) -> list[dict[str, Any]]:
    """The held-out likelihood items; ``limit`` per trait (answers and statements alternate)."""
    items = json.loads(EVAL_PATH.read_text())["items"]
    if limit is None:
        return items
    kept = []
    for trait in FACTORS:
        mine = [i for i in items if i["trait"] == trait]
        answers = [i for i in mine if i["kind"] == "answer"]
        statements = [i for i in mine if i["kind"] == "statement"]
        mixed = [x for pair in zip(answers, statements, strict=False) for x in pair]
        kept += mixed[:limit]
    return kept


@dataclass
class TraitSteeringConfig:
    """Knobs of the task (recorded in the results). ``cost_texts``: measure the cost budget on
    the first N shipped neutral passages and prompts (None: all of them). ``validation``: the
    fraction of the calibration pairs the budgeted selector search holds out to drop sites
    that do not hold there (0, the shipped selectors' recipe: every pair searched).
    ``persona_recipes``: calibrate memory by a user's one-line call instead
    (:func:`~hf_memory.recipes.persona.calibrate_persona` over the target descriptor and the
    calibration pairs: these bank recipes, exemplars taken from the pairs, the recipe that
    holds best on its validation split kept; ``validation`` 0 leaves the call's own split);
    None: the descriptor bank of the shipped selectors. ``judge_prompts``: judge plain, prompt,
    CAA and memory's greedy replies to this many held-out questions per direction (0: none)."""

    directions: Sequence[str] = DIRECTIONS
    limit: int | None = None
    questionnaire_limit: int | None = None
    top_layers: int = 5
    candidate_layers: Sequence[int] | None = None
    gains: Sequence[float] = DEFAULT_GAINS
    calibration_pairs: int = 24
    drift_pairs: int = 2
    uncertainty_weight: float = 1.0
    bank_context: str = "system"
    bank_template: str = "{text}"
    cost_budget: float | None = 0.1
    cost_texts: int | None = None
    validation: float = 0.0
    layer_stride: int = 3
    caa_layer: int = 10
    caa_scales: Sequence[float] = (0.25, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)
    caa_start: str = "all"
    controls: bool = True
    diagnostic: bool = True
    batch_size: int = 16
    num_bootstrap: int = 1000
    seed: int = 0
    selectors_dir: str | None = None
    persona_recipes: Sequence[str] | None = None
    judge_prompts: int = 8
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directions = checked_directions(self.directions)
        if self.caa_start not in ("all", "instruction"):
            raise ValueError(f"caa_start must be 'all' or 'instruction', got {self.caa_start!r}")
        if not 1 <= self.calibration_pairs <= 24:
            raise ValueError("calibration_pairs must be between 1 and 24 per trait")
        if self.cost_budget is not None:
            check_weight("cost_budget", self.cost_budget)
        if not (isinstance(self.validation, int | float) and 0 <= self.validation < 1):
            raise ValueError(f"validation must be a fraction in [0, 1), got {self.validation!r}")
        if self.cost_texts is not None and (isinstance(self.cost_texts, bool) or not isinstance(
                self.cost_texts, int) or self.cost_texts < 1):
            raise ValueError(f"cost_texts must be a positive integer or None, got "
                             f"{self.cost_texts!r}")
        if self.persona_recipes is not None:
            self.persona_recipes = check_recipes(self.persona_recipes, "persona_recipes")
            if self.cost_budget is None:
                raise ValueError("persona_recipes calibrate within a cost budget: give "
                                 "cost_budget")
        if isinstance(self.judge_prompts, bool) or not isinstance(self.judge_prompts, int) \
                or self.judge_prompts < 0:
            raise ValueError(f"judge_prompts must be a non-negative integer, got "
                             f"{self.judge_prompts!r}")
        if isinstance(self.layer_stride, bool) or not isinstance(self.layer_stride, int) or (
                self.layer_stride < 1):
            raise ValueError(f"layer_stride must be a positive integer, got "
                             f"{self.layer_stride!r}")


class CAAFromStart(CAAMethod):
    """CAA starting at the first position (``caa_start='all'``), as memory does."""

    def attach(self, model, instruction_end):
        from hf_memory import apply_caa

        return apply_caa(model, self.vectors, scale=self.scale, start_position=0)


def direction_bank(model, tokenizer, text: str, role: str, name: str, config) -> MemoryBank:
    return MemoryBank.from_text(model, tokenizer, text, role=role, name=name,
                                template=config.bank_template, context=config.bank_context)


def bank_sources(banks: BankSet) -> list[dict[str, Any]] | None:
    """What each bank was built from (name, role, gain, text, context, templates, token ids),
    without its tensors: the same for every run of the same recipe on the same model, where
    the content hash can differ in the last bits with the thread count. None if a bank was not
    built from text."""
    sources = []
    for bank in banks:
        provenance = bank.provenance
        if provenance.get("source") != "text":
            return None
        variants = provenance["variants"]
        sources.append({"name": bank.name, "role": bank.role, "gain": bank.gain,
                        "text_sha256": provenance["text_sha256"],
                        "context": provenance["context"],
                        "templates": [v["template"] for v in variants],
                        "token_ids": [v["token_ids"] for v in variants]})
    return sources


def _same_banks(saved: Selector, banks: BankSet, sources) -> bool:
    """The saved selector was calibrated for these banks: identical tensors, or (same model,
    checked on loading) the same recipe — recorded by :func:`behavioural_selector`, or the
    package's ``bank_recipe`` for the shipped selectors."""
    if saved.config.get("banks") == banks.audit():
        return True
    if sources is None:
        return False
    if saved.config.get("bank_sources") is not None:
        return saved.config["bank_sources"] == sources
    recipe = saved.config.get("bank_recipe")
    if recipe is None or len(sources) != 1:
        return False
    (source,) = sources
    audit = [{k: v for k, v in entry.items() if k != "content_hash"}
             for entry in saved.config.get("banks", [])]
    return (audit == [{"gain": source["gain"], "name": source["name"], "role": source["role"]}]
            and source["text_sha256"] == hashlib.sha256(recipe["text"].encode()).hexdigest()
            and source["context"] == recipe["context"]
            and source["templates"] == [recipe["template"]])


def _made_on(selector: Selector, model) -> bool:
    """The selector was calibrated on ``model`` (a dtype difference only warns)."""
    try:
        selector.check_model(model)
    except FingerprintMismatchError:
        return False
    return True


def neutral_control(model, tokenizer, config) -> BankSet | None:
    """The neutral bank set whose movement a budgeted search subtracts (built like the target
    bank, from the neutral text); None without a cost budget."""
    if config.cost_budget is None:
        return None
    return BankSet([direction_bank(model, tokenizer, neutral_text(), "target", "neutral", config)],
                   model=model)


def behavioural_selector(model, tokenizer, banks: BankSet, pairs, drift, config,
                         name: str, *, control: BankSet | None = None,
                         cost: NeutralCost | None = None) -> Selector:
    """Reuse a frozen selector made on this model for the same banks, calibration pairs and
    objective (the one saved under ``config.selectors_dir / name``, else the one shipped with the
    package under ``name``, made on the default model), or calibrate one and save it there.
    ``config`` carries the search's knobs (``top_layers``, ``candidate_layers``, ``gains``,
    ``uncertainty_weight``, ``batch_size``, ``selectors_dir``, ``cost_budget``: with a budget,
    ``control`` is the neutral bank set and ``cost`` the neutral text). Banks match by recipe
    (:func:`bank_sources`), so a selector is reused across thread counts."""
    path = Path(config.selectors_dir) / name if config.selectors_dir else None
    budget = getattr(config, "cost_budget", None)  # a task without one searches unbudgeted
    validation = float(getattr(config, "validation", 0.0))
    wanted = {"pairs_sha256": pairs_digest(pairs, drift),
              "uncertainty_weight": config.uncertainty_weight, "top_layers": config.top_layers,
              "cost_budget": budget}
    stride = getattr(config, "layer_stride", 3)
    if budget is None:
        wanted["gains"] = sorted(float(g) for g in config.gains)
    else:
        wanted["layer_stride"] = stride
    sources = bank_sources(banks)
    candidates = sorted({layer for bank in banks for layer in bank.layers}
                        if config.candidate_layers is None else set(config.candidate_layers))
    shipped = Path(str(selectors_dir())) / name
    for place in (path, shipped):
        if place is not None and (place / "selector.json").is_file():
            saved = Selector.from_pretrained(place)
            if (_made_on(saved, model) and saved.candidate_layers == candidates
                    and _same_banks(saved, banks, sources)
                    and all(saved.config.get(key) == value for key, value in wanted.items())
                    and saved.config.get("validation_fraction", 0.0) == validation):
                return saved
    selector = Selector.calibrate_behavioural(
        model, tokenizer, banks, pairs, drift_pairs=drift, top_layers=config.top_layers,
        candidate_layers=config.candidate_layers, gains=config.gains,
        uncertainty_weight=config.uncertainty_weight, batch_size=config.batch_size,
        cost_budget=budget, cost=cost, control_banks=control, layer_stride=stride,
        validation=validation, progress=False)
    selector.config["bank_sources"] = sources
    selector.config["validation_fraction"] = validation
    if path is not None:
        selector.save_pretrained(path)
    return selector


def site_mass(model, tokenizer, method: MemoryMethod, prompts: Sequence[str]) -> dict[str, Any]:
    """Mean routing mass (prompt / each bank) per steered layer over ``prompts``."""
    from hf_memory.chat.generation import encode_chats
    from hf_memory.steering.handle import steer

    batch = encode_chats(tokenizer, [method.messages(p) for p in prompts]).to(model.device)
    with steer(model, method.banks, selector=method.selector, **method.steering) as handle:
        handle.record_routing()
        model(**batch, use_cache=False)
        routing = handle.routing()
    valid = batch["attention_mask"].bool()
    # a contrast set's routing is its target side's (the reference mixture is subtracted)
    names = ["prompt", *[b.name for b in method.banks
                         if not method.banks.contrast or b.role == "target"]]
    masses = {}
    for layer, (pi,) in routing.items():
        mean = pi.float().mean(1)[valid].mean(0)  # over heads, then valid positions
        masses[str(layer)] = {n: round(float(m), 4) for n, m in zip(names, mean, strict=True)}
    return masses


@dataclass
class FrozenDirection:
    """One direction's methods, each frozen on calibration data at its calibrated strength:
    ``methods`` holds ``prompt``, ``memory`` (target bank at the behavioural selector's sites) and
    ``caa`` (scale chosen on the calibration pairs); ``setup`` records how."""

    direction: str
    target: str
    reference: str
    target_bank: MemoryBank
    reference_bank: MemoryBank
    banks: BankSet
    selector: Selector
    methods: dict[str, Method]
    setup: dict[str, Any]


def direction_memory(model, tokenizer, direction: str, config: TraitSteeringConfig,
                     cost: NeutralCost | None = None) -> tuple[MemoryBank, BankSet, Selector]:
    """``direction``'s target bank, its bank set and behavioural selector (a saved or shipped
    one when it was calibrated for the same banks and objective, else calibrated and saved
    under ``config.selectors_dir``); ``cost``: the neutral text of the budget (None: built
    from ``config`` when it has a budget)."""
    _, _, target, _ = direction_parts(direction)
    pairs, drift = calibration_pairs(direction, config.calibration_pairs, config.drift_pairs)
    if cost is None and config.cost_budget is not None:
        cost = NeutralCost(model, tokenizer, batch_size=config.batch_size,
                           **neutral_sample(config.cost_texts))
    if config.persona_recipes:
        found = _persona_memory(model, tokenizer, direction, target, pairs, drift, config, cost)
        return found.banks.banks[0], found.banks, found.selector
    # named as the demo's persona_bank, so that the shipped selectors match when the recipe does
    target_bank = direction_bank(model, tokenizer, target, "target", "persona", config)
    banks = BankSet([target_bank], model=model)
    control = neutral_control(model, tokenizer, config)
    selector = behavioural_selector(model, tokenizer, banks, pairs, drift, config, direction,
                                    control=control, cost=cost)
    return target_bank, banks, selector


def _persona_memory(model, tokenizer, direction: str, target: str, pairs, drift,
                    config: TraitSteeringConfig, cost: NeutralCost):
    """The user's one-line call on the direction's descriptor and pairs (saved, with every
    recipe's trial, under ``config.selectors_dir / "<direction>-persona"``)."""
    from hf_memory.recipes.persona import calibrate_persona

    split = {"validation": config.validation} if config.validation else {}
    found = calibrate_persona(
        model, tokenizer, target, pairs, recipes=config.persona_recipes,
        cost_budget=config.cost_budget, top_layers=config.top_layers, drift_pairs=drift,
        candidate_layers=config.candidate_layers, uncertainty_weight=config.uncertainty_weight,
        batch_size=config.batch_size, cost=cost, layer_stride=config.layer_stride,
        progress=False, **split)
    if config.selectors_dir:
        found.save_pretrained(Path(config.selectors_dir) / f"{direction}-persona")
    return found


def calibrate_direction(model, tokenizer, direction: str,
                        config: TraitSteeringConfig) -> FrozenDirection:
    """Freeze prompt, memory (:func:`direction_memory`) and CAA for ``direction`` on the
    calibration pairs."""
    _, _, target, reference = direction_parts(direction)
    pairs, drift = calibration_pairs(direction, config.calibration_pairs, config.drift_pairs)
    cost = (NeutralCost(model, tokenizer, batch_size=config.batch_size,
                        **neutral_sample(config.cost_texts))
            if config.cost_budget is not None else None)
    objective = ShiftObjective(model, tokenizer, pairs, drift,
                               uncertainty_weight=config.uncertainty_weight,
                               batch_size=config.batch_size, cost=cost)
    target_bank, banks, selector = direction_memory(model, tokenizer, direction, config, cost)
    reference_bank = direction_bank(model, tokenizer, reference, "reference", "reference", config)
    methods: dict[str, Method] = {
        "prompt": PromptMethod(target, tokenizer=tokenizer),
        "memory": MemoryMethod(banks, selector),
    }
    vectors = CAAVectors.extract(model, tokenizer, [(f.format(target), f.format(reference))
                                                    for f in CAA_FRAMES],
                                 layers=[config.caa_layer])
    caa_class = CAAFromStart if config.caa_start == "all" else CAAMethod
    scale, caa_rows = best_strength(
        objective, lambda s, c=caa_class, v=vectors: c(v, scale=s), config.caa_scales,
        cost_budget=config.cost_budget)
    methods["caa"] = caa_class(vectors, scale=scale)
    setup: dict[str, Any] = {
        "calibration_pairs": [list(p) for p in pairs],
        "caa": {"layer": config.caa_layer, "scale": scale, "start": config.caa_start,
                "calibration": caa_rows},
        "memory": {"layers": selector.layers, "gain": selector.layer_gains,
                   "units": {str(k): v for k, v in selector.units.items()},
                   "strength": selector.strength, "cost_budget": config.cost_budget,
                   "search": selector.config["history"], "objective": selector.config["best"],
                   "routing_mass": site_mass(model, tokenizer, methods["memory"],
                                              calibration_prompts()[:4]),
                   "bank_slots": target_bank.num_slots,
                   "bank_recipe": selector.config.get("bank_recipe", {}).get("recipe",
                                                                        "descriptor")},
    }
    return FrozenDirection(direction, target, reference, target_bank, reference_bank, banks,
                           selector, methods, setup)
