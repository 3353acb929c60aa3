"""The main job (``hf-memory demo``): plain vs visible prompt vs CAA vs memory-steered answers.

The default persona is one the embedded model visibly voices from a prompt (a pirate), shipped
in ``data/personas/<name>/``: its text, its calibration pairs (the model's own replies with and
without the prompt), the lexicon that measures it, and what
:func:`~hf_memory.recipes.shipped.build_persona` calibrated on
those pairs within the persona's cost budget (the pirate's: the visible prompt's own cost, so
the methods are compared at the prompt's price) — the memory selector with its bank recipe
(:func:`hf_memory.recipes.persona.calibrate_persona`), its voice band (the descriptor at the
upper layers, chosen by a reply judge: :func:`hf_memory.recipes.voice_band.voice_band`) and
CAA's layer and scale (:func:`hf_memory.recipes.persona.calibrate_caa`). The Big Five
descriptors steer through the frozen selectors of ``data/selectors/<direction>``
(``hf-memory build-selector``); any other persona through a selector the user gives, or
hand-picked layers. The replies are printed side by side
with the KV bytes each method carries, the share of the persona's own words in them
(:func:`~hf_memory.metrics.text_quality.lexicon_rate`) and how much they repeat themselves.
Torch-dependent modules are imported inside the functions, so the CLI's ``--help`` stays fast.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf_memory.metrics.text_quality import lexicon_rate, repetition
from hf_memory.recipes.calibration_data import DEFAULT_PROMPTS, TRAIT_DESCRIPTORS
from hf_memory.recipes.shipped import (
    BANK_RECIPE,
    DEMO_PERSONA,
    SHIPPED_DIRECTIONS,
    persona_bank,
    persona_json,
    shipped_persona,
    shipped_persona_name,
    shipped_selector,
)
from hf_memory.selection.defaults import DEFAULT_COST_BUDGET

if TYPE_CHECKING:
    from hf_memory.metrics.kv_accounting import KVFootprint

__all__ = ["DEFAULT_PERSONA", "DEFAULT_PROMPTS", "DEFAULT_REFERENCE", "DemoResult", "format_demo",
           "run_demo"]

DEFAULT_PERSONA, DEFAULT_REFERENCE = TRAIT_DESCRIPTORS["N"]  # anxious; calm
DEFAULT_DIRECTION = "N+"
DEFAULT_GAIN = 2.0  # bank gain when layers are hand-picked


def _automatic_selector(model, persona: str):
    for trait, (high, low) in TRAIT_DESCRIPTORS.items():
        for direction, text in ((f"{trait}+", high), (f"{trait}-", low)):
            if text == persona and direction in SHIPPED_DIRECTIONS:
                return shipped_selector(direction, model=model)
    raise ValueError("no frozen selector is shipped for this persona: give layers (hand-picked "
                     "sites) or a selector calibrated for it (hf-memory persona, or "
                     "hf_memory.recipes.persona.calibrate_persona)")


@dataclass
class DemoResult:
    """Answers per method, the KV accounting of the descriptor (``band_footprint``: of a
    shipped persona's voice band, when it has one), the steered sites, and per
    method the repetition of its answers (:func:`~hf_memory.metrics.text_quality.repetition`), its
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
    band_footprint: KVFootprint | None = None


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
    persona's) and memory-steered (the selector's sites; a shipped persona's voice band beside
    them, when it has one: :func:`~hf_memory.recipes.voice_band.voice_band`).

    ``persona``: a shipped persona's name or text (its calibrated recipe, selector and CAA), or
    any descriptor. Sites: ``layers`` (hand-picked, all heads, the descriptor bank at gain
    ``gain``), else ``selector``, else the frozen selector shipped for ``persona``.
    """
    from hf_memory.banks.bank_set import BankSet
    from hf_memory.baselines.methods import MemoryMethod, PromptMethod, generate_with
    from hf_memory.chat.generation import chat_messages, generate_chat
    from hf_memory.metrics.kv_accounting import kv_footprint
    from hf_memory.metrics.steering_cost import NeutralCost

    prompts = list(prompts)
    for prompt in prompts:  # bad input is refused before any bank is built
        chat_messages(prompt)
    if layers is not None and selector is not None:
        raise ValueError("give layers or a selector, not both")
    shipped = shipped_persona_name(persona)
    caa, lexicon, details = None, None, {}
    if shipped is not None and (layers is not None or selector is not None):
        spec = persona_json(shipped)
        persona, lexicon, shipped = spec["text"], spec.get("lexicon"), None
    if shipped is not None:
        bank_set, selector, caa, spec = shipped_persona(model, tokenizer, shipped)
        persona, lexicon = spec["text"], spec.get("lexicon")
        details["memory"] = f"{spec['recipe']} recipe"
        if spec.get("budget") is not None:
            details["budget"] = (f"{spec['budget']:.3f}" + (", the visible prompt's own cost"
                                                            if spec.get("cost_budget") == "prompt"
                                                            else ""))
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
    band = spec.get("band") if shipped is not None else None
    if band:
        from hf_memory.recipes.persona import persona_banks
        from hf_memory.recipes.voice_band import band_banks

        band_set = band_banks(persona_banks(model, tokenizer, persona, recipe="prompt_like",
                                            sink_reads_banks=False), band.get("slots"))
        methods["band"] = MemoryMethod(band_set, layers=band["layers"],
                                       layer_gains=dict.fromkeys(band["layers"], band["rho"]))
        slots = ("" if band.get("slots") is None
                 else f", {len(band['slots'])} of {band_set.banks[0].provenance['slots_of']} "
                      "slots")
        details["band"] = (f"layers {band['layers'][0]}-{band['layers'][-1]}, "
                           f"rho {band['rho']:g}, prompt_like{slots}")
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
    band_footprint = (kv_footprint(model, band_set, descriptor_ids, layers=band["layers"])
                      if band else None)
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
                      persona=persona, details=details,
                      band_footprint=band_footprint)


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
    if result.band_footprint is not None:
        band = result.band_footprint
        labels["band"] = (f"memory, voice band (+{band.bank_bytes / 1024:.0f} KiB bank at "
                          f"{band.controlled_layers} layers, {result.details.get('band', '')})")
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
        budget = result.details.get("budget", f"{DEFAULT_COST_BUDGET:g}")
        lines.append(f"cost (ΔNLL per token of neutral text; memory and CAA calibrated within "
                     f"{budget}): "
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
