"""A user's own persona in one call: bank recipes, the budgeted search, the recipe that holds.

Three recipes turn a persona text into banks (:data:`RECIPES`):

- ``descriptor``: the paper's bank (eq. 6): the text's tokens as a system message, slots without
  position, size-normalised evidence (eq. 9), the dial the strength at ρ = 1. What the shipped
  Big Five selectors use.
- ``prompt_like``: the same slots placed where a visible system prompt's keys would sit, just
  before the conversation, in concatenated attention (no size normalisation, no bias at ρ = 0).
  At every layer this is close to the visible prompt (less its chat markers; the template's
  default system prompt stays); the budgeted search trades layers and KV groups for movement,
  and pushes ρ above 0 where the cost allows.
- ``exemplars``: ``prompt_like`` over the text followed by example replies in the persona's
  voice (the target replies of some of the user's pairs, which the search then does not score):
  a small model imitates examples far better than it follows a description.
- ``contrast``: two ``exemplars`` banks, the text followed by the persona's replies (target) and
  by the replies without it (reference) to the same prompts, steering by the difference of their
  mixtures (:attr:`~hf_memory.banks.bank_set.BankSet.contrast`): what the two share (the text, the
  reply form) cancels, so a nat of neutral cost buys more movement (measured in BENCHMARKS.md).

Every recipe's banks keep the conversation's first token, the model's attention sink, off the
slots by default (``sink_reads_banks=False``): beside a visible prompt it reads nothing but
itself, and reading slots placed before it costs the embedded model up to 1.6 nats per neutral
token at ρ = 0 (``hf_memory/README.md``).

:func:`calibrate_persona` builds each recipe, calibrates a budgeted behavioural selector for it
(:meth:`~hf_memory.selection.selector.Selector.calibrate_behavioural`: the most movement within the
cost
budget, net of a neutral control built by the same recipe, sites that do not hold on a
validation split dropped) and keeps the recipe whose validation movement is largest. By default
the recipes are screened first (each one's best single layer among the full search's single
layers in the upper 60 % of the depth, on the pairs the full search scores) and only the best is
searched fully, reusing what the screen measured of its dial and its scores
(:class:`~hf_memory.selection.budget_search.DialProbes`).

Two ceilings keep the economy the paper sells (both on by default, both lifted by ``None``):

- **KV**: the banks at the chosen sites carry at most ``kv_ceiling`` (¼ by default) of the KV
  memory the same text takes as a visible prompt (its tokens at every layer). The recipes with
  exemplars take as many as let three KV heads of their banks fit (a guess: fewer sites than
  three rarely move anything, BENCHMARKS.md), and the search only scores sites within it.
- **capability**: a dial setting is within budget only when the factual answers of
  :mod:`~hf_memory.metrics.factual` (the ``search`` half) lose no more than the visible prompt of
  the same text costs them, plus :data:`CAPABILITY_SLACK` nats per answer (a guess: the
  prompt's own cost is often nil or a gain, and a ceiling at exactly zero leaves no room for
  any steering at all).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from hf_memory.artifacts.atomic_files import write_json
from hf_memory.banks.bank_set import BankSet
from hf_memory.metrics.factual import AnswerCost
from hf_memory.metrics.kv_accounting import prompt_kv_bytes
from hf_memory.metrics.likelihood import check_pairs
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.persona_recipes import DEFAULT_RECIPES, RECIPES, check_recipes
from hf_memory.recipes.recipe_banks import exemplar_text, persona_banks
from hf_memory.selection.behavioural_calibration import split_pairs, validation_split
from hf_memory.selection.budget_search import DEFAULT_COST_BUDGET, DialProbes
from hf_memory.selection.defaults import CAPABILITY_SLACK, DEFAULT_KV_CEILING
from hf_memory.selection.search_types import VALIDATION_FRACTION
from hf_memory.selection.selector import Selector

__all__ = ["CAA_LAYERS", "CAA_SCALES", "CAPABILITY_SLACK", "DEFAULT_KV_CEILING",
           "DEFAULT_RECIPES", "RECIPES", "PersonaFormatError", "PersonaSteering", "calibrate_caa",
           "calibrate_persona", "exemplar_text", "judge_replies", "persona_banks"]

MAX_EXEMPLARS = 8
MIN_KV_HEADS = 3  # the exemplar count leaves room for this many KV heads of the banks
JUDGED_PROMPTS = 8  # of the pairs' prompts, answered by each method for the reply judge
# the recipe screen scores the full search's single layers from this fraction of the depth up
SCREEN_FROM = 0.4
REPORT_NAME = "persona.json"
CAA_LAYERS = (0.2, 1 / 3, 0.47, 0.6)  # fractions of the depth: layers 6, 10, 14, 18 of 30
CAA_SCALES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


class PersonaFormatError(ValueError):
    """A persona folder's ``persona.json`` is missing, corrupt or malformed."""


@dataclass
class PersonaSteering:
    """What :func:`calibrate_persona` found: the chosen recipe's banks and selector, and every
    recipe's trial (calibration and validation movement, cost, KV, sites), the ceilings it ran
    under (``limits``), its replies judged against the plain model's and the visible
    prompt's (``judged``, :func:`judge_replies`) and, when the call looked for one, its voice
    band (``voice``: :func:`~hf_memory.recipes.voice_band.voice_band`'s record, ``kept`` when
    the banks and selector are the band's)."""

    banks: BankSet
    selector: Selector
    recipe: str
    trials: list[dict[str, Any]] = field(default_factory=list)
    limits: dict[str, Any] = field(default_factory=dict)
    judged: dict[str, Any] | None = None
    voice: dict[str, Any] | None = None

    def method(self, strength: float = 1.0):
        """A :class:`~hf_memory.baselines.methods.MemoryMethod` steering with it."""
        from hf_memory.baselines.methods import MemoryMethod

        return MemoryMethod(self.banks, self.selector, strength=strength)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """``directory``: the bank set, ``selector/`` the selector, ``persona.json`` the
        trials (the layout ``hf-memory chat --banks DIR --selector DIR/selector`` reads)."""
        directory = Path(directory)
        self.banks.save_pretrained(directory)
        self.selector.save_pretrained(directory / "selector")
        write_json(directory / REPORT_NAME, {"recipe": self.recipe, "trials": self.trials,
                                             "limits": self.limits, "judged": self.judged,
                                             "voice": self.voice})
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, model=None) -> PersonaSteering:
        """Load a persona folder written by :meth:`save_pretrained` (with ``model``: checked
        against it).

        Raises:
            PersonaFormatError: ``persona.json`` is missing, not JSON, or an entry has the wrong
                type (``recipe`` one of :data:`RECIPES`, ``trials`` a list of objects,
                ``limits`` an object, ``judged`` and ``voice`` objects or null). It has no
                content hash: a
                well-formed edit of its trials loads as written.
            BankSetFormatError: the folder's bank set is missing or corrupt.
            SelectorFormatError: its ``selector/`` is missing or corrupt.
            FingerprintMismatchError: (with ``model``) they were made for another model.
        """
        directory = Path(directory)
        path = directory / REPORT_NAME
        try:
            report = json.loads(path.read_text())
        except OSError as error:
            raise PersonaFormatError(f"{path} is unreadable: {error}") from None
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
            raise PersonaFormatError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(report, dict) or not isinstance(report.get("recipe"), str) or (
                report["recipe"] not in RECIPES):
            raise PersonaFormatError(f"{path} is not a persona report: its recipe must be one "
                                     f"of {sorted(RECIPES)}")
        trials, limits = report.get("trials"), report.get("limits", {})
        judged, voice = report.get("judged"), report.get("voice")
        if not isinstance(trials, list) or not all(isinstance(t, dict) for t in trials) or (
                not isinstance(limits, dict)) or not all(
                    entry is None or isinstance(entry, dict) for entry in (judged, voice)):
            raise PersonaFormatError(f"{path}: trials must be a list of objects, limits an "
                                     "object, judged and voice objects or null")
        return cls(BankSet.from_pretrained(directory, model=model),
                   Selector.from_pretrained(directory / "selector", model=model),
                   report["recipe"], trials, limits, judged, voice)


def _trial(recipe: str, selector: Selector, exemplars: int, prompt_bytes: int
           ) -> dict[str, Any]:
    config = selector.config
    best = config["best"]
    check = config.get("validation") or {}
    return {"recipe": recipe, "layers": selector.layers,
            "units": {str(k): v for k, v in selector.units.items()},
            "strength": selector.strength, "gain": best.get("gain"),
            "cost": best.get("cost"), "capability": best.get("capability"),
            "kv_bytes": config["kv_bytes"], "kv_fraction": config["kv_bytes"] / prompt_bytes,
            "calibration_target": best["target"],
            "validation_target": check.get("kept_validation_target"),
            "validation": check or None, "exemplars": exemplars,
            "search_pairs": config["search_pairs"], "validation_pairs": check.get("pairs", 0)}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _limits(model, tokenizer, text: str, kv_ceiling: Any, capability_ceiling: Any,
            batch_size: int) -> dict[str, Any]:
    """The call's ceilings in the search's units (see the module docstring)."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    limits: dict[str, Any] = {"prompt_kv_bytes": prompt_kv_bytes(model, ids),
                              "kv_fraction": None, "kv_ceiling": None, "capability": None,
                              "capability_ceiling": None, "prompt_capability": None}
    if kv_ceiling is not None:
        fraction = _number("kv_ceiling", kv_ceiling)
        if fraction <= 0:
            raise ValueError(f"kv_ceiling is a fraction of the prompt's KV above 0 (or None), "
                             f"got {kv_ceiling!r}")
        limits.update(kv_fraction=fraction,
                      kv_ceiling=int(fraction * limits["prompt_kv_bytes"]))
    if capability_ceiling is not None:
        if capability_ceiling != "prompt":
            _number("capability_ceiling", capability_ceiling)
        from hf_memory.baselines.methods import PromptMethod

        cost = AnswerCost(model, tokenizer, batch_size=batch_size)
        prompt_cost = cost.measure(PromptMethod(text, tokenizer=tokenizer))
        ceiling = (max(prompt_cost, 0.0) + CAPABILITY_SLACK if capability_ceiling == "prompt"
                   else float(capability_ceiling))
        limits.update(capability=cost, capability_ceiling=ceiling,
                      prompt_capability=prompt_cost)
    return limits


def _expected_trials(model, recipes: Sequence[str], top_layers: int, screen: bool,
                     search: dict[str, Any]) -> int:
    """The configurations a call scores at most (the progress bar's total; its ETA): the
    screen's single layers per recipe, then per recipe searched the screened layers, the
    additions, the units removed one at a time, the validation split's drops and the
    every-layer trial."""
    config = model.config
    singles = len(_single_layers(model, search))
    kept = min(top_layers, singles)
    grouped = config.num_key_value_heads < config.num_attention_heads
    units = config.num_key_value_heads if grouped else config.num_attention_heads
    full = singles + kept - 1 + kept * units + kept + 2
    count = len(dict.fromkeys(recipes))
    if screen and count > 1:
        return count * (len(_screen_layers(model, search)) + 1) + full
    return count * full


def _single_layers(model, search: dict[str, Any]) -> list[int]:
    """The layers the full search scores alone (its stage 1: every ``layer_stride``-th
    candidate)."""
    candidates = sorted(set(search.get("candidate_layers")
                            or range(model.config.num_hidden_layers)))
    return candidates[::search.get("layer_stride", 3)]


def _screen_layers(model, search: dict[str, Any]) -> list[int]:
    """The layers the recipe screen scores alone: the full search's single layers from
    :data:`SCREEN_FROM` of the depth up (all of them where none is that high). A guess from
    the full searches recorded so far: their best single layer lay there in 22 of 24 (the two
    others, Big Five selectors made with the first token reading the banks, scored +0.01 and
    −0.23 there; personas page, "The recipe screen on the upper layers")."""
    singles = _single_layers(model, search)
    upper = [layer for layer in singles if layer >= SCREEN_FROM * model.config.num_hidden_layers]
    return upper or singles


def _exemplar_count(model, tokenizer, text: str, recipe: str, pairs, count: int,
                    kv_ceiling: int | None, sink_reads_banks: bool):
    """``(scored pairs, exemplar pairs, banks)`` with the most exemplars (up to ``count``)
    whose banks leave room for :data:`MIN_KV_HEADS` KV heads under ``kv_ceiling``."""
    while True:
        scored, examples = split_pairs(pairs, count)
        banks = persona_banks(model, tokenizer, text, recipe=recipe,
                              exemplars=[t for _, t, _ in examples],
                              counter_exemplars=[r for _, _, r in examples],
                              sink_reads_banks=sink_reads_banks)
        per_head = banks.head_bytes()
        if kv_ceiling is None or count == 1 or MIN_KV_HEADS * per_head <= kv_ceiling:
            return scored, examples, banks
        count -= 1


def _recipe_banks(model, tokenizer, text: str, recipe: str, pairs, max_exemplars: int,
                  kv_ceiling: int | None, sink_reads_banks: bool,
                  objectives: dict[tuple, Any]) -> dict[str, Any]:
    """``{"recipe", "banks", "scored" (pairs to calibrate on), "examples" (exemplar pairs),
    "probes"}``, or ``{"recipe", "skipped": why}`` when one KV head of its banks is over
    ``kv_ceiling``. ``objectives``: the plain passes every recipe's probes share (the recipes
    with exemplars hold out the same pairs)."""
    examples: list = []
    scored = pairs
    if RECIPES[recipe]["exemplars"]:
        count = min(max_exemplars, len(pairs) // 3)
        if count < 1:
            raise ValueError(f"the {recipe} recipe needs at least 3 pairs, got {len(pairs)}")
        scored, examples, banks = _exemplar_count(model, tokenizer, text, recipe, pairs, count,
                                                  kv_ceiling, sink_reads_banks)
    else:
        banks = persona_banks(model, tokenizer, text, recipe=recipe,
                              sink_reads_banks=sink_reads_banks)
    per_head = banks.head_bytes()
    if kv_ceiling is not None and per_head > kv_ceiling:
        return {"recipe": recipe, "skipped": f"one KV head of its banks at one layer is "
                                             f"{per_head} bytes, over the KV ceiling of "
                                             f"{kv_ceiling}"}
    return {"recipe": recipe, "banks": banks, "scored": scored, "examples": examples,
            # the screen's measurements, reused by the full search
            "probes": DialProbes(objectives=objectives)}


def _screened(model, tokenizer, built: list[dict[str, Any]], bar, limited: dict[str, Any],
              search: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The recipe whose best single layer (:func:`_screen_layers`, within the same ceilings)
    scores highest, and a record of each other one. Each recipe is screened on the pairs its
    full search will score (its calibration pairs less the validation split), so the full
    search of the recipe kept reads the screen's single layers from its probes."""
    cheap = {**search, "candidate_layers": _screen_layers(model, search), "layer_stride": 1,
             "unit_search": False, "validation": 0, "every_layer": False}
    scores = []
    for entry in built:
        bar.set_description(f"persona calibration: screening {entry['recipe']}", refresh=False)
        searched, _ = validation_split(entry["scored"],
                                       search.get("validation", VALIDATION_FRACTION))
        selector = Selector.calibrate_behavioural(model, tokenizer, entry["banks"], searched,
                                                  top_layers=1, **limited,
                                                  probes=entry["probes"], **cheap)
        scores.append(selector.config["best"]["score"])
    best = max(range(len(built)), key=scores.__getitem__)
    others = [{"recipe": entry["recipe"], "screened": score,
               "skipped": f"screened out: its best single layer scored {score:+.2f} against "
                          f"{built[best]['recipe']}'s {scores[best]:+.2f}"}
              for i, (entry, score) in enumerate(zip(built, scores, strict=True)) if i != best]
    return [{**built[best], "screened": scores[best]}], others


def calibrate_persona(model, tokenizer, text: str, pairs: Sequence[tuple[str, str, str]], *,
                      recipes: Sequence[str] = DEFAULT_RECIPES,
                      cost_budget: float = DEFAULT_COST_BUDGET, top_layers: int = 6,
                      max_exemplars: int = MAX_EXEMPLARS,
                      kv_ceiling: float | None = DEFAULT_KV_CEILING,
                      capability_ceiling: float | str | None = "prompt", judge: bool = True,
                      screen: bool = True, progress: bool = True,
                      sink_reads_banks: bool = False, voice: bool = False,
                      voice_budget: float | str = "prompt",
                      **search: Any) -> PersonaSteering:
    """Banks and a frozen selector for the persona ``text``, calibrated on ``pairs``
    (``(prompt, reply in the persona, reply without it)``, ~20 or more).

    Each recipe of ``recipes`` is calibrated within ``cost_budget`` (``**search`` goes to
    :meth:`~hf_memory.selection.selector.Selector.calibrate_behavioural`); the ``exemplars`` recipe
    takes
    the target replies of up to ``max_exemplars`` pairs (a third at most, spread over the list)
    as its examples and is calibrated on the other pairs; the ``contrast`` recipe takes the same
    pairs' target and reference replies for its two banks. The recipe kept is the one whose
    sites move the validation pairs furthest (net of the neutral control; the calibration
    movement where no validation split was possible).

    ``kv_ceiling``: the most KV memory the banks at the chosen sites may carry, as a fraction of
    ``text``'s KV as a visible prompt (None: no ceiling). ``capability_ceiling``: nats per
    factual answer a setting may cost (``"prompt"``: the visible prompt's own cost plus
    :data:`CAPABILITY_SLACK`; None: not charged). See the module docstring. ``judge``: judge the
    kept steering's greedy replies (:func:`judge_replies`) into the result's ``judged``.
    ``screen``: with several recipes, search fully only the one whose best single layer (of
    the full search's, from :data:`SCREEN_FROM` of the depth up) scores highest (about a third
    of the time of three full searches; False: search each and keep the one that moves the
    validation pairs furthest).
    ``sink_reads_banks``: whether the conversation's first token reads the banks (the module
    docstring; True: the paper's injection, as the shipped personas were calibrated).
    ``voice``: also look for a voice band (:func:`~hf_memory.recipes.voice_band.voice_band`:
    the text at a band of upper layers, fewer slots where the KV ceiling needs it, chosen by a
    reply judge fitted on the pairs, within both ceilings and ``voice_budget``: nats per token,
    or ``"prompt"``, the visible prompt's own cost: the band costs no more than the prompt it
    replaces, where ``cost_budget`` is often too little for a voice); the band is kept
    in place of the recipe's sites when the judge scores its replies to the band's questions
    higher than theirs (``voice`` of the result says which and why).
    """
    check_pairs(pairs)
    pairs = list(pairs)
    check_recipes(recipes)
    if cost_budget is None:
        raise ValueError("calibrate_persona always runs within a cost budget; for the "
                         "unbudgeted search call Selector.calibrate_behavioural(..., "
                         "cost_budget=None)")
    if voice_budget != "prompt":
        _number("voice_budget", voice_budget)
    if capability_ceiling is not None and not isinstance(capability_ceiling, int | float) \
            and capability_ceiling != "prompt":
        raise ValueError("capability_ceiling must be 'prompt', a number of nats per answer or "
                         f"None, got {capability_ceiling!r}")
    bar = tqdm(total=_expected_trials(model, recipes, top_layers, screen, search),
               desc="persona calibration", unit="site", disable=not progress)
    bar.set_postfix_str("plain passes", refresh=False)
    limits = _limits(model, tokenizer, text, kv_ceiling, capability_ceiling,
                     search.get("batch_size", 16))
    if search.get("cost") is None:  # one neutral text for every recipe (its plain pass once)
        search["cost"] = NeutralCost(model, tokenizer, batch_size=search.get("batch_size", 16))
    built, skipped, objectives = [], [], {}
    for recipe in dict.fromkeys(recipes):
        entry = _recipe_banks(model, tokenizer, text, recipe, pairs, max_exemplars,
                              limits["kv_ceiling"], sink_reads_banks, objectives)
        (skipped if "skipped" in entry else built).append(entry)
    limited = dict(cost_budget=cost_budget, kv_ceiling=limits["kv_ceiling"],
                   capability=limits["capability"],
                   capability_ceiling=limits["capability_ceiling"],
                   progress=bar if progress else False)
    if screen and len(built) > 1:
        built, screened = _screened(model, tokenizer, built, bar, limited, search)
        skipped += screened
    found = []
    for entry in built:
        recipe, banks, examples = entry["recipe"], entry["banks"], entry["examples"]
        bar.set_description(f"persona calibration: {recipe}", refresh=False)
        selector = Selector.calibrate_behavioural(model, tokenizer, banks, entry["scored"],
                                                  top_layers=top_layers, **limited,
                                                  probes=entry["probes"], **search)
        exemplars = [target for _, target, _ in examples]
        selector.config["bank_recipe"] = {"recipe": recipe, "text": text,
                                          "exemplars": exemplars,
                                          "sink_reads_banks": banks.sink_reads_banks}
        if banks.contrast:
            selector.config["bank_recipe"]["counter_exemplars"] = [r for _, _, r in examples]
        trial = _trial(recipe, selector, len(exemplars), limits["prompt_kv_bytes"])
        if "screened" in entry:
            trial["screened"] = entry["screened"]
        found.append((banks, selector, trial))
    bar.total = bar.n  # the search stops early where adding sites stops paying
    bar.close()
    if not found:
        raise ValueError("no recipe fits the KV ceiling: " + "; ".join(
            f"{t['recipe']}: {t['skipped']}" for t in skipped) + " (the persona text as a "
            f"prompt holds {limits['prompt_kv_bytes']} bytes of KV; raise kv_ceiling, or "
            "None for no ceiling)")

    def held_out(trial: dict[str, Any]) -> float:
        value = trial["validation_target"]
        return trial["calibration_target"] if value is None else value

    banks, selector, chosen = max(found, key=lambda item: held_out(item[2]))
    record = {k: v for k, v in limits.items() if k != "capability"}
    steering = PersonaSteering(banks, selector, chosen["recipe"],
                               [t for _, _, t in found] + skipped, record)
    if voice:
        from hf_memory.baselines.methods import PromptMethod

        budget = (search["cost"].measure(PromptMethod(text, tokenizer=tokenizer))
                  if voice_budget == "prompt" else float(voice_budget))
        steering = _voiced(model, tokenizer, text, pairs, steering, limits, search["cost"],
                           budget, progress)
    if judge:
        steering.judged = judge_replies(model, tokenizer, text, pairs, steering.method())
    return steering


def _voiced(model, tokenizer, text: str, pairs, steering: PersonaSteering,
            limits: dict[str, Any], cost, budget: float, progress: bool) -> PersonaSteering:
    """``steering``, or its voice band in its place when the band's replies are judged higher
    (``calibrate_persona(voice=True)``); the band's record in ``voice`` either way."""
    from hf_memory.baselines.methods import generate_with
    from hf_memory.metrics.reply_judge import JudgeTooWeakError, ReplyJudge
    from hf_memory.recipes.voice_band import band_banks, band_prompts, band_selector, voice_band

    prompts = band_prompts(pairs)
    try:
        band = voice_band(model, tokenizer, text, pairs, prompts, cost=cost, budget=budget,
                          kv_ceiling=limits["kv_fraction"], capability=limits["capability"],
                          capability_ceiling=limits["capability_ceiling"], progress=progress)
    except JudgeTooWeakError as error:
        steering.voice = {"kept": False, "budget": budget, "refused": str(error)}
        return steering
    if band is None:
        steering.voice = {"kept": False, "budget": budget,
                          "skipped": "no band fits the budget and the ceilings"}
        return steering
    replies = generate_with(steering.method(), model, tokenizer, prompts, max_new_tokens=40)
    band.update(budget=budget, sites_judged=ReplyJudge.fit(pairs).summary(replies)["judge_score"])
    band["kept"] = band["judged"] > band["sites_judged"]
    if not band["kept"]:
        steering.voice = band
        return steering
    banks = band_banks(persona_banks(model, tokenizer, text, recipe="prompt_like",
                                     sink_reads_banks=False), band["slots"])
    return PersonaSteering(banks, band_selector(model, text, band), "prompt_like",
                           steering.trials, steering.limits, voice=band)


def judge_replies(model, tokenizer, text: str, pairs: Sequence[tuple[str, str, str]], method,
                  *, prompts: int = JUDGED_PROMPTS, max_new_tokens: int = 40) -> dict[str, Any]:
    """``method``'s greedy replies to ``prompts`` of the pairs' prompts (spread over the list)
    beside the plain model's and the visible prompt's (``text`` as the system message), scored
    by a :class:`~hf_memory.metrics.reply_judge.ReplyJudge` fitted on ``pairs`` with fluency
    beside (:func:`~hf_memory.metrics.reply_judge.judge_or_refuse`). A judge under 0.8
    held-out accuracy, or fewer than 4 pairs, judges nothing: ``{"judge": ..., "refused":
    why}``."""
    from hf_memory.baselines.methods import PlainMethod, PromptMethod
    from hf_memory.metrics.reply_judge import MIN_PAIRS, judge_or_refuse

    asked = split_pairs(pairs, min(prompts, len(pairs) - 1))[1] if len(pairs) >= MIN_PAIRS \
        else []
    judged = judge_or_refuse(
        model, tokenizer, pairs, [p for p, _, _ in asked],
        {"plain": PlainMethod(), "prompt": PromptMethod(text, tokenizer=tokenizer),
         "memory": method}, max_new_tokens=max_new_tokens)
    return judged if "refused" in judged else {**judged, "prompts": len(asked)}


def calibrate_caa(model, tokenizer, pairs: Sequence[tuple[str, str, str]], *,
                  layers: Sequence[int] = CAA_LAYERS, scales: Sequence[float] = CAA_SCALES,
                  cost_budget: float = DEFAULT_COST_BUDGET, cost=None):
    """CAA for the same pairs under the same budget, the baseline memory is compared with:
    at each of ``layers`` (fractions of the depth, or layer indices if integers) the mean
    (prompt + target − prompt + reference) residual, its scale
    the best-scoring one within ``cost_budget`` on the pairs
    (:func:`~hf_memory.selection.behavioural_search.
    best_strength`); the layer whose best scores highest. Returns ``(CAAMethod or None when no
    scale fits the budget, {"layer", "scale", "rows"})``."""
    from hf_memory.baselines.caa import CAAVectors
    from hf_memory.baselines.methods import CAAMethod
    from hf_memory.selection.behavioural_search import ShiftObjective, best_strength

    check_pairs(pairs)
    depth = model.config.num_hidden_layers
    layers = sorted({layer if isinstance(layer, int) else min(depth - 1, round(layer * depth))
                     for layer in layers})
    cost = cost if cost is not None else NeutralCost(model, tokenizer)
    objective = ShiftObjective(model, tokenizer, pairs, cost=cost)
    best, record = None, {"layer": None, "scale": 0.0, "rows": {}}
    for layer in layers:
        vectors = CAAVectors.extract(model, tokenizer, [(f"{p} {t}", f"{p} {r}")
                                                        for p, t, r in pairs], layers=[layer])
        scale, rows = best_strength(objective, lambda s, v=vectors: CAAMethod(v, scale=s),
                                    scales, cost_budget=cost_budget)
        record["rows"][str(layer)] = rows
        if scale > 0:
            score = next(r["score"] for r in rows if r["strength"] == scale)
            if best is None or score > best[0]:
                best = (score, CAAMethod(vectors, scale=scale))
                record.update(layer=layer, scale=scale)
    return (None if best is None else best[1]), record
