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

Intervals: 95 % bootstrap over questions. The paper's structured-reasoning guidance banks
(HARDMath / PHYSICS heuristic cards) are in :mod:`~eval_harness.heuristic_cards.task`, for users'
models and data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hf_memory import BankSet, MemoryBank, MemoryMethod, Method, PlainMethod, PromptMethod
from hf_memory.baselines.methods import generate_with_each
from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.metrics.text_quality import repetition
from hf_memory.selection.behavioural_calibration import DEFAULT_GAINS

from ..directions import behavioural_selector
from ..intervals import mean_interval
from ..names import RULES, check_positive_ints

__all__ = ["RULES", "GuidanceConfig", "RuleJudge", "rule_items", "rule_text", "run_guidance",
           "validate_rule_judge"]

RULES_PATH = Path(__file__).parent / "guidance_rules.json"
GUIDANCE_METHODS = ("plain", "prompt", "memory")


@cache
def _data() -> dict[str, Any]:
    return json.loads(RULES_PATH.read_text())


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known: {', '.join(RULES)}")


def rule_text(rule: str) -> str:
    """The rule as an instruction (bank text and system prompt)."""
    _check_rule(rule)
    return _data()["rules"][rule]["text"]


def rule_items(rule: str, calibration_items: int = 12) -> tuple[list[dict], list[dict]]:
    """(calibration items, held-out items) of ``rule``: dicts with question, compliant,
    violating."""
    _check_rule(rule)
    items = _data()["rules"][rule]["items"]
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
        _check_rule(rule)
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
        items = _data()["rules"][rule]["items"]
        right = sum(judge.complies(rule, i["compliant"]) for i in items)
        right += sum(not judge.complies(rule, i["violating"]) for i in items)
        result[rule] = {"agreement": right / (2 * len(items)), "labelled": 2 * len(items)}
    return {"judge": judge.name, "rules": result}


@dataclass
class GuidanceConfig:
    """Knobs of the task (recorded in the results)."""

    rules: Sequence[str] = RULES
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

    def __post_init__(self) -> None:
        if not self.rules:
            raise ValueError("give at least one rule")
        for rule in self.rules:
            _check_rule(rule)
        if not self.methods or "plain" not in self.methods or any(
                m not in GUIDANCE_METHODS for m in self.methods):
            raise ValueError(f"methods must be among {', '.join(GUIDANCE_METHODS)} and include "
                             f"'plain'; got {list(self.methods)}")
        check_positive_ints(self, ("calibration_items", "drift_items", "max_new_tokens",
                                   "top_layers", "batch_size", "num_bootstrap"))
        self.rules, self.methods = list(self.rules), list(self.methods)


def calibrate_rule(model, tokenizer, rule: str, config: GuidanceConfig
                   ) -> tuple[dict[str, Method], dict[str, Any]]:
    """The rule's prompt and memory (its bank at a behavioural selector calibrated on the
    calibration items, the other rules' first ``drift_items`` as drift)."""
    calibration, _ = rule_items(rule, config.calibration_items)
    pairs = [(i["question"], i["compliant"], i["violating"]) for i in calibration]
    drift = {other: [(i["question"], i["compliant"], i["violating"])
                     for i in rule_items(other, config.calibration_items)[0][:config.drift_items]]
             for other in RULES if other != rule}
    text = rule_text(rule)
    bank = MemoryBank.from_text(model, tokenizer, text, role="target", name="rule",
                                template="{text}", context="system")
    banks = BankSet([bank], model=model)
    selector = behavioural_selector(model, tokenizer, banks, pairs, drift, config,
                                    f"rule-{rule}")
    methods = {"plain": PlainMethod(), "prompt": PromptMethod(text, tokenizer=tokenizer),
               "memory": MemoryMethod(banks, selector)}
    setup = {"text": text, "memory": {"layers": selector.layers, "gain": selector.layer_gains,
                                      "objective": selector.config["best"]}}
    return {m: methods[m] for m in config.methods}, setup


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
    rows, setups, generations = [], {}, {}
    for rule in tqdm(config.rules, desc="guidance"):
        methods, setups[rule] = calibrate_rule(model, tokenizer, rule, config)
        _, held_out = rule_items(rule, config.calibration_items)
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
                follows = np.array([judge.complies(rule, r) for r in replies], np.float64)
                row["generation_compliance"] = float(follows.mean())
                row["generation_compliance_ci"] = mean_interval(follows, config.num_bootstrap,
                                                                config.seed)
                row["repetition"] = repetition(replies)
                generations[f"{rule}/{name}"] = replies
            rows.append(row)
    return {"rows": rows, "setups": setups, "generations": generations,
            "judge": validate_rule_judge(judge) if config.generate else None,
            "config": asdict(config)}
