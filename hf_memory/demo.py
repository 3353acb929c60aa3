"""The main job (``hf-memory demo``): plain vs visible prompt vs CAA vs memory-steered answers.

The default persona is one the embedded model visibly voices from a prompt (a pirate), shipped
in ``data/personas/<name>/``: its text, its calibration pairs (the model's own replies with and
without the prompt), the lexicon that measures it, and what :func:`build_persona` calibrated on
those pairs within the cost budget — the memory selector with its bank recipe
(:func:`hf_memory.persona.calibrate_persona`) and CAA's layer and scale
(:func:`hf_memory.persona.calibrate_caa`). The Big Five descriptors steer through the frozen
selectors of ``data/selectors/<direction>`` (``hf-memory build-selector``); any other persona
through a selector the user gives, or hand-picked layers. The replies are printed side by side
with the KV bytes each method carries, the share of the persona's own words in them
(:func:`~hf_memory.text_quality.lexicon_rate`) and how much they repeat themselves.
Torch-dependent modules are imported inside the functions, so the CLI's ``--help`` stays fast.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .calibration import TRAIT_DESCRIPTORS
from .text_quality import lexicon_rate, repetition

if TYPE_CHECKING:
    from .kv_accounting import KVFootprint

__all__ = ["DEFAULT_PERSONA", "DEFAULT_PROMPTS", "DEFAULT_REFERENCE", "DEMO_PERSONA",
           "DemoResult", "build_persona", "build_selector", "format_demo", "parse_layers",
           "persona_bank", "run_demo", "shipped_persona", "shipped_selector"]

DEFAULT_PERSONA, DEFAULT_REFERENCE = TRAIT_DESCRIPTORS["N"]  # anxious; calm
DEFAULT_DIRECTION = "N+"
SHIPPED_DIRECTIONS = tuple(f"{trait}{sign}" for trait in "OCEAN" for sign in "+-")
BANK_RECIPE = {"template": "{text}", "context": "system", "gain": 1.0}
DEFAULT_PROMPTS = (
    "How do you feel about your exam tomorrow?",
    "What are your plans for the weekend?",
)
SHIPPED_PERSONAS = ("pirate",)
DEMO_PERSONA = "pirate"  # a persona the embedded model voices from a visible prompt
DEFAULT_GAIN = 2.0  # bank gain when layers are hand-picked
DEFAULT_COST_BUDGET = 0.1  # nats per token of neutral text (hf_memory.budget_search)


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


def persona_bank(model, tokenizer, text: str, *, role: str = "target", name: str = "persona",
                 layers: Sequence[int] | None = None, gain: float = BANK_RECIPE["gain"]):
    """The demo's and the shipped selectors' bank recipe: ``text`` as a system message."""
    from .banks import MemoryBank

    return MemoryBank.from_text(model, tokenizer, text, role=role, name=name, layers=layers,
                                template=BANK_RECIPE["template"],
                                context=BANK_RECIPE["context"], gain=gain)


def selectors_dir():
    from importlib import resources

    return resources.files(__package__).joinpath("data", "selectors")


def shipped_selector(direction: str, model=None):
    """The frozen behavioural selector shipped for a Big Five ``direction`` (e.g. ``"N+"``)."""
    from .selector import Selector

    if direction not in SHIPPED_DIRECTIONS:
        raise ValueError(f"no selector is shipped for {direction!r}; shipped: "
                         f"{', '.join(SHIPPED_DIRECTIONS)} (build one with hf-memory "
                         "build-selector)")
    with _as_path(selectors_dir().joinpath(direction)) as path:
        return Selector.from_pretrained(path, model=model)


def _as_path(traversable):
    from importlib import resources

    return resources.as_file(traversable)


def _persona_dir(name: str):
    from importlib import resources

    if name not in SHIPPED_PERSONAS:
        raise ValueError(f"no persona {name!r} is shipped; shipped: {', '.join(SHIPPED_PERSONAS)}")
    return resources.files(__package__).joinpath("data", "personas", name)


def _persona_json(name: str) -> dict:
    import json

    return json.loads(_persona_dir(name).joinpath("persona.json").read_text())


def persona_spec(name: str) -> dict:
    """A shipped persona's ``persona.json`` (text, lexicon, and what :func:`build_persona`
    calibrated) with its calibration pairs (``pairs``)."""
    from .pairs import read_pairs

    folder = _persona_dir(name)
    spec = _persona_json(name)
    with _as_path(folder.joinpath("pairs.jsonl")) as path:
        spec["pairs"] = read_pairs(path)
    return spec


def shipped_persona(model, tokenizer, name: str = DEMO_PERSONA):
    """``(banks, selector, CAA method or None, spec)`` of a shipped persona: the banks rebuilt by
    the calibrated recipe, the frozen selector, CAA at the calibrated layer and scale."""
    from .caa import CAAVectors
    from .methods import CAAMethod
    from .persona import persona_banks
    from .selector import Selector

    spec = persona_spec(name)
    if "recipe" not in spec:
        raise ValueError(f"persona {name!r} is not calibrated yet: run hf-memory build-selector "
                         f"--persona {name}")
    banks = persona_banks(model, tokenizer, spec["text"], recipe=spec["recipe"],
                          exemplars=spec.get("exemplars", ()))
    with _as_path(_persona_dir(name).joinpath("selector")) as path:
        selector = Selector.from_pretrained(path, model=model)
    caa = None
    if spec.get("caa", {}).get("layer") is not None:
        vectors = CAAVectors.extract(model, tokenizer, [(f"{p} {t}", f"{p} {r}")
                                                        for p, t, r in spec["pairs"]],
                                     layers=[spec["caa"]["layer"]])
        caa = CAAMethod(vectors, scale=spec["caa"]["scale"])
    return banks, selector, caa, spec


def build_persona(model, tokenizer, name: str = DEMO_PERSONA, *, out=None,
                  recipes: Sequence[str] | None = None, progress: bool = True):
    """Calibrate a shipped persona on its pairs within the default budget: memory by
    :func:`~hf_memory.persona.calibrate_persona`, CAA by :func:`~hf_memory.persona.
    calibrate_caa`; writes the selector and the choices into ``out`` (default: the package's
    own folder); ``recipes``: the bank recipes to try (default: calibrate_persona's). Returns
    the :class:`~hf_memory.persona.PersonaSteering`."""
    from pathlib import Path

    from .atomic_files import write_json
    from .persona import calibrate_caa, calibrate_persona
    from .steering_cost import NeutralCost

    spec = persona_spec(name)
    pairs, folder = spec.pop("pairs"), _persona_dir(name)
    cost = NeutralCost(model, tokenizer)
    found = calibrate_persona(model, tokenizer, spec["text"], pairs, cost=cost,
                              progress=progress,
                              **({} if recipes is None else {"recipes": recipes}))
    _, caa = calibrate_caa(model, tokenizer, pairs, cost=cost)
    with _as_path(folder) as shipped:
        out = Path(out) if out is not None else Path(shipped)
        found.selector.save_pretrained(out / "selector")
        recipe = found.selector.config["bank_recipe"]
        spec.update(recipe=found.recipe, exemplars=recipe["exemplars"],
                    caa={"layer": caa["layer"], "scale": caa["scale"]}, trials=found.trials)
        write_json(out / "persona.json", spec)
        if out != Path(shipped):
            (out / "pairs.jsonl").write_text(Path(shipped, "pairs.jsonl").read_text())
    return found


def build_selector(model, tokenizer, direction: str, *, top_layers: int = 5,
                   cost_budget: float | None = DEFAULT_COST_BUDGET, progress: bool = True):
    """Calibrate the behavioural selector for a Big Five ``direction`` on the shipped
    calibration pairs, with the target bank built by :func:`persona_bank`: by default the most
    movement within ``cost_budget`` nats per token of neutral text, net of a neutral bank built
    the same way (:mod:`hf_memory.budget_search`); ``cost_budget=None``: the unbudgeted search."""
    from .bank_set import BankSet
    from .calibration import calibration_pairs, direction_parts, neutral_text
    from .selector import Selector

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


def _automatic_selector(model, persona: str):
    for trait, (high, low) in TRAIT_DESCRIPTORS.items():
        for direction, text in ((f"{trait}+", high), (f"{trait}-", low)):
            if text == persona and direction in SHIPPED_DIRECTIONS:
                return shipped_selector(direction, model=model)
    raise ValueError("no frozen selector is shipped for this persona: give layers (hand-picked "
                     "sites) or a selector calibrated for it (hf-memory persona, or "
                     "hf_memory.persona.calibrate_persona)")


def _shipped_persona_name(persona: str) -> str | None:
    return next((name for name in SHIPPED_PERSONAS
                 if persona in (name, _persona_json(name)["text"])), None)


@dataclass
class DemoResult:
    """Answers per method, the KV accounting of the descriptor, the steered sites, and per
    method the repetition of its answers (:func:`~hf_memory.text_quality.repetition`), its
    cost on neutral text (``cost``) and, for a persona with a lexicon, the share of its words
    (``persona_words``)."""

    prompts: list[str]
    answers: dict[str, list[str]]
    footprint: KVFootprint
    seconds: dict[str, float]
    sites: dict[int, float]
    quality: dict[str, dict[str, float]] = field(default_factory=dict)
    strength: float = 1.0
    units: dict[int, list[int]] | None = None
    persona: str = ""
    details: dict[str, str] = field(default_factory=dict)


def run_demo(
    model,
    tokenizer,
    *,
    persona: str = DEMO_PERSONA,
    reference: str | None = None,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    layers: Sequence[int] | None = None,
    gain: float = DEFAULT_GAIN,
    selector=None,
    max_new_tokens: int = 40,
) -> DemoResult:
    """Answer ``prompts`` plain, with ``persona`` as the system prompt, with CAA (a shipped
    persona's) and memory-steered.

    ``persona``: a shipped persona's name or text (its calibrated recipe, selector and CAA), or
    any descriptor. Sites: ``layers`` (hand-picked, all heads, the descriptor bank at gain
    ``gain``), else ``selector``, else the frozen selector shipped for ``persona``.
    """
    from .bank_set import BankSet
    from .chat import chat_messages, generate_chat
    from .kv_accounting import kv_footprint
    from .methods import MemoryMethod, PromptMethod, generate_with
    from .steering_cost import NeutralCost

    prompts = list(prompts)
    for prompt in prompts:  # bad input is refused before any bank is built
        chat_messages(prompt)
    if layers is not None and selector is not None:
        raise ValueError("give layers or a selector, not both")
    shipped = _shipped_persona_name(persona)
    caa, lexicon, details = None, None, {}
    if shipped is not None and (layers is not None or selector is not None):
        spec = _persona_json(shipped)
        persona, lexicon, shipped = spec["text"], spec.get("lexicon"), None
    if shipped is not None:
        bank_set, selector, caa, spec = shipped_persona(model, tokenizer, shipped)
        persona, lexicon = spec["text"], spec.get("lexicon")
        details["memory"] = f"{spec['recipe']} recipe"
        if caa is not None:
            details["caa"] = f"layer {spec['caa']['layer']}, scale {spec['caa']['scale']:g}"
    else:
        if layers is None and selector is None:
            selector = _automatic_selector(model, persona)
        bank_gain = gain if layers is not None else BANK_RECIPE["gain"]
        banks = [persona_bank(model, tokenizer, persona, layers=layers, gain=bank_gain)]
        if reference:
            banks.append(persona_bank(model, tokenizer, reference, role="reference",
                                      name="reference", layers=layers, gain=bank_gain))
        bank_set = BankSet(banks, model=model)
    memory = (MemoryMethod(bank_set, selector) if selector is not None
              else MemoryMethod(bank_set, layers=list(layers)))
    sites = (dict(selector.layer_gains) if selector is not None
             else dict.fromkeys(layers, 1.0))
    methods = {"plain": None, "prompt": PromptMethod(persona, tokenizer=tokenizer)}
    if caa is not None:
        methods["caa"] = caa
    methods["memory"] = memory
    answers, seconds = {}, {}
    for name, method in methods.items():
        start = time.perf_counter()
        answers[name] = (generate_chat(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
                         if method is None else
                         generate_with(method, model, tokenizer, prompts,
                                       max_new_tokens=max_new_tokens))
        seconds[name] = time.perf_counter() - start
    descriptor_ids = tokenizer(persona, return_tensors="pt", add_special_tokens=False).input_ids
    footprint = kv_footprint(model, bank_set, descriptor_ids, layers=sorted(sites))
    quality = {name: repetition(replies) for name, replies in answers.items() if replies}
    neutral = NeutralCost(model, tokenizer)
    for name, method in methods.items():
        quality.setdefault(name, {})["cost"] = 0.0 if method is None else neutral.measure(method)
    if lexicon:
        for name, replies in answers.items():
            quality.setdefault(name, {})["persona_words"] = lexicon_rate(replies, lexicon)
    return DemoResult(prompts, answers, footprint, seconds, sites, quality,
                      strength=selector.strength if selector is not None else 1.0,
                      units=dict(selector.units) if selector is not None else None,
                      persona=persona, details=details)


def format_demo(result: DemoResult) -> str:
    """Side-by-side text report of a :class:`DemoResult`."""
    fp = result.footprint
    labels = {
        "plain": "plain",
        "prompt": f"prompt (+{fp.prompt_kv_bytes / 1024:.0f} KiB KV over {fp.num_layers} layers)",
        "caa": f"CAA ({result.details.get('caa', '')})",
        "memory": f"memory (+{fp.bank_bytes / 1024:.0f} KiB bank at {fp.controlled_layers} layers"
                  + (f", {result.details['memory']}" if "memory" in result.details else "")
                  + ")",
    }
    labels = {k: v for k, v in labels.items() if k in result.answers}
    lines = ["steered sites (layer: gain): " + ", ".join(f"{layer}: {gain:g}"
                                                          for layer, gain in result.sites.items())
             + f"; strength {result.strength:g}"
             + (f"; units {result.units}" if result.units else "")]
    for i, prompt in enumerate(result.prompts):
        lines.append(f"\nUser: {prompt}")
        for method, label in labels.items():
            lines.append(f"  [{label}] {result.answers[method][i]}")
    lines.append(
        f"\nKV for the descriptor: visible prompt {fp.prompt_tokens} tokens x {fp.num_layers} "
        f"layers = {fp.prompt_kv_bytes:,} bytes; bank {fp.bank_slots} slots x "
        f"{fp.controlled_layers} layers = {fp.bank_bytes:,} bytes; ratio {fp.actual_ratio:.1f}x "
        f"(idealised L*T/(L_ctrl*S) = {fp.idealised_ratio:.1f}x)")
    if any("cost" in q for q in result.quality.values()):
        lines.append("cost (ΔNLL per token of neutral text; the selectors' budget is 0.1): "
                     + "; ".join(f"{k} {q['cost']:+.3f}" for k, q in result.quality.items()
                                 if "cost" in q))
    if any("persona_words" in q for q in result.quality.values()):
        lines.append("persona words (share of the replies' words in the persona's lexicon): "
                     + "; ".join(f"{k} {q['persona_words']:.3f}"
                                 for k, q in result.quality.items() if "persona_words" in q))
    if result.quality:
        lines.append("repetition: " + "; ".join(
            f"{k} distinct-2 {q['distinct_2']:.2f}, repeated 4-grams {q['repeated_4gram']:.2f}"
            for k, q in result.quality.items() if "distinct_2" in q))
    lines.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items()))
    return "\n".join(lines)
