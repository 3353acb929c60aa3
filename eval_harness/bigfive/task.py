"""IPIP-50 Big Five self-evaluation of steering methods (memory-inception paper, appendix D.1).

For each target trait the model is steered towards a trait descriptor (its opposite serves as
the reference bank / CAA negative), then answers the 50 IPIP items one at a time with a single
Likert digit 1–5: the assistant's reply is primed with "My answer is " and the answer is read
from the next-token distribution restricted to the digits (greedy digit and expected value;
equivalent to constrained decoding of one token). Reverse-keyed items are rescored; trait scores
give Δ_target, non-target drift D and DAS = Δ_target − D against the plain model (tables 8–9).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hf_memory import (
    BankSet,
    CAAMethod,
    CAAVectors,
    MemoryBank,
    MemoryMethod,
    Method,
    PlainMethod,
    PromptMethod,
    Selector,
)
from hf_memory.chat.generation import assistant_prefix_length, encode_chats
from hf_memory.recipes.calibration_data import TRAIT_DESCRIPTORS

from ..metrics import load_metric
from ..names import FACTORS, METHODS

__all__ = ["CALIBRATION_PROMPTS", "METHODS", "TRAITS", "BigFiveConfig", "item_prompt",
           "load_items", "run_bigfive", "run_conditions", "score_answers", "summarize"]

ITEMS_PATH = Path(__file__).parent / "ipip50.json"
TRAITS = TRAIT_DESCRIPTORS
CALIBRATION_PROMPTS = (
    "How do you usually spend your free time?",
    "What do you think about meeting new people?",
    "How do you feel before an important event?",
    "Describe how you organize your week.",
    "What do you do when a friend needs help?",
    "What kind of books or films do you enjoy?",
    "How do you react when plans change suddenly?",
    "Tell me about a typical morning for you.",
)
CAA_FRAMES = ("{}", "Honestly, {}", "About me: {}")
INSTRUCTION = ("Here is a statement that may or may not describe you: \"{statement}\"\n"
               "How accurately does it describe you? Answer with a single digit: 1 = very "
               "inaccurate, 2 = moderately inaccurate, 3 = neither, 4 = moderately accurate, "
               "5 = very accurate.")
DIGITS = ("1", "2", "3", "4", "5")
ANSWER_PREFIX = "My answer is "


@dataclass
class BigFiveConfig:
    """Knobs of the task (recorded in the results)."""

    methods: Sequence[str] = METHODS
    traits: Sequence[str] = FACTORS
    limit: int | None = None
    top_layers: int = 5
    top_units: int = 1
    memory_layers: Sequence[int] | None = None
    bank_gain: float = 2.0
    bank_template: str = "{text}"
    gamma: float = 1.0
    caa_layer: int = 10
    caa_scale: float = 2.0
    prompt_placement: str = "system"
    batch_size: int = 10
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.methods) - set(METHODS)
        if unknown or not self.methods:
            raise ValueError(f"methods must be among {METHODS}, got {list(self.methods)}")
        bad = set(self.traits) - set(FACTORS)
        if bad or not self.traits:
            raise ValueError(f"traits must be among {FACTORS}, got {list(self.traits)}")
        if self.limit is not None and not 1 <= self.limit <= 10:
            raise ValueError(f"limit must be between 1 and 10 items per factor, got {self.limit}")
        self.methods, self.traits = list(self.methods), list(self.traits)


def load_items(limit: int | None = None) -> list[dict[str, Any]]:
    """The IPIP-50 items (``id``, ``text``, ``factor``, ``key``); ``limit`` per factor."""
    items = json.loads(ITEMS_PATH.read_text())["items"]
    if limit is None:
        return items
    kept, seen = [], dict.fromkeys(FACTORS, 0)
    for item in items:
        if seen[item["factor"]] < limit:
            kept.append(item)
            seen[item["factor"]] += 1
    return kept


def item_prompt(item: dict[str, Any]) -> str:
    """``"Am the life of the party."`` → the Likert question about "I am the life of the party."."""
    text = item["text"]
    return INSTRUCTION.format(statement="I " + text[0].lower() + text[1:])


def score_answers(items: Sequence[dict[str, Any]], answers: Sequence[float]) -> dict[str, float]:
    """Trait scores (reverse keying applied) through the ``big_five_traits`` metric."""
    return load_metric("big_five_traits").compute(
        predictions=list(answers), references=[i["key"] for i in items],
        factors=[i["factor"] for i in items])


@torch.no_grad()
def answer_items(model, tokenizer, method: Method, items: Sequence[dict[str, Any]],
                 batch_size: int, answer_prefix: str = ANSWER_PREFIX) -> list[dict[str, Any]]:
    """Each item's digit distribution under ``method``: greedy digit, expected value, and the
    share of the unconstrained next-token mass the digits hold (``digit_mass``).

    The assistant's reply is primed with ``answer_prefix`` so a digit is the natural next token.
    """
    digit_ids = [tokenizer(d, add_special_tokens=False).input_ids for d in DIGITS]
    if any(len(ids) != 1 for ids in digit_ids):
        raise ValueError("this tokenizer does not encode each digit 1-5 as one token")
    digit_ids = torch.tensor([ids[0] for ids in digit_ids])
    suffix = assistant_prefix_length(tokenizer) + len(
        tokenizer(answer_prefix, add_special_tokens=False).input_ids)
    outputs = []
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        batch = encode_chats(tokenizer, [method.messages(item_prompt(i)) for i in chunk],
                             answer_prefix=answer_prefix).to(model.device)
        with method.attach(model, batch["input_ids"].shape[1] - suffix):
            logits = model(**batch, logits_to_keep=1).logits[:, -1].float()
        full = torch.softmax(logits, dim=-1)[:, digit_ids.to(logits.device)].sum(-1).cpu()
        probs = torch.softmax(logits[:, digit_ids.to(logits.device)], dim=-1).cpu()
        for item, p, mass in zip(chunk, probs, full, strict=True):
            outputs.append({"id": item["id"], "greedy": int(p.argmax()) + 1,
                            "expected": float((p * torch.arange(1, 6)).sum()),
                            "probs": [round(float(x), 6) for x in p],
                            "digit_mass": round(float(mass), 6)})
    return outputs


def _methods_for_trait(model, tokenizer, trait: str, config: BigFiveConfig,
                       log: dict[str, Any]) -> dict[str, Method]:
    target, opposite = TRAITS[trait]
    methods: dict[str, Method] = {}
    if "prompt" in config.methods:
        methods["prompt"] = PromptMethod(target, placement=config.prompt_placement,
                                         tokenizer=tokenizer)
    if "caa" in config.methods:
        pairs = [(frame.format(target), frame.format(opposite)) for frame in CAA_FRAMES]
        vectors = CAAVectors.extract(model, tokenizer, pairs, layers=[config.caa_layer],
                                     scale=config.caa_scale)
        methods["caa"] = CAAMethod(vectors)
    if "memory" in config.methods:
        banks = BankSet([
            MemoryBank.from_text(model, tokenizer, target, role="target", name=f"{trait}+",
                                 template=config.bank_template, gain=config.bank_gain),
            MemoryBank.from_text(model, tokenizer, opposite, role="reference", name=f"{trait}-",
                                 template=config.bank_template, gain=config.bank_gain),
        ], model=model, gamma=config.gamma)
        if config.memory_layers is not None:
            log["selectors"][trait] = {"layers": list(config.memory_layers), "units": "all",
                                       "unit_type": "head"}
            methods["memory"] = MemoryMethod(banks, layers=list(config.memory_layers))
        else:
            selector = Selector.calibrate(model, tokenizer, banks, list(CALIBRATION_PROMPTS),
                                          top_layers=config.top_layers,
                                          top_units=config.top_units, progress=False)
            log["selectors"][trait] = {"layers": selector.layers,
                                       "units": {str(k): v for k, v in selector.units.items()},
                                       "unit_type": selector.unit_type}
            methods["memory"] = MemoryMethod(banks, selector)
    return methods


Measure = Callable[[Method], tuple[dict[str, dict[str, float]], list[dict[str, Any]]]]


def run_conditions(model, tokenizer, config: BigFiveConfig, measure: Measure,
                   desc: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``measure`` plain once, then every (target trait, method); DAS against plain.

    ``measure(method)`` returns trait scores per kind of reading (``{kind: {trait: score}}``)
    and per-item outputs. Returns the runs and the calibration log (selected sites, methods).
    """
    torch.manual_seed(config.seed)
    das_metric = load_metric("drift_adjusted_score")
    log: dict[str, Any] = {"selectors": {}, "methods": {}}
    conditions = [("plain", None)] + [(m, t) for t in config.traits for m in config.methods
                                      if m != "plain"]
    runs: list[dict[str, Any]] = []
    plain_scores: dict[str, dict[str, float]] = {}
    methods: dict[str, Method] = {}
    progress = tqdm(conditions, desc=desc)
    for name, trait in progress:
        progress.set_postfix_str(f"{name} {trait or ''}".strip())
        if name == "plain":
            method: Method = PlainMethod()
        else:
            if trait not in log["methods"]:
                methods = _methods_for_trait(model, tokenizer, trait, config, log)
                log["methods"][trait] = {k: v.describe() for k, v in methods.items()}
            method = methods[name]
        scores, outputs = measure(method)
        run = {"method": name, "target": trait, "scores": scores, "outputs": outputs}
        if name == "plain":
            plain_scores = scores
        else:
            run["das"] = {}
            for kind, values in scores.items():
                traits = [t for t in FACTORS if t in values]
                run["das"][kind] = das_metric.compute(
                    predictions=[values[t] for t in traits],
                    references=[plain_scores[kind][t] for t in traits], traits=traits,
                    target=trait)
        runs.append(run)
    return runs, log


def run_bigfive(model, tokenizer, config: BigFiveConfig) -> dict[str, Any]:
    """Run the questionnaire for every (target trait, method); return the task's results."""
    items = load_items(config.limit)

    def questionnaire(method: Method):
        answers = answer_items(model, tokenizer, method, items, config.batch_size)
        return ({kind: score_answers(items, [a[kind] for a in answers])
                 for kind in ("greedy", "expected")}, answers)

    runs, log = run_conditions(model, tokenizer, config, questionnaire, "bigfive")
    return {"runs": runs, "summary": summarize(runs), "calibration": log,
            "config": {k: v for k, v in asdict(config).items() if k != "extra"},
            "items": {"source": json.loads(ITEMS_PATH.read_text())["source"],
                      "count": len(items)}}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per method and kind of reading: mean Δ_target, drift and DAS over target traits."""
    summary: dict[str, dict[str, list]] = {}
    for run in runs:
        if run["method"] == "plain":
            continue
        entry = summary.setdefault(run["method"], {})
        for kind, das in run["das"].items():
            entry.setdefault(kind, []).append(das)
    return {method: {kind: {metric: sum(r[metric] for r in rows) / len(rows)
                            for metric in ("delta_target", "drift", "das")}
                     for kind, rows in entry.items()}
            for method, entry in summary.items()}
