"""``guidance``: a bank that carries a rule rather than a persona (the paper's auxiliary / guidance
banks, D.4–D.5 in spirit), against the same rule as a visible prompt.

Three answer-format rules (``data/guidance_rules.json``, written for this project): ``one_word``,
``number_only`` (digits) and ``french``. Each has 36 questions with a reply that follows the rule
and one with the same answer that breaks it; the first ``calibration_items`` calibrate the
memory's behavioural selector (exactly as trait steering calibrates a Big Five direction, with the
other rules' items as drift), the rest are held out. Methods: ``plain``, ``prompt`` (the rule in
the system prompt) and ``memory`` (the rule's bank at the frozen selector's sites). Per rule and
method, on the held-out questions:

- **likelihood compliance**: the share of questions whose compliant reply has the higher mean
  log-probability per token than the violating one (a summed log-probability favours a 1–3-token
  reply whatever the rule: it saturates), and the mean shift over plain of the summed margin
  log p(compliant) − log p(violating);
- **generation compliance** (``generate=True``): greedy replies checked by :class:`RuleJudge`,
  a programmatic judge (a word count, a digits pattern, and ``langdetect`` restricted to
  English / French), whose agreement with the labelled replies of every item is reported;
  beside it, the replies' repetition (:func:`~hf_memory.metrics.text_quality.repetition`: mean
  distinct-2 and repeated-4-gram share).

Your own rules (``rule_file``, ``--rule-file``): a JSON file in the shipped form
(:mod:`~eval_harness.guidance.rules`), each rule with its text and example pairs. Their
generation compliance is judged by a :class:`~hf_memory.metrics.reply_judge.ReplyJudge` fitted
on the rule's examples (compliant against violating replies); a judge under 0.8 held-out
accuracy judges nothing and the report says why.

Today's method (``persona_recipes``): the rule's banks and sites come from the one-line persona
call (:func:`~hf_memory.recipes.persona.calibrate_persona`: the rule's text, its calibration
items as pairs, the recipes screened within ``cost_budget`` and ``kv_ceiling``, a fraction of the
rule's KV as a visible prompt: 1/6 by default, the 6x saving issue 78 asks of guidance banks).
Every setup records the KV the memory carries beside the rule's as a visible prompt.

Intervals: 95 % bootstrap over questions. The paper's structured-reasoning guidance banks
(HARDMath / PHYSICS heuristic cards) are in :mod:`~eval_harness.heuristic_cards.task`, for users'
models and data.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hf_memory import BankSet, MemoryBank, MemoryMethod, Method, PlainMethod, PromptMethod
from hf_memory.baselines.methods import generate_with_each
from hf_memory.metrics.kv_accounting import kv_footprint, prompt_kv_bytes
from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.metrics.text_quality import repetition
from hf_memory.selection.behavioural_calibration import DEFAULT_GAINS
from hf_memory.selection.budget_search import DEFAULT_COST_BUDGET

from ..directions import behavioural_selector
from ..intervals import mean_interval
from ..names import RULES, check_persona_knobs, check_positive_ints
from .rules import load_rule_file, shipped_rules

__all__ = ["RULES", "GuidanceConfig", "RuleJudge", "rule_items", "rule_text", "run_guidance",
           "validate_rule_judge"]

GUIDANCE_METHODS = ("plain", "prompt", "memory")
RULE_KV_CEILING = 1 / 6  # issue 78: guidance banks at 6x less KV than the visible rule at least


def _rule(rule: str, rules: Mapping[str, Any] | None) -> dict[str, Any]:
    rules = shipped_rules() if rules is None else rules
    if rule not in rules:
        raise ValueError(f"unknown rule {rule!r}; known: {', '.join(rules)}")
    return rules[rule]


def rule_text(rule: str, rules: Mapping[str, Any] | None = None) -> str:
    """The rule as an instruction (bank text and system prompt); ``rules``: a rule file's
    (:func:`~eval_harness.guidance.rules.load_rule_file`), else the shipped ones."""
    return _rule(rule, rules)["text"]


def rule_items(rule: str, calibration_items: int = 12, rules: Mapping[str, Any] | None = None
               ) -> tuple[list[dict], list[dict]]:
    """(calibration items, held-out items) of ``rule``: dicts with question, compliant,
    violating."""
    items = _rule(rule, rules)["items"]
    if (isinstance(calibration_items, bool) or not isinstance(calibration_items, int)
            or not 1 <= calibration_items < len(items)):
        raise ValueError(f"calibration_items must be an integer in [1, {len(items) - 1}], got "
                         f"{calibration_items!r}")
    return items[:calibration_items], items[calibration_items:]


class RuleJudge:
    """Does a reply follow a rule? One word (letters, an optional final punctuation mark), digits
    only, or French (``langdetect``'s profiles for English and French only, seeded: short
    sentences are misread as Catalan or Lithuanian when all 55 languages compete)."""

    name = "rule-checker-v1"

    def __init__(self) -> None:
        self._factory = None

    def _language(self, text: str) -> str:
        if self._factory is None:
            import os

            from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

            factory = DetectorFactory()
            factory.load_json_profile([Path(os.path.join(PROFILES_DIRECTORY, code)).read_text()
                                       for code in ("en", "fr")])
            factory.seed = 0
            self._factory = factory
        detector = self._factory.create()
        detector.append(text)
        from langdetect.lang_detect_exception import LangDetectException

        try:
            return detector.detect()
        except LangDetectException:  # no letters at all
            return "unknown"

    def complies(self, rule: str, response: str) -> bool:
        _rule(rule, None)
        text = response.strip()
        if rule == "one_word":
            return re.fullmatch(r"[^\W\d_]+(?:['-][^\W\d_]+)*[.!]?", text) is not None
        if rule == "number_only":
            return re.fullmatch(r"-?\d+(?:[.,]\d+)?", text) is not None
        return bool(text) and self._language(text) == "fr"


def validate_rule_judge(judge: RuleJudge) -> dict[str, Any]:
    """Per rule: the judge's agreement with the labels of every item's two replies (compliant
    = follows the rule, violating = breaks it)."""
    result = {}
    for rule in RULES:
        items = shipped_rules()[rule]["items"]
        right = sum(judge.complies(rule, i["compliant"]) for i in items)
        right += sum(not judge.complies(rule, i["violating"]) for i in items)
        result[rule] = {"agreement": right / (2 * len(items)), "labelled": 2 * len(items)}
    return {"judge": judge.name, "rules": result}


@dataclass
class GuidanceConfig:
    """Knobs of the task (recorded in the results). ``rules``: names among the shipped rules, or
    among ``rule_file``'s (None: all of them)."""

    rules: Sequence[str] | None = None
    rule_file: str | None = None
    methods: Sequence[str] = GUIDANCE_METHODS
    calibration_items: int = 12
    drift_items: int = 2
    generate: bool = True
    max_new_tokens: int = 24
    top_layers: int = 5
    candidate_layers: Sequence[int] | None = None
    gains: Sequence[float] = DEFAULT_GAINS
    uncertainty_weight: float = 1.0
    batch_size: int = 16
    num_bootstrap: int = 1000
    seed: int = 0
    selectors_dir: str | None = None
    persona_recipes: Sequence[str] | None = None
    cost_budget: float = DEFAULT_COST_BUDGET
    kv_ceiling: float | None = RULE_KV_CEILING

    def __post_init__(self) -> None:
        known = self.source()
        self.rules = list(known) if self.rules is None else list(self.rules)
        if not self.rules:
            raise ValueError("give at least one rule")
        for rule in self.rules:
            _rule(rule, known)
        if not self.methods or "plain" not in self.methods or any(
                m not in GUIDANCE_METHODS for m in self.methods):
            raise ValueError(f"methods must be among {', '.join(GUIDANCE_METHODS)} and include "
                             f"'plain'; got {list(self.methods)}")
        check_positive_ints(self, ("calibration_items", "drift_items", "max_new_tokens",
                                   "top_layers", "batch_size", "num_bootstrap"))
        for rule in self.rules:  # each rule keeps questions held out
            rule_items(rule, self.calibration_items, known)
        self.persona_recipes = check_persona_knobs(self.persona_recipes, self.calibration_items,
                                                   "calibration items", self.cost_budget)
        if self.kv_ceiling is not None and (
                isinstance(self.kv_ceiling, bool) or not isinstance(self.kv_ceiling, int | float)
                or not self.kv_ceiling > 0):
            raise ValueError("kv_ceiling is a fraction of the rule's KV as a prompt above 0, or "
                             f"None; got {self.kv_ceiling!r}")
        self.methods = list(self.methods)

    def source(self) -> dict[str, dict[str, Any]]:
        """The rules by name: ``rule_file``'s, else the shipped ones."""
        return shipped_rules() if self.rule_file is None else load_rule_file(self.rule_file)


def _triples(items: Sequence[dict]) -> list[tuple[str, str, str]]:
    return [(i["question"], i["compliant"], i["violating"]) for i in items]


def calibrate_rule(model, tokenizer, rule: str, config: GuidanceConfig,
                   rules: Mapping[str, Any] | None = None
                   ) -> tuple[dict[str, Method], dict[str, Any]]:
    """The rule's prompt and memory: its bank at a behavioural selector calibrated on the
    calibration items, the other rules' first ``drift_items`` as drift; or with
    ``config.persona_recipes`` the one-line persona call on the calibration items. ``rules``:
    the run's rules (default: ``config.source()``). The setup records the memory's sites and its
    KV beside the rule's as a visible prompt."""
    rules = config.source() if rules is None else rules
    calibration, _ = rule_items(rule, config.calibration_items, rules)
    pairs = _triples(calibration)
    text = rule_text(rule, rules)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if config.persona_recipes:
        from hf_memory.recipes.persona import calibrate_persona

        found = calibrate_persona(model, tokenizer, text, pairs, recipes=config.persona_recipes,
                                  cost_budget=config.cost_budget, kv_ceiling=config.kv_ceiling,
                                  top_layers=config.top_layers, batch_size=config.batch_size,
                                  judge=False, progress=False)
        memory, selector = found.method(), found.selector
        latent = selector.config["kv_bytes"]  # the steered KV heads, as the search counted them
        described = {"recipe": found.recipe, "cost": selector.config["best"].get("cost")}
    else:
        bank = MemoryBank.from_text(model, tokenizer, text, role="target", name="rule",
                                    template="{text}", context="system")
        banks = BankSet([bank], model=model)
        first = min(config.drift_items, config.calibration_items)  # of its calibration items
        drift = {other: _triples(rules[other]["items"][:first])
                 for other in rules if other != rule}
        selector = behavioural_selector(model, tokenizer, banks, pairs, drift, config,
                                        f"rule-{rule}")
        memory = MemoryMethod(banks, selector)
        latent = kv_footprint(model, banks, ids, layers=selector.layers).bank_bytes
        described = {"objective": selector.config["best"]}
    visible = prompt_kv_bytes(model, ids)
    methods = {"plain": PlainMethod(), "prompt": PromptMethod(text, tokenizer=tokenizer),
               "memory": memory}
    setup = {"text": text, "memory": {"layers": selector.layers, "gain": selector.layer_gains,
                                      **described},
             "kv": {"prompt_bytes": visible, "memory_bytes": latent,
                    "memory_fraction": latent / visible}}
    return {m: methods[m] for m in config.methods}, setup


class _FittedRuleJudge:
    """A rule from a file, judged in generation by a reply judge fitted on its examples
    (compliant against violating replies): a reply complies when scored on the compliant side.
    ``refused``: why no judge could be fitted (then nothing is judged)."""

    def __init__(self, items: Sequence[dict]) -> None:
        from hf_memory.metrics.reply_judge import JudgeTooWeakError, ReplyJudge

        self.judge, self.refused = None, None
        try:
            self.judge = ReplyJudge.fit(_triples(items))
            self.record = {**self.judge.as_dict(), "agreement": self.judge.held_out_accuracy,
                           "labelled": 2 * len(items)}
        except JudgeTooWeakError as error:
            self.refused = str(error)
            self.record = {**error.judge.as_dict(), "refused": self.refused,
                           "labelled": 2 * len(items)}

    def complies(self, replies: Sequence[str]) -> list[bool]:
        return [score > 0.5 for score in self.judge.score(list(replies))]


def _pair_logprobs(model, tokenizer, items: list[dict], method: Method, batch_size: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Summed log-probabilities of each item's compliant and violating reply under ``method``."""
    conversations = [method.messages(i["question"]) for i in items for _ in (0, 1)]
    replies = [i[key] for i in items for key in ("compliant", "violating")]
    both = reply_logprobs(model, tokenizer, conversations, replies, method=method,
                          batch_size=batch_size).numpy()
    return both[0::2], both[1::2]


def run_guidance(model, tokenizer, config: GuidanceConfig, judge: RuleJudge | None = None
                 ) -> dict[str, Any]:
    """Calibrate each rule and score its methods on the held-out questions (module docstring)."""
    judge = judge or RuleJudge()
    rules = config.source()
    fitted: dict[str, _FittedRuleJudge] = {}
    rows, setups, generations = [], {}, {}
    for rule in tqdm(config.rules, desc="guidance"):
        methods, setups[rule] = calibrate_rule(model, tokenizer, rule, config, rules)
        _, held_out = rule_items(rule, config.calibration_items, rules)
        questions = [i["question"] for i in held_out]
        counts = [np.array([len(tokenizer(i[key], add_special_tokens=False).input_ids)
                            for i in held_out], np.float64) for key in ("compliant", "violating")]
        scored = {name: _pair_logprobs(model, tokenizer, held_out, method, config.batch_size)
                  for name, method in methods.items()}
        margins = {name: lp[0] - lp[1] for name, lp in scored.items()}
        answered = dict(zip(methods, generate_with_each(
            list(methods.values()), model, tokenizer, questions, batch_size=config.batch_size,
            max_new_tokens=config.max_new_tokens, do_sample=False), strict=True)
        ) if config.generate else {}
        if config.generate and config.rule_file is not None:
            fitted[rule] = _FittedRuleJudge(rules[rule]["items"])
        for name in methods:
            compliant, violating = scored[name]
            complied = (compliant / counts[0] > violating / counts[1]).astype(np.float64)
            shift = margins[name] - margins["plain"]
            row = {"rule": rule, "method": name, "items": len(held_out),
                   "likelihood_compliance": float(complied.mean()),
                   "likelihood_compliance_ci": mean_interval(complied, config.num_bootstrap,
                                                             config.seed),
                   "margin": float(margins[name].mean()), "shift": float(shift.mean()),
                   "shift_ci": mean_interval(shift, config.num_bootstrap, config.seed)}
            if config.generate:
                replies = answered[name]
                if rule in fitted:
                    follows = (None if fitted[rule].refused else
                               np.array(fitted[rule].complies(replies), np.float64))
                else:
                    follows = np.array([judge.complies(rule, r) for r in replies], np.float64)
                if follows is not None:
                    row["generation_compliance"] = float(follows.mean())
                    row["generation_compliance_ci"] = mean_interval(
                        follows, config.num_bootstrap, config.seed)
                row["repetition"] = repetition(replies)
                generations[f"{rule}/{name}"] = replies
            rows.append(row)
    judged = None
    if config.generate:
        judged = ({"judge": "reply judge fitted on each rule's examples",
                   "rules": {rule: f.record for rule, f in fitted.items()}}
                  if config.rule_file is not None else validate_rule_judge(judge))
    return {"rows": rows, "setups": setups, "generations": generations, "judge": judged,
            "config": asdict(config)}
