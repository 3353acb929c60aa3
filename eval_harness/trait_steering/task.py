"""Trait steering on held-out items: prompt, CAA and memory inception (both selectors), each at
its calibrated strength, with controls, for the ten Big Five steering directions.

For each direction (a trait, towards it ``+`` or away from it ``-``) everything is frozen on
calibration data first (``hf_memory/data/calibration_pairs.json``, disjoint from every scored
item): the target bank (and the reference bank, the opposite descriptor), the behavioural and
the diagnostic selector, the CAA vector and its scale. Then each method is scored on

- the **likelihood task**: 80 held-out contrast pairs (``data/trait_pairs.json``, 16 per trait):
  margin log p(trait-high reply) − log p(trait-low reply), per item;
- the **questionnaire**: IPIP-50 expected Likert answers, acquiescence-corrected per trait.

Both go through the ``steering_shift`` metric (target shift, drift, DAS, bootstrap 95 %
intervals). Beside the likelihood, what users see: **judged replies** (``judge_prompts`` > 0) —
plain, prompt, CAA and memory answer the first held-out questions of the direction's trait
greedily, each reply scored by a :class:`~hf_memory.metrics.reply_judge.ReplyJudge` fitted on
the direction's calibration pairs (a judge under 0.8 held-out accuracy judges nothing; its
refusal is recorded), fluency beside. Beside each memory condition the same sites and gains
carry a neutral bank and the reference bank (what any bank does; the target-minus-reference
directional effect); beside the prompt, the neutral text and the reference descriptor as
prompts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from tqdm.auto import tqdm

from hf_memory import (
    BankSet,
    MemoryBank,
    MemoryMethod,
    Method,
    PlainMethod,
    PromptMethod,
    Selector,
    kv_footprint,
)
from hf_memory.banks.neutral_control import neutral_text
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.reply_judge import judge_or_refuse
from hf_memory.recipes.calibration_data import (
    calibration_pairs,
    calibration_prompts,
    direction_parts,
    oriented,
)

from ..bigfive.task import answer_items, load_items
from ..directions import (
    EVAL_PATH,
    TraitSteeringConfig,
    behavioural_selector,
    calibrate_direction,
    direction_bank,
    eval_pairs,
    neutral_control,
    site_mass,
)
from ..metrics import load_metric

__all__ = ["JUDGED_METHODS", "judged_replies", "run_layer_ablation", "run_trait_steering",
           "summarize"]

JUDGED_METHODS = ("plain", "prompt", "caa", "memory")


def judged_replies(model, tokenizer, frozen, questions: Sequence[str],
                   max_new_tokens: int = 40) -> dict[str, Any]:
    """Plain, prompt, CAA and memory's greedy replies to ``questions``, judged by a reply judge
    fitted on ``frozen``'s calibration pairs
    (:func:`~hf_memory.metrics.reply_judge.judge_or_refuse`): ``{"judge", "questions",
    "methods": {name: row}}``, or ``{"judge", "refused": why}``."""
    methods = {"plain": PlainMethod(), **{name: frozen.methods[name]
                                          for name in JUDGED_METHODS if name != "plain"}}
    judged = judge_or_refuse(model, tokenizer, [tuple(p) for p in frozen.setup[
        "calibration_pairs"]], list(questions), methods, max_new_tokens=max_new_tokens)
    return judged if "refused" in judged else {**judged, "questions": len(questions)}


def run_trait_steering(model, tokenizer, config: TraitSteeringConfig) -> dict[str, Any]:
    """Calibrate and score every direction; return the task's results (see module docstring)."""
    torch.manual_seed(config.seed)
    items = eval_pairs(config.limit)
    questions = load_items(config.questionnaire_limit)
    metric = load_metric("steering_shift")
    cache: dict[str, dict[str, list[float]]] = {}

    def measure(key: str, method: Method, questionnaire: bool) -> dict[str, list[float]]:
        entry = cache.setdefault(key, {})
        if "likelihood" not in entry:
            pairs = [oriented(i, 1) for i in items]
            entry["likelihood"] = pair_margins(model, tokenizer, pairs, method=method,
                                               batch_size=config.batch_size).tolist()
        if questionnaire and "questionnaire" not in entry:
            answers = answer_items(model, tokenizer, method, questions, config.batch_size)
            entry["questionnaire"] = [a["expected"] for a in answers]
        return entry

    def shift(key: str, direction: str, task: str) -> dict[str, Any]:
        plain = cache["plain"][task]
        rows = items if task == "likelihood" else questions
        keys = None if task == "likelihood" else [q["key"] for q in questions]
        result = metric.compute(predictions=cache[key][task], references=plain,
                                traits=[r["trait" if task == "likelihood" else "factor"]
                                        for r in rows],
                                keys=keys, target=direction[0],
                                direction=1 if direction[1] == "+" else -1,
                                num_bootstrap=config.num_bootstrap, seed=config.seed)
        if task == "questionnaire":
            result["acquiescence"] = (sum(cache[key][task]) - sum(plain)) / len(plain)
        return result

    measure("plain", PlainMethod(), True)
    neutral = neutral_text()
    if config.controls:
        measure("prompt-neutral", PromptMethod(neutral, tokenizer=tokenizer), False)
    prompts = calibration_prompts()
    runs, setups = [], {}
    for direction in tqdm(config.directions, desc="trait steering"):
        frozen = calibrate_direction(model, tokenizer, direction, config)
        target, reference = frozen.target, frozen.reference
        target_bank, reference_bank = frozen.target_bank, frozen.reference_bank
        banks, selector = frozen.banks, frozen.selector
        methods: dict[str, Method] = dict(frozen.methods)
        setup = frozen.setup
        if config.diagnostic:
            contrastive = BankSet([target_bank, reference_bank], model=model)
            diagnostic = Selector.calibrate(model, tokenizer, contrastive, prompts,
                                            top_layers=config.top_layers, progress=False)
            methods["memory-diagnostic"] = MemoryMethod(contrastive, diagnostic)
            setup["memory-diagnostic"] = {
                "layers": diagnostic.layers,
                "units": {str(k): v for k, v in diagnostic.units.items()},
                "routing_mass": site_mass(model, tokenizer, methods["memory-diagnostic"],
                                           prompts[:4])}
        if config.controls:
            same_sites = {"selector": selector}
            neutral_bank = direction_bank(model, tokenizer, neutral, "target", "neutral", config)
            as_target = MemoryBank.from_tensors(reference_bank.keys, reference_bank.values,
                                                name="reference", role="target",
                                                layers=reference_bank.layers,
                                                provenance=reference_bank.provenance)
            methods["memory-neutral"] = MemoryMethod(BankSet([neutral_bank], model=model),
                                                     **same_sites)
            methods["memory-reference"] = MemoryMethod(BankSet([as_target], model=model),
                                                       **same_sites)
            methods["prompt-reference"] = PromptMethod(reference, tokenizer=tokenizer)
        setups[direction] = setup
        for name, method in methods.items():
            key = {"prompt": f"prompt:{target}", "prompt-reference": f"prompt:{reference}",
                   "prompt-neutral": "prompt-neutral"}.get(name, f"{name}:{direction}")
            questionnaire = name in ("prompt", "caa", "memory", "memory-diagnostic")
            measure(key, method, questionnaire)
            run = {"direction": direction, "method": name, "key": key,
                   "likelihood": shift(key, direction, "likelihood")}
            if questionnaire:
                run["questionnaire"] = shift(key, direction, "questionnaire")
            runs.append(run)
        if config.controls:
            runs.append({"direction": direction, "method": "prompt-neutral",
                         "key": "prompt-neutral",
                         "likelihood": shift("prompt-neutral", direction, "likelihood")})
        if config.judge_prompts:
            asked = [i["question"] for i in items
                     if i["trait"] == direction[0]][:config.judge_prompts]
            judged = judged_replies(model, tokenizer, frozen, asked)
            rows = judged.pop("methods", {})
            setup["judged"] = {**judged, **({"plain": rows["plain"]} if rows else {})}
            for run in runs:
                if run["direction"] == direction and run["method"] in rows:
                    run["judged"] = rows[run["method"]]
        footprint = kv_footprint(model, banks, tokenizer(target, return_tensors="pt",
                                                         add_special_tokens=False).input_ids,
                                 layers=selector.layers)
        setup["kv"] = footprint.as_dict()
    return {"runs": runs, "summary": summarize(runs), "setups": setups,
            "config": {k: v for k, v in asdict(config).items() if k != "extra"},
            "items": {"likelihood": len(items), "questionnaire": len(questions),
                      "source": json.loads(EVAL_PATH.read_text())["source"]},
            "scores": cache}


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per method and task: mean target shift, drift, DAS over directions; directions moved the
    right way (point estimate > 0) and significantly so (interval above 0)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for run in runs:
        for task in ("likelihood", "questionnaire"):
            if task not in run:
                continue
            entry = table.setdefault(run["method"], {}).setdefault(
                task, {"target_shift": [], "drift": [], "das": [], "right_way": 0,
                       "significant": 0, "directions": 0})
            result = run[task]
            for name in ("target_shift", "drift", "das"):
                entry[name].append(result[name])
            entry["directions"] += 1
            entry["right_way"] += result["target_shift"] > 0
            entry["significant"] += result.get("target_shift_ci", [0.0])[0] > 0
    for methods in table.values():
        for entry in methods.values():
            for name in ("target_shift", "drift", "das"):
                entry[name] = sum(entry[name]) / len(entry[name])
    return table


def run_layer_ablation(model, tokenizer, config: TraitSteeringConfig,
                       max_layers: int = 8) -> dict[str, Any]:
    """Paper figure 3: effect and KV footprint as the number of steered layers grows.

    For each direction the behavioural search ranks layers alone (stage 1); the top ``k`` of
    that ranking, at the gain and strength the search chose, are scored on the held-out
    likelihood items for k = 1 … ``max_layers``, beside the visible prompt's effect and KV
    bytes.
    """
    config = replace(config, layer_stride=1)  # the ranking needs every layer scored alone
    items = eval_pairs(config.limit)
    pairs_all = [oriented(i, 1) for i in items]
    traits = [i["trait"] for i in items]
    metric = load_metric("steering_shift")
    plain = pair_margins(model, tokenizer, pairs_all, batch_size=config.batch_size).tolist()
    rows = []
    for direction in tqdm(config.directions, desc="layer ablation"):
        _, _, target, _ = direction_parts(direction)
        pairs, drift = calibration_pairs(direction, config.calibration_pairs,
                                         config.drift_pairs)
        bank = direction_bank(model, tokenizer, target, "target", "persona", config)
        banks = BankSet([bank], model=model)
        selector = behavioural_selector(model, tokenizer, banks, pairs, drift, config,
                                        direction,
                                        control=neutral_control(model, tokenizer, config))
        screened = selector.config.get("screened_layers", selector.candidate_layers)
        singles = selector.config["history"][:len(screened)]
        ranking = [s["layers"][0] for s in sorted(singles, key=lambda s: -s["score"])]
        gain = next(iter(selector.layer_gains.values()))
        descriptor = tokenizer(target, return_tensors="pt", add_special_tokens=False).input_ids

        def score(method: Method, direction: str = direction) -> dict[str, Any]:
            margins = pair_margins(model, tokenizer, pairs_all, method=method,
                                   batch_size=config.batch_size).tolist()
            return metric.compute(predictions=margins, references=plain, traits=traits,
                                  target=direction[0],
                                  direction=1 if direction[1] == "+" else -1,
                                  num_bootstrap=config.num_bootstrap, seed=config.seed)

        prompt = PromptMethod(target, tokenizer=tokenizer)
        entry = {"direction": direction, "ranking": ranking, "gain": gain,
                 "strength": selector.strength,
                 "selected": selector.layers, "prompt": score(prompt),
                 "prompt_kv_bytes": prompt.guidance_kv_bytes(model, tokenizer,
                                                             items[0]["question"]),
                 "steps": []}
        for k in range(1, min(max_layers, len(ranking)) + 1):
            layers = sorted(ranking[:k])
            method = MemoryMethod(banks, layers=layers, layer_gains=dict.fromkeys(layers, gain),
                                  strength=selector.strength)
            footprint = kv_footprint(model, banks, descriptor, layers=layers)
            entry["steps"].append({"layers": layers, "bank_bytes": footprint.bank_bytes,
                                   **score(method)})
        rows.append(entry)
    return {"rows": rows, "config": {k: v for k, v in asdict(config).items() if k != "extra"},
            "max_layers": max_layers}
