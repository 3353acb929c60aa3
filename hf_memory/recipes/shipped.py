"""What the package ships ready-made: the Big Five selectors and the personas, and how they are
built.

``data/selectors/<direction>/``: frozen behavioural selectors for the ten Big Five directions
(:func:`build_selector`, ``hf-memory build-selector``), each with the bank recipe
:func:`persona_bank`. ``data/personas/<name>/``: personas the embedded model visibly voices from
a prompt, with their calibration pairs, lexicon and what :func:`build_persona` calibrated on them
within the cost budget (the memory selector with its bank recipe, the voice band, CAA's layer and
scale).
Torch-dependent modules are imported inside the functions, so the CLI's ``--help`` stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hf_memory.data import as_path, resource
from hf_memory.selection.defaults import DEFAULT_COST_BUDGET

__all__ = ["BANK_RECIPE", "DEMO_PERSONA", "SHIPPED_DIRECTIONS",
           "SHIPPED_PERSONAS", "build_persona", "build_selector", "persona_bank",
           "persona_json", "persona_spec", "shipped_persona", "shipped_persona_name",
           "shipped_selector"]

SHIPPED_DIRECTIONS = tuple(f"{trait}{sign}" for trait in "OCEAN" for sign in "+-")
BANK_RECIPE = {"template": "{text}", "context": "system", "gain": 1.0}
SHIPPED_PERSONAS = ("pirate",)
DEMO_PERSONA = "pirate"  # a persona the embedded model voices from a visible prompt


def persona_bank(model, tokenizer, text: str, *, role: str = "target", name: str = "persona",
                 layers: Sequence[int] | None = None, gain: float = BANK_RECIPE["gain"],
                 placement: str = "free"):
    """The demo's and the shipped selectors' bank recipe: ``text`` as a system message
    (``placement``: see :meth:`~hf_memory.banks.bank.MemoryBank.from_text`)."""
    from hf_memory.banks.bank import MemoryBank

    return MemoryBank.from_text(model, tokenizer, text, role=role, name=name, layers=layers,
                                template=BANK_RECIPE["template"],
                                context=BANK_RECIPE["context"], gain=gain, placement=placement)


def selectors_dir():
    return resource("selectors")


def shipped_selector(direction: str, model=None):
    """The frozen behavioural selector shipped for a Big Five ``direction`` (e.g. ``"N+"``)."""
    from hf_memory.selection.selector import Selector

    if direction not in SHIPPED_DIRECTIONS:
        raise ValueError(f"no selector is shipped for {direction!r}; shipped: "
                         f"{', '.join(SHIPPED_DIRECTIONS)} (build one with hf-memory "
                         "build-selector)")
    with as_path(selectors_dir().joinpath(direction)) as path:
        return Selector.from_pretrained(path, model=model)


def _persona_dir(name: str):
    if name not in SHIPPED_PERSONAS:
        raise ValueError(f"no persona {name!r} is shipped; shipped: {', '.join(SHIPPED_PERSONAS)}")
    return resource("personas", name)


def persona_json(name: str) -> dict:
    """A shipped persona's ``persona.json`` as written (without its pairs)."""
    return json.loads(_persona_dir(name).joinpath("persona.json").read_text())


def persona_spec(name: str) -> dict:
    """A shipped persona's ``persona.json`` (text, lexicon, and what :func:`build_persona`
    calibrated) with its calibration pairs (``pairs``)."""
    from hf_memory.selection.pairs import read_pairs

    folder = _persona_dir(name)
    spec = persona_json(name)
    with as_path(folder.joinpath("pairs.jsonl")) as path:
        spec["pairs"] = read_pairs(path)
    return spec


def shipped_persona(model, tokenizer, name: str = DEMO_PERSONA):
    """``(banks, selector, CAA method or None, spec)`` of a shipped persona: the banks rebuilt by
    the calibrated recipe, the frozen selector, CAA at the calibrated layer and scale."""
    from hf_memory.baselines.caa import CAAVectors
    from hf_memory.baselines.methods import CAAMethod
    from hf_memory.recipes.persona import persona_banks
    from hf_memory.selection.selector import Selector

    spec = persona_spec(name)
    if "recipe" not in spec:
        raise ValueError(f"persona {name!r} is not calibrated yet: run hf-memory build-selector "
                         f"--persona {name}")
    banks = persona_banks(model, tokenizer, spec["text"], recipe=spec["recipe"],
                          exemplars=spec.get("exemplars", ()),
                          counter_exemplars=spec.get("counter_exemplars", ()),
                          sink_reads_banks=spec.get("sink_reads_banks", True))
    with as_path(_persona_dir(name).joinpath("selector")) as path:
        selector = Selector.from_pretrained(path, model=model)
    caa = None
    if spec.get("caa", {}).get("layer") is not None:
        vectors = CAAVectors.extract(model, tokenizer, [(f"{p} {t}", f"{p} {r}")
                                                        for p, t, r in spec["pairs"]],
                                     layers=[spec["caa"]["layer"]])
        caa = CAAMethod(vectors, scale=spec["caa"]["scale"])
    return banks, selector, caa, spec


def build_persona(model, tokenizer, name: str = DEMO_PERSONA, *, out=None,
                  recipes: Sequence[str] | None = None, cost_budget: float | str | None = None,
                  progress: bool = True, **limits: Any):
    """Calibrate a shipped persona on its pairs within a cost budget: memory by
    :func:`~hf_memory.recipes.persona.calibrate_persona`, CAA by
    :func:`~hf_memory.recipes.persona.calibrate_caa`, the voice band by
    :func:`~hf_memory.recipes.voice_band.voice_band` (within the prompt's own KV, judged on
    :func:`~hf_memory.recipes.voice_band.band_prompts`); writes the selector and the choices
    into ``out`` (default: the package's own folder). ``recipes``: the bank recipes to try;
    ``cost_budget``: nats per token of neutral text, or ``"prompt"``: the visible prompt's own
    cost on the same text (what memory and CAA are then compared at); both default to the
    persona's own rule in ``persona.json`` (``recipes``, ``cost_budget``), else
    calibrate_persona's recipes and the default budget. ``**limits``: ``kv_ceiling`` /
    ``capability_ceiling`` for calibrate_persona (default: its own). Returns the
    :class:`~hf_memory.recipes.persona.PersonaSteering`."""
    from pathlib import Path

    from hf_memory.artifacts.atomic_files import write_json
    from hf_memory.baselines.methods import PromptMethod
    from hf_memory.metrics.steering_cost import NeutralCost
    from hf_memory.recipes.persona import calibrate_caa, calibrate_persona
    from hf_memory.recipes.voice_band import band_prompts, voice_band

    spec = persona_spec(name)
    spec.pop("every_layer", None)  # what builds before the voice band wrote
    pairs, folder = spec.pop("pairs"), _persona_dir(name)
    recipes = recipes if recipes is not None else spec.get("recipes")
    rule = cost_budget if cost_budget is not None else spec.get("cost_budget",
                                                               DEFAULT_COST_BUDGET)
    numeric = isinstance(rule, (int, float)) and not isinstance(rule, bool)
    if rule != "prompt" and not (numeric and rule >= 0):
        raise ValueError(f"cost_budget must be a non-negative number or 'prompt', got {rule!r}")
    cost = NeutralCost(model, tokenizer)
    budget = (cost.measure(PromptMethod(spec["text"], tokenizer=tokenizer)) if rule == "prompt"
              else float(rule))
    found = calibrate_persona(model, tokenizer, spec["text"], pairs, cost=cost,
                              cost_budget=budget, progress=progress, **limits,
                              **({} if recipes is None else {"recipes": recipes}))
    _, caa = calibrate_caa(model, tokenizer, pairs, cost=cost, cost_budget=budget)
    band = voice_band(model, tokenizer, spec["text"], pairs, band_prompts(pairs), cost=cost,
                      budget=budget)  # within the prompt's own KV
    with as_path(folder) as shipped:
        out = Path(out) if out is not None else Path(shipped)
        found.selector.save_pretrained(out / "selector")
        recipe = found.selector.config["bank_recipe"]
        spec.update(recipe=found.recipe, exemplars=recipe["exemplars"],
                    counter_exemplars=recipe.get("counter_exemplars", []),
                    sink_reads_banks=found.banks.sink_reads_banks, cost_budget=rule,
                    budget=budget, band=band,
                    caa={"layer": caa["layer"], "scale": caa["scale"]}, trials=found.trials,
                    limits=found.limits)
        if recipes is not None:
            spec["recipes"] = list(recipes)
        write_json(out / "persona.json", spec)
        if out != Path(shipped):
            (out / "pairs.jsonl").write_text(Path(shipped, "pairs.jsonl").read_text())
    return found


def build_selector(model, tokenizer, direction: str, *, top_layers: int = 5,
                   cost_budget: float | None = DEFAULT_COST_BUDGET, progress: bool = True):
    """Calibrate the behavioural selector for a Big Five ``direction`` on the shipped
    calibration pairs, with the target bank built by :func:`persona_bank`: by default the most
    movement within ``cost_budget`` nats per token of neutral text, net of a neutral bank built
    the same way (:mod:`hf_memory.selection.budget_search`); ``cost_budget=None``: the unbudgeted
    search."""
    from hf_memory.banks.bank_set import BankSet
    from hf_memory.banks.neutral_control import neutral_text
    from hf_memory.recipes.calibration_data import calibration_pairs, direction_parts
    from hf_memory.selection.selector import Selector

    _, _, target, _ = direction_parts(direction)
    banks = BankSet([persona_bank(model, tokenizer, target)], model=model)
    control = (BankSet([persona_bank(model, tokenizer, neutral_text(), name="neutral")],
                       model=model) if cost_budget is not None else None)
    pairs, drift = calibration_pairs(direction)
    selector = Selector.calibrate_behavioural(model, tokenizer, banks, pairs, drift_pairs=drift,
                                              top_layers=top_layers, cost_budget=cost_budget,
                                              control_banks=control, validation=0.0,
                                              progress=progress)
    selector.config.update(direction=direction, bank_recipe={**BANK_RECIPE, "text": target})
    return selector


def shipped_persona_name(persona: str) -> str | None:
    """The shipped persona whose name or text is ``persona`` (None: not a shipped one)."""
    return next((name for name in SHIPPED_PERSONAS
                 if persona in (name, persona_json(name)["text"])), None)
