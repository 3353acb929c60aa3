"""``dialogue-shift``: can guidance change mid-conversation without rewriting the transcript (the
paper's section 5 / appendix D.3, in a likelihood form)?

Each case (:mod:`~eval_harness.dialogue_shift.cases`) is one :class:`~hf_memory.Conversation` on one
KV cache, teacher-forced: every user turn of the case, then the assistant reply of the transcript
(the old style's reply before the shift; after it, the old style's or, with
``post_shift_history="new"``, the new style's). The user's shift request is part of the
transcript at the shift turn, as in the paper, so every method sees it. The methods:

- ``plain``: no guidance beyond the user's request;
- ``prompt-init``: the old style's descriptor in the system prompt from the start, kept (the
  visible budget is fixed after initialisation);
- ``caa``: the CAA vector towards the old style (−v) until the shift, towards the new (+v)
  from the shift turn on, at the scale calibrated for the transition;
- ``memory``: the old style's bank until the shift, then ``set_banks`` to the new style's bank,
  at the sites and gains of the transition's frozen behavioural selector (automatic path). With
  ``persona_recipes`` (today's method), each style's banks and selector come from the one-line
  persona call (:func:`~hf_memory.recipes.persona.calibrate_persona`: the style's descriptor and
  the pair's calibration items as its pairs, within ``cost_budget``, under the KV and capability
  ceilings), and the swap changes banks and sites together;
- ``prompt-repl`` (audit): the system prompt replaced by the new style's at the shift, which
  changes the first tokens of the transcript, so the whole cache is recomputed.

At every user turn the two held-out continuations are scored as the assistant's reply on the
cache: Align = log p(new-style reply) − log p(old-style reply), the same content in the two
styles. Reported per method: mean post-shift Align per case, its shift over plain (paired by
case), 95 % bootstrap intervals over cases, per transition, per length and overall; pre-shift
Align (the old guidance holding); the guidance KV each method carries (visible prompt tokens vs
latent bank / vector bytes) and the tokens it ran through the model.

With ``generate=True`` every case is also run in the paper's generation form
(:func:`generate_case`): the model writes every assistant turn itself and post-shift replies are
judged by :class:`~eval_harness.dialogue_shift.style_judge.StyleJudge` (validated on the bank's
labelled pairs, reported in the results); beside the judge, the repetition of every turn the
model wrote (:func:`~hf_memory.metrics.text_quality.repetition`: mean distinct-2 and
repeated-4-gram share
per reply).

Calibration (disjoint from every dialogue): per transition, the behavioural selector for the new
style's bank and the CAA scale are chosen on the pair's calibration items
(:func:`~eval_harness.dialogue_shift.cases.transition_calibration`) exactly as trait steering
chooses them for a Big Five direction (unbudgeted; with ``persona_recipes`` both within
``cost_budget`` on the shipped neutral text).

Your own styles (``styles_file``, :mod:`~eval_harness.dialogue_shift.styles`) come with your own
cases; their generations are judged by
:class:`~eval_harness.dialogue_shift.style_judge.FittedStyleJudge`.

The user's shift request, a new user message at the shift turn, is in every method's transcript:
``plain`` is what a user does first (a visible instruction appended, nothing recomputed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from hf_memory import BankSet, CAAVectors, Conversation, MemoryBank, Selector, apply_caa
from hf_memory.artifacts.atomic_files import write_json
from hf_memory.baselines.methods import PromptMethod
from hf_memory.chat.generation import default_system_prompt
from hf_memory.metrics.kv_accounting import kv_footprint
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.metrics.text_quality import repetition
from hf_memory.selection.behavioural_calibration import DEFAULT_GAINS
from hf_memory.selection.behavioural_search import ShiftObjective, best_strength
from hf_memory.selection.defaults import DEFAULT_COST_BUDGET

from ..bigfive.task import CAA_FRAMES
from ..directions import CAAFromStart, behavioural_selector
from ..intervals import mean_interval
from ..names import check_persona_knobs, check_positive_ints
from .cases import (
    TRANSITIONS,
    check_case,
    dialogue_cases,
    parse_transition,
    style_descriptor,
    transition_calibration,
)
from .styles import load_styles

__all__ = ["METHODS", "DialogueShiftConfig", "FrozenTransition", "calibrate_transition",
           "generate_case", "run_dialogue_shift", "style_judge_for", "summarize", "walk_case"]

METHODS = ("plain", "prompt-init", "caa", "memory", "prompt-repl")
MATCHED = ("plain", "prompt-init", "caa", "memory")  # the fixed-visible-budget comparison


@dataclass
class DialogueShiftConfig:
    """Knobs of the task (recorded in the results)."""

    transitions: Sequence[str] = TRANSITIONS
    lengths: Sequence[int] = (8, 16, 24)
    branches: Sequence[str] = ("a", "b")
    methods: Sequence[str] = METHODS
    post_shift_history: str = "old"
    generate: bool = False
    max_new_tokens: int = 40
    calibration_pairs: int = 12
    drift_pairs: int = 2
    top_layers: int = 5
    candidate_layers: Sequence[int] | None = None
    gains: Sequence[float] = DEFAULT_GAINS
    uncertainty_weight: float = 1.0
    caa_layer: int = 10
    # below 1 for the budgeted calibration: CAA from the first token at scale 1 already costs
    # more than 0.1 nats per neutral token on the embedded model (docs/benchmarks/guidance.md)
    caa_scales: Sequence[float] = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
    batch_size: int = 16
    num_bootstrap: int = 1000
    seed: int = 0
    selectors_dir: str | None = None
    persona_recipes: Sequence[str] | None = None
    cost_budget: float = DEFAULT_COST_BUDGET
    styles_file: str | None = None

    def __post_init__(self) -> None:
        self.persona_recipes = check_persona_knobs(self.persona_recipes, self.calibration_pairs,
                                                   "calibration pairs", self.cost_budget)
        if not self.transitions:
            raise ValueError("give at least one transition")
        book = self.book()
        for name in self.transitions:  # each named right and with calibration pairs
            transition_calibration(*parse_transition(name, book), self.calibration_pairs,
                                   self.drift_pairs, book)
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods must be among {', '.join(METHODS)}; got "
                             f"{list(self.methods)}")
        if "plain" not in self.methods:
            raise ValueError("methods must include 'plain' (every shift is measured against it)")
        if self.post_shift_history not in ("old", "new"):
            raise ValueError(f"post_shift_history must be 'old' or 'new', got "
                             f"{self.post_shift_history!r}")
        check_positive_ints(self, ("calibration_pairs", "drift_pairs", "top_layers",
                                   "batch_size", "num_bootstrap", "max_new_tokens"))
        self.transitions, self.lengths = list(self.transitions), list(self.lengths)
        self.branches, self.methods = list(self.branches), list(self.methods)

    def book(self) -> dict[str, Any] | None:
        """A user's styles (``styles_file``), or None for the shipped bank."""
        return None if self.styles_file is None else load_styles(self.styles_file)


@dataclass
class FrozenTransition:
    """One transition's guidance, frozen on calibration data: the two styles' banks and system
    prompts, the selector (sites and gains of the new style's bank), the CAA vectors (new minus
    old) and their scale; ``setup`` records how they were chosen. ``old_selector``: the old
    style's own sites (None: the old bank steers at the new one's)."""

    old: str
    new: str
    banks: dict[str, BankSet]
    systems: dict[str, str]
    selector: Selector
    caa: CAAVectors
    caa_scale: float
    setup: dict[str, Any]
    old_selector: Selector | None = None


def _system(tokenizer, descriptor: str) -> str:
    default = default_system_prompt(tokenizer)
    return f"{default}\n{descriptor}" if default else descriptor


def calibrate_transition(model, tokenizer, transition: str, config: DialogueShiftConfig,
                         personas: dict[str, Any] | None = None) -> FrozenTransition:
    """Freeze memory (behavioural selector, or with ``config.persona_recipes`` each style's
    persona call), CAA (scale) and the prompts for ``transition``. ``personas``: the persona
    calls made so far, by style (a pair's two transitions share them; filled in here)."""
    book = config.book()
    old, new = parse_transition(transition, book)
    pairs, drift = transition_calibration(old, new, config.calibration_pairs, config.drift_pairs,
                                          book)
    descriptors = {"old": style_descriptor(old, book), "new": style_descriptor(new, book)}
    cost = (NeutralCost(model, tokenizer, batch_size=config.batch_size)
            if config.persona_recipes else None)
    old_selector = None
    if config.persona_recipes:
        personas = {} if personas is None else personas
        oriented = {"new": pairs, "old": [(q, o, n) for q, n, o in pairs]}
        found = {}
        for key, style in (("old", old), ("new", new)):
            if style not in personas:
                personas[style] = _style_persona(model, tokenizer, style, descriptors[key],
                                                 oriented[key], config, cost)
            found[key] = personas[style]
        banks = {key: steering.banks for key, steering in found.items()}
        selector, old_selector = found["new"].selector, found["old"].selector
        memory = {key: {"recipe": steering.recipe, "layers": steering.selector.layers,
                        "units": {str(k): v for k, v in steering.selector.units.items()},
                        "strength": steering.selector.strength,
                        "kv_bytes": steering.selector.config["kv_bytes"],
                        "objective": steering.selector.config["best"]}
                  for key, steering in found.items()}
    else:
        banks = {key: BankSet([MemoryBank.from_text(model, tokenizer, text, role="target",
                                                    name="persona", template="{text}",
                                                    context="system")], model=model)
                 for key, text in descriptors.items()}
        selector = behavioural_selector(model, tokenizer, banks["new"], pairs, drift, config,
                                        transition)
        memory = {"layers": selector.layers, "gain": selector.layer_gains,
                  "objective": selector.config["best"]}
    vectors = CAAVectors.extract(model, tokenizer,
                                 [(f.format(descriptors["new"]), f.format(descriptors["old"]))
                                  for f in CAA_FRAMES], layers=[config.caa_layer])
    objective = ShiftObjective(model, tokenizer, pairs, drift,
                               uncertainty_weight=config.uncertainty_weight,
                               batch_size=config.batch_size, cost=cost)
    scale, rows = best_strength(objective, lambda s: CAAFromStart(vectors, scale=s),
                                config.caa_scales,
                                cost_budget=config.cost_budget if cost is not None else None)
    setup = {"memory": memory,
             "caa": {"layer": config.caa_layer, "scale": scale, "calibration": rows},
             "descriptors": descriptors, "calibration_pairs": len(pairs)}
    return FrozenTransition(old, new, banks,
                            {k: _system(tokenizer, v) for k, v in descriptors.items()},
                            selector, vectors, scale, setup, old_selector)


def _style_persona(model, tokenizer, style: str, descriptor: str, pairs, config, cost):
    """``style``'s one-line persona call: the one saved under ``config.selectors_dir`` as
    ``<style>-persona`` when it was made on this model with the same descriptor, pairs and
    knobs, else made (and saved there, when given)."""
    from hf_memory.recipes.persona import PersonaSteering, calibrate_persona
    from hf_memory.selection.behavioural_calibration import pairs_digest

    wanted = {"descriptor": descriptor, "pairs_sha256": pairs_digest(pairs),
              "recipes": list(config.persona_recipes), "cost_budget": config.cost_budget,
              "top_layers": config.top_layers,
              "sink_reads_banks": False}  # calls saved before the first token kept off: remade
    place = Path(config.selectors_dir) / f"{style}-persona" if config.selectors_dir else None
    if place is not None and (place / "calibration.json").is_file():
        try:
            made = json.loads((place / "calibration.json").read_text())
            found = PersonaSteering.from_pretrained(place, model=model)
        except (ValueError, OSError):  # unreadable, or made for another model: make it again
            made = None
        if made == wanted:
            return found
    found = calibrate_persona(model, tokenizer, descriptor, pairs,
                              recipes=config.persona_recipes, cost_budget=config.cost_budget,
                              top_layers=config.top_layers, batch_size=config.batch_size,
                              cost=cost, judge=False, progress=False,
                              sink_reads_banks=wanted["sink_reads_banks"])
    if place is not None:
        found.save_pretrained(place)
        write_json(place / "calibration.json", wanted)
    return found


def _walk(model, tokenizer, case: dict[str, Any], method: str, frozen: FrozenTransition,
          turn_step) -> Conversation:
    """Drive one case under one method on one cache: the guidance before the shift, the switch
    at the shift turn (after computing the transcript so far under the old guidance), and
    ``turn_step(chat, turn)`` for every turn (1-based). Returns the closed conversation."""
    check_case(case, book={"styles": dict.fromkeys((frozen.old, frozen.new))})
    if (case["old"], case["new"]) != (frozen.old, frozen.new):
        raise ValueError(f"case {case['id']} goes {case['old']} → {case['new']}, the frozen "
                         f"guidance {frozen.old} → {frozen.new}")
    shift = case["shift_turn"]
    system = frozen.systems["old"] if method in ("prompt-init", "prompt-repl") else None
    banks = frozen.banks["old"] if method == "memory" else None
    steering = ({"selector": frozen.old_selector or frozen.selector} if method == "memory"
                else {})
    chat = Conversation(model, tokenizer, banks=banks, system=system, **steering)
    caa = (apply_caa(model, frozen.caa, scale=-frozen.caa_scale, start_position=0)
           if method == "caa" else None)
    try:
        for turn in range(1, case["turns"] + 1):
            if turn == shift:
                chat.prefill()  # the transcript so far under the old guidance
                if method == "memory" and frozen.old_selector is not None:
                    chat.set_banks(frozen.banks["new"], selector=frozen.selector)
                elif method == "memory":
                    chat.set_banks(frozen.banks["new"])
                elif method == "caa":
                    caa.remove()
                    caa = apply_caa(model, frozen.caa, scale=frozen.caa_scale, start_position=0)
                elif method == "prompt-repl":
                    chat.set_system(frozen.systems["new"])
            turn_step(chat, turn)
    finally:
        chat.close()
        if caa is not None:
            caa.remove()
    return chat


def _aligned(aligns: list[float], shift: int, chat: Conversation) -> dict[str, Any]:
    return {"align": aligns, "pre": float(np.mean(aligns[:shift - 1])),
            "post": float(np.mean(aligns[shift - 1:])), "computed_tokens": chat.computed_tokens,
            "transcript_tokens": int(chat.cache.get_seq_length())}


def walk_case(model, tokenizer, case: dict[str, Any], method: str, frozen: FrozenTransition,
              post_shift_history: str = "old") -> dict[str, Any]:
    """The likelihood form: teacher-forced turns, Align of the held-out continuations at every
    user turn (module docstring), and the tokens the model computed."""
    aligns: list[float] = []

    def step(chat: Conversation, turn: int) -> None:
        chat.add("user", case["user"][turn - 1])
        new, old = chat.reply_logprobs([case["new_replies"][turn - 1],
                                        case["old_replies"][turn - 1]])
        aligns.append(new - old)
        kept = ("new_replies" if turn >= case["shift_turn"] and post_shift_history == "new"
                else "old_replies")
        chat.add("assistant", case[kept][turn - 1])

    chat = _walk(model, tokenizer, case, method, frozen, step)
    return _aligned(aligns, case["shift_turn"], chat)


def generate_case(model, tokenizer, case: dict[str, Any], method: str,
                  frozen: FrozenTransition, judge=None, max_new_tokens: int = 40
                  ) -> dict[str, Any]:
    """The generation form (the paper's): the model answers every user turn itself (greedy, on
    the cache), and each reply is judged: Align = score(new style) − score(old style) by
    ``judge`` (default :class:`~eval_harness.dialogue_shift.style_judge.StyleJudge`); plus the
    replies and their distinct-bigram coherence (1–5) after the shift, a crude quality proxy."""
    from ..judges import LexiconJudge
    from .style_judge import StyleJudge

    judge = judge or StyleJudge()
    aligns, replies = [], []

    def step(chat: Conversation, turn: int) -> None:
        reply = chat.say(case["user"][turn - 1], max_new_tokens=max_new_tokens)
        replies.append(reply)
        aligns.append(judge.score(case["new"], reply) - judge.score(case["old"], reply))

    chat = _walk(model, tokenizer, case, method, frozen, step)
    lexicon = LexiconJudge()
    coherence = [lexicon.judge("", r)["coherence"] for r in replies[case["shift_turn"] - 1:]]
    return {**_aligned(aligns, case["shift_turn"], chat), "replies": replies,
            "coherence": float(np.mean(coherence))}


def _guidance_kv(model, tokenizer, frozen: FrozenTransition) -> dict[str, dict[str, int]]:
    """Per method: visible guidance KV bytes (prompt tokens in the cache) and latent guidance
    bytes (bank tensors at the steered layers, or for a persona call's banks at the steered KV
    heads as its search counted them; CAA vector)."""
    probe = "How are you today?"
    visible = PromptMethod(frozen.setup["descriptors"]["new"], tokenizer=tokenizer
                           ).guidance_kv_bytes(model, tokenizer, probe)
    ids = tokenizer(frozen.setup["descriptors"]["new"], return_tensors="pt",
                    add_special_tokens=False).input_ids
    bank = (frozen.selector.config["kv_bytes"] if frozen.old_selector is not None  # per unit
            else kv_footprint(model, frozen.banks["new"], ids,
                              layers=frozen.selector.layers).bank_bytes)
    vector = sum(v.numel() * v.element_size() for v in frozen.caa.vectors.values())
    return {"plain": {"visible": 0, "latent": 0},
            "prompt-init": {"visible": visible, "latent": 0},
            "caa": {"visible": 0, "latent": vector},
            "memory": {"visible": 0, "latent": bank},
            "prompt-repl": {"visible": visible, "latent": 0}}


def _summary(cases: list[dict[str, Any]], methods: Sequence[str], key: str, groups,
             config: DialogueShiftConfig, form: str = "methods") -> list[dict[str, Any]]:
    """Per group (``groups``: name → predicate on a case record) and method, with intervals
    over cases: mean post-shift Align; its shift over plain (paired by case); and the
    **switch**, how much more Align rose from before to after the shift than plain's did,
    (post − pre) − (post − pre of plain), which cancels what the method's guidance does
    whatever its content (e.g. any bank at those sites). ``form``: the case records' field
    (``methods``: likelihood, ``generated``: judged generations, which adds the coherence and
    the repetition of all the chosen cases' replies, every turn, each reply weighing the
    same)."""
    rows = []
    for group, keep in groups:
        chosen = [c for c in cases if keep(c)]
        if not chosen:
            continue
        plain = np.array([c[form]["plain"]["post"] for c in chosen])
        plain_rise = plain - np.array([c[form]["plain"]["pre"] for c in chosen])
        for method in methods:
            post = np.array([c[form][method]["post"] for c in chosen])
            pre = np.array([c[form][method]["pre"] for c in chosen])
            switch = (post - pre) - plain_rise
            rows.append({key: group, "method": method, "cases": len(chosen),
                         "align": float(post.mean()),
                         "align_ci": mean_interval(post, config.num_bootstrap, config.seed),
                         "shift": float((post - plain).mean()),
                         "shift_ci": mean_interval(post - plain, config.num_bootstrap,
                                                   config.seed),
                         "pre_align": float(pre.mean()), "switch": float(switch.mean()),
                         "switch_ci": mean_interval(switch, config.num_bootstrap,
                                                    config.seed)})
            if form == "generated":
                rows[-1]["coherence"] = float(np.mean([c[form][method]["coherence"]
                                                       for c in chosen]))
                rows[-1]["repetition"] = repetition([r for c in chosen
                                                     for r in c[form][method]["replies"]])
    return rows


def style_judge_for(config: DialogueShiftConfig):
    """The generation form's judge: the shipped styles' :class:`StyleJudge`, or for a user's
    styles a reply judge per pair (:class:`FittedStyleJudge`)."""
    from .style_judge import FittedStyleJudge, StyleJudge

    book = config.book()
    return StyleJudge() if book is None else FittedStyleJudge(book)


def summarize(records: list[dict[str, Any]], config: DialogueShiftConfig, judge=None
              ) -> dict[str, Any]:
    """The tables of the results from the per-case records: by transition, by length, overall,
    the claims, and (if the records have them) the generation form's tables with ``judge``'s
    validation (default: :func:`style_judge_for`)."""
    methods = config.methods
    by_transition = _summary(records, methods, "transition",
                             [(t, lambda c, t=t: c["transition"] == t)
                              for t in config.transitions], config)
    by_length = _summary(records, methods, "turns",
                         [(n, lambda c, n=n: c["turns"] == n)
                          for n in sorted({c["turns"] for c in records})], config)
    overall = _summary(records, methods, "group", [("all", lambda c: True)], config)
    tables = {"by_transition": by_transition, "by_length": by_length, "overall": overall,
              "claims": _claims(overall, by_transition, methods)}
    if all("generated" in c for c in records):
        from .style_judge import validate_style_judge

        judge = judge or style_judge_for(config)
        tables["generation"] = {
            "by_transition": _summary(records, methods, "transition",
                                      [(t, lambda c, t=t: c["transition"] == t)
                                       for t in config.transitions], config, "generated"),
            "overall": _summary(records, methods, "group", [("all", lambda c: True)], config,
                                "generated"),
            "judge": (judge.validation() if hasattr(judge, "validation")
                      else validate_style_judge(judge))}
    return tables


def _claims(overall: list[dict[str, Any]], by_transition: list[dict[str, Any]],
            methods: Sequence[str]) -> dict[str, Any]:
    matched = [m for m in MATCHED if m in methods]
    best = max((r for r in overall if r["method"] in matched), key=lambda r: r["align"])
    winners = {}
    for row in by_transition:
        if row["method"] in matched:
            current = winners.get(row["transition"])
            if current is None or row["align"] > current["align"]:
                winners[row["transition"]] = row
    return {"best_matched_method_overall": best["method"],
            "memory_best_overall": best["method"] == "memory",
            "memory_best_transitions": sorted(t for t, r in winners.items()
                                              if r["method"] == "memory"),
            "best_by_transition": {t: r["method"] for t, r in sorted(winners.items())}}


def run_dialogue_shift(model, tokenizer, config: DialogueShiftConfig,
                       cases=None) -> dict[str, Any]:
    """Calibrate each transition, walk every case under every method; the module docstring's
    table. ``cases``: rows like :func:`~eval_harness.dialogue_shift.cases.dialogue_cases` (default:
    the shipped bank filtered by the config)."""
    torch.manual_seed(config.seed)
    book = config.book()
    if cases is None:
        if book is not None:
            raise ValueError("your own styles need your own cases (--cases): the shipped cases "
                             "are written in the shipped styles")
        cases = dialogue_cases(config.transitions, config.lengths, config.branches)
    cases = [dict(c) for c in cases]
    context = model.config.max_position_embeddings
    for case in cases:
        check_case(case, context, tokenizer, book)
        name = f"{case['old']}_to_{case['new']}"
        if name not in config.transitions:
            raise ValueError(f"case {case['id']}: its transition {name} is not among the "
                             f"configured transitions {config.transitions}")
    if not cases:
        raise ValueError("no dialogue case matches the configured transitions, lengths and "
                         "branches")
    judge = style_judge_for(config) if config.generate else None  # a weak one fails first
    records, setups, kv, personas = [], {}, {}, {}
    bar = tqdm(total=len(cases) * len(config.methods), desc="dialogue shift")
    for transition in config.transitions:
        mine = [c for c in cases if f"{c['old']}_to_{c['new']}" == transition]
        if not mine:
            continue
        frozen = calibrate_transition(model, tokenizer, transition, config, personas)
        setups[transition] = frozen.setup
        kv[transition] = _guidance_kv(model, tokenizer, frozen)
        for case in mine:
            record = {"id": case["id"], "transition": transition, "turns": case["turns"],
                      "shift_turn": case["shift_turn"], "methods": {}}
            for method in config.methods:
                record["methods"][method] = walk_case(model, tokenizer, case, method, frozen,
                                                      config.post_shift_history)
                if config.generate:
                    record.setdefault("generated", {})[method] = generate_case(
                        model, tokenizer, case, method, frozen, judge,
                        max_new_tokens=config.max_new_tokens)
                bar.update()
            records.append(record)
    bar.close()
    return {"cases": records, **summarize(records, config, judge), "kv": kv, "setups": setups,
            "config": asdict(config)}
