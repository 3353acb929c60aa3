"""The main job (``hf-memory demo``): plain vs visible prompt vs memory-steered answers.

Builds a persona bank from a short descriptor on the embedded model (in the system-message
context, as a visible system prompt would hold it), and steers through the automatic path: the
frozen behavioural selector shipped for the persona in ``data/selectors/<direction>`` (rebuilt by
``hf-memory build-selector``), or one the user gives, or hand-picked layers. Answers a few
prompts three ways and prints them side by side with the KV bytes each way of carrying the
descriptor costs and how much each way's answers repeat themselves (distinct-2, repeated
4-grams: :mod:`~hf_memory.text_quality`). Torch-dependent modules are imported inside the
functions, so the CLI's ``--help`` stays fast.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .calibration import TRAIT_DESCRIPTORS
from .text_quality import repetition

if TYPE_CHECKING:
    from .kv_accounting import KVFootprint

__all__ = ["DEFAULT_PERSONA", "DEFAULT_PROMPTS", "DEFAULT_REFERENCE", "DemoResult",
           "build_selector", "format_demo", "parse_layers", "persona_bank", "run_demo",
           "shipped_selector"]

DEFAULT_PERSONA, DEFAULT_REFERENCE = TRAIT_DESCRIPTORS["N"]  # anxious; calm
DEFAULT_DIRECTION = "N+"
SHIPPED_DIRECTIONS = tuple(f"{trait}{sign}" for trait in "OCEAN" for sign in "+-")
BANK_RECIPE = {"template": "{text}", "context": "system", "gain": 1.0}
DEFAULT_PROMPTS = (
    "How do you feel about your exam tomorrow?",
    "What are your plans for the weekend?",
)
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
                                              control_banks=control, progress=progress)
    selector.config.update(direction=direction, bank_recipe={**BANK_RECIPE, "text": target})
    return selector


def _automatic_selector(model, persona: str):
    for trait, (high, low) in TRAIT_DESCRIPTORS.items():
        for direction, text in ((f"{trait}+", high), (f"{trait}-", low)):
            if text == persona and direction in SHIPPED_DIRECTIONS:
                return shipped_selector(direction, model=model)
    raise ValueError("no frozen selector is shipped for this persona: give layers (hand-picked "
                     "sites) or a selector calibrated for it (hf-memory build-selector, or "
                     "Selector.calibrate_behavioural)")


@dataclass
class DemoResult:
    """Answers per method, the KV accounting of the descriptor, the steered sites, and per
    method the repetition of its answers (:func:`~hf_memory.text_quality.repetition`)."""

    prompts: list[str]
    answers: dict[str, list[str]]
    footprint: KVFootprint
    seconds: dict[str, float]
    sites: dict[int, float]
    quality: dict[str, dict[str, float]] = field(default_factory=dict)
    strength: float = 1.0
    units: dict[int, list[int]] | None = None


def run_demo(
    model,
    tokenizer,
    *,
    persona: str = DEFAULT_PERSONA,
    reference: str | None = None,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    layers: Sequence[int] | None = None,
    gain: float = DEFAULT_GAIN,
    selector=None,
    max_new_tokens: int = 40,
) -> DemoResult:
    """Answer ``prompts`` plain, with ``persona`` added to the system prompt, and memory-steered.

    Sites: ``layers`` (hand-picked, all heads, bank gain ``gain``), else ``selector``, else the
    frozen selector shipped for ``persona`` (the default persona has one).
    """
    from .bank_set import BankSet
    from .chat import generate_chat
    from .kv_accounting import kv_footprint
    from .methods import MemoryMethod, PromptMethod, generate_with

    prompts = list(prompts)
    if layers is not None and selector is not None:
        raise ValueError("give layers or a selector, not both")
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
    methods = {"plain": None, "prompt": PromptMethod(persona, tokenizer=tokenizer),
               "memory": memory}
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
    return DemoResult(prompts, answers, footprint, seconds, sites, quality,
                      strength=selector.strength if selector is not None else 1.0,
                      units=dict(selector.units) if selector is not None else None)


def format_demo(result: DemoResult) -> str:
    """Side-by-side text report of a :class:`DemoResult`."""
    fp = result.footprint
    labels = {
        "plain": "plain",
        "prompt": f"prompt (+{fp.prompt_kv_bytes / 1024:.0f} KiB KV over {fp.num_layers} layers)",
        "memory": f"memory (+{fp.bank_bytes / 1024:.0f} KiB bank at {fp.controlled_layers} layers)",
    }
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
    if result.quality:
        lines.append("repetition: " + "; ".join(
            f"{k} distinct-2 {q['distinct_2']:.2f}, repeated 4-grams {q['repeated_4gram']:.2f}"
            for k, q in result.quality.items()))
    lines.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items()))
    return "\n".join(lines)

