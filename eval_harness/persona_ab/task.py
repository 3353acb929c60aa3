"""``persona-ab``: the field's persona steering benchmark (steering-bench's A/B sets of Anthropic's
model-written evaluations) for plain, prompt, CAA and memory inception, at matched cost.

Per set (``data/<set>.jsonl.gz``, 1,000 items: a statement, "would you say it?", answers (A) and
(B), one of them the persona's), a seeded shuffle gives a **calibration** split and a disjoint
**held-out** split. Everything a method needs is frozen on the calibration split; every number
reported is measured on the held-out split only.

- **propensity** of an item = log p(positive answer) − log p(negative answer) as the
  assistant's reply to the chat-templated prompt
  (:func:`hf_memory.metrics.likelihood.pair_margins`);
  ``mcq_acc`` = share of items with propensity > 0 (steering-bench's ``logprob_diff`` and
  ``mcq_acc``).
- **methods**, each with a dial whose zero is the plain model and whose 1 is its calibrated
  point: *prompt* (the set's positive persona system prompt, appended to the template's
  system message; dial 0 or 1); *CAA* by the standard recipe (Rimsky et al.): the mean residual
  difference after attention at the answer letter of "(A" / "(B" over the calibration items'
  positive and negative answers, added from the end of the instruction on; layer (among
  ``caa_layers``) and scale (among ``caa_scales``) chosen on the calibration split by
  :func:`hf_memory.selection.behavioural_search.best_strength` within ``cost_budget``; dial =
  multiple of that
  scale); *memory* (a bank of the positive persona prompt,
  :func:`hf_memory.recipes.shipped.persona_bank`,
  at the sites of a behavioural selector calibrated within ``cost_budget`` net of a neutral
  bank, :meth:`hf_memory.Selector.calibrate_behavioural`; dial = ``strength`` of
  :class:`hf_memory.MemoryMethod`, a multiple of the selector's calibrated strength).
- **steerability** = least-squares slope of mean propensity against the dial (= the mean of the
  items' own slopes, so it gets a bootstrap interval over items); **wrong-way fraction** =
  share of items whose own slope is negative (steering-bench's anti-steerable items).
- **cost** of every point = ΔNLL per token of neutral text
  (:class:`hf_memory.metrics.steering_cost.NeutralCost`, the shipped calibration-side text: the same
  text the budget was enforced on); **shift** = propensity − plain propensity per held-out item,
  with a 95 % percentile bootstrap interval over items; **matched cost**: per method the
  steered point (dial > 0) with the largest shift among those costing at most ``cost_budget``;
  a method with none within it steers nothing there (the plain point, shift 0, ``fits``
  false). The pick is made on the held-out items (as in ``tradeoff``), so it leans optimistic;
  the calibrated point (dial 1) is the unselected number.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from hf_memory import (
    BankSet,
    CAAMethod,
    CAAVectors,
    MemoryMethod,
    Method,
    PlainMethod,
    PromptMethod,
)
from hf_memory.banks.neutral_control import neutral_text
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.shipped import persona_bank
from hf_memory.selection.behavioural_search import ShiftObjective, best_strength, check_weight
from hf_memory.selection.selector import Selector

from ..intervals import mean_interval
from ..names import PERSONA_SETS, check_positive_ints

__all__ = ["DATA_DIR", "METHODS", "PersonaABConfig", "caa_contrast_texts", "default_caa_layers",
           "least_squares_slopes", "load_persona_set", "matched_point", "persona_prompts",
           "propensities", "run_persona_ab", "split_items", "summarize", "triples", "with_matched"]

DATA_DIR = Path(__file__).parent / "data"
METHODS = ("prompt", "caa", "memory")
ANSWERS = ("(A)", "(B)")
SOURCE = ("Anthropic model-written evaluations (Perez et al., 2022; CC-BY-4.0), steering-bench's "
          "processed mwe_persona sets and persona prompts (Tan et al., NeurIPS 2024; MIT)")


def persona_prompts(data_dir: str | Path | None = None) -> dict[str, dict[str, str]]:
    """Set name -> ``{"positive_system_prompt", "negative_system_prompt"}``."""
    path = Path(data_dir or DATA_DIR) / "persona_prompts.json"
    try:
        prompts = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise ValueError(f"cannot read the persona prompts {path}: {error}") from None
    if not isinstance(prompts, dict):
        raise ValueError(f"{path} must map set names to their persona prompts")
    return prompts


def _check_item(row: Any, where: str) -> dict[str, str]:
    if (not isinstance(row, dict) or set(row) != {"prompt", "positive", "negative"}
            or not isinstance(row["prompt"], str) or not row["prompt"].strip()
            or not isinstance(row["positive"], str) or not isinstance(row["negative"], str)
            or sorted((row["positive"], row["negative"])) != list(ANSWERS)):
        raise ValueError(f"{where}: an item is {{\"prompt\": non-empty text, \"positive\" and "
                         f"\"negative\": \"(A)\" and \"(B)\"}}, got {row!r:.120}")
    return row


def load_persona_set(name: str, data_dir: str | Path | None = None) -> list[dict[str, str]]:
    """The items of persona set ``name``, each ``{"prompt", "positive", "negative"}`` (answers
    ``"(A)"`` / ``"(B)"``), in the shipped order. One ``ValueError`` naming the problem for an
    unknown set, a set without persona prompts, or a malformed file."""
    directory = Path(data_dir or DATA_DIR)
    path = directory / f"{name}.jsonl.gz"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".jsonl.gz") for p in directory.glob("*.jsonl.gz"))
        raise ValueError(f"no persona set {name!r} in {directory} (sets: {', '.join(known)})")
    prompts = persona_prompts(directory)
    entry = prompts.get(name)
    if (not isinstance(entry, dict) or not all(
            isinstance(entry.get(k), str) and entry[k].strip()
            for k in ("positive_system_prompt", "negative_system_prompt"))):
        raise ValueError(f"persona set {name!r} has no positive and negative system prompt in "
                         f"{directory / 'persona_prompts.json'}")
    try:
        lines = gzip.decompress(path.read_bytes()).decode("utf-8").splitlines()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a gzip'd UTF-8 JSON-lines file: {error}") from None
    items = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
            raise ValueError(f"{path} line {number} is not JSON: {error}") from None
        items.append(_check_item(row, f"{path} line {number}"))
    if not items:
        raise ValueError(f"{path} holds no items")
    return items


def split_items(items: Sequence[dict[str, str]], calibration: int, heldout: int, *, seed: int,
                name: str = "") -> tuple[list[int], list[int]]:
    """Indices of a calibration split and a disjoint held-out split of ``items``: a shuffle
    seeded by ``seed`` and the set's ``name``, its first ``calibration`` then the next
    ``heldout`` indices."""
    for label, value in (("calibration", calibration), ("held-out", heldout)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the {label} split needs a positive number of items, got "
                             f"{value!r}")
    if calibration > len(items):
        raise ValueError(f"the calibration split ({calibration} items) is larger than the set "
                         f"{name!r} ({len(items)} items)")
    if calibration + heldout > len(items):
        raise ValueError(f"the calibration and held-out splits ({calibration} + {heldout} "
                         f"items) do not fit disjointly in the set {name!r} ({len(items)} "
                         "items)")
    order = list(range(len(items)))
    random.Random(f"persona-ab:{seed}:{name}").shuffle(order)
    return order[:calibration], order[calibration:calibration + heldout]


def triples(items: Sequence[dict[str, str]]) -> list[tuple[str, str, str]]:
    """``(prompt, positive answer, negative answer)`` contrast triples."""
    return [(i["prompt"], i["positive"], i["negative"]) for i in items]


def propensities(model, tokenizer, items: Sequence[dict[str, str]], method: Method | None = None,
                 batch_size: int = 16) -> np.ndarray:
    """``[N]`` log p(positive answer) − log p(negative answer), each the assistant's reply to
    the chat-templated prompt (as ``method`` presents it and steers), float64."""
    return pair_margins(model, tokenizer, triples(items), method=method,
                        batch_size=batch_size).numpy()


def caa_contrast_texts(tokenizer, items: Sequence[dict[str, str]]) -> list[tuple[str, str]]:
    """CAA's standard contrast (Rimsky et al.): each item's chat-templated prompt followed by the
    positive / negative answer up to its letter ("(B" / "(A"), so the last token, where
    :meth:`~hf_memory.CAAVectors.extract` reads with ``position="last"``, is the letter
    (steering-bench's ``steering_token_index = -2`` of "(B)")."""
    from hf_memory.chat.generation import chat_messages

    pairs = []
    for item in items:
        head = tokenizer.apply_chat_template(chat_messages(item["prompt"]),
                                             add_generation_prompt=True, tokenize=False)
        pairs.append((head + item["positive"][:-1], head + item["negative"][:-1]))
    return pairs


def default_caa_layers(num_layers: int) -> list[int]:
    """A third, two fifths and half of the depth (10, 12, 15 of SmolLM2's 30 layers; CAA's
    best layers sit there, e.g. 13 of Llama-2-7B's 32)."""
    return sorted({min(num_layers - 1, int(f * num_layers)) for f in (1 / 3, 0.4, 0.5)})


def least_squares_slopes(dials: Sequence[float], values: np.ndarray) -> np.ndarray:
    """Least-squares slope of ``values[..., k]`` against ``dials[k]`` (last axis)."""
    x = np.asarray(dials, dtype=np.float64)
    if x.ndim != 1 or len(x) < 2 or np.ptp(x) == 0:
        raise ValueError(f"a slope needs at least two different dial values, got {list(x)}")
    centred = x - x.mean()
    values = np.asarray(values, dtype=np.float64)
    return (values - values.mean(-1, keepdims=True)) @ centred / (centred @ centred)


def matched_point(points: Sequence[dict[str, Any]], budget: float) -> dict[str, Any]:
    """The steered point (dial > 0) with the largest shift among those costing at most
    ``budget`` (ties: the cheaper, then the lower dial); the plain point (dial 0) if none
    does."""
    within = [p for p in points if p["dial"] > 0 and p["cost"] <= budget]
    if not within:
        return next(p for p in points if p["dial"] == 0)
    return max(within, key=lambda p: (p["shift"], -p["cost"], -p["dial"]))


def with_matched(entry: dict[str, Any], config: PersonaABConfig) -> dict[str, Any]:
    """``entry`` (one set's results) with each method's ``matched`` point (:func:`matched_point`
    within ``config.cost_budget``) and its 95 % interval, from the stored per-item propensities
    (so a resumed run applies the rule of the code that reports it)."""
    for row in entry["methods"].values():
        points = row["points"]
        chosen = matched_point(points, config.cost_budget)
        plain = np.asarray(points[0]["propensities"])
        shift = np.asarray(chosen["propensities"]) - plain
        row["matched"] = {"dial": chosen["dial"], "setting": chosen["setting"],
                          "shift": chosen["shift"], "cost": chosen["cost"],
                          "fits": chosen["dial"] > 0,
                          "shift_ci": mean_interval(shift, config.num_bootstrap, config.seed)}
    return entry


@dataclass
class PersonaABConfig:
    """Knobs of the task (recorded in the results). ``dials``: the dial values scored for CAA
    and memory (0 and 1 are always among them); ``caa_layers``: CAA's candidate layers (None:
    :func:`default_caa_layers`); ``checkpoint``: a JSON file where each finished set is saved
    and from which a rerun with the same configuration and model resumes."""

    sets: Sequence[str] = PERSONA_SETS
    calibration_items: int = 32
    heldout_items: int = 200
    dials: Sequence[float] = (0.0, 0.5, 1.0)
    caa_layers: Sequence[int] | None = None
    caa_scales: Sequence[float] = (0.5, 1.0, 2.0, 4.0, 8.0)
    top_layers: int = 3
    cost_budget: float = 0.1
    batch_size: int = 16
    num_bootstrap: int = 1000
    seed: int = 0
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        sets = [self.sets] if isinstance(self.sets, str) else list(self.sets)
        unknown = [s for s in sets if s not in PERSONA_SETS]
        if not sets or unknown or len(set(sets)) != len(sets):
            raise ValueError(f"sets must be distinct names among {', '.join(PERSONA_SETS)}; "
                             f"got {sets}")
        self.sets = sets
        check_positive_ints(self, ("calibration_items", "heldout_items", "top_layers",
                                   "batch_size", "num_bootstrap"))
        dials = [float(d) for d in self.dials]
        if any(not 0.0 <= d <= 1.0 for d in dials):  # NaN fails too
            raise ValueError(f"dials must be in [0, 1] (0: plain, 1: the calibrated point), got "
                             f"{list(self.dials)}")
        self.dials = sorted({0.0, 1.0, *dials})
        scales = [float(s) for s in self.caa_scales]
        if not scales or any(not (math.isfinite(s) and s > 0) for s in scales):
            raise ValueError(f"caa_scales must be finite and > 0, got {list(self.caa_scales)}")
        self.caa_scales = sorted(set(scales))
        if self.caa_layers is not None:
            layers = [int(i) for i in self.caa_layers]
            if not layers or min(layers) < 0:
                raise ValueError(f"caa_layers must be layer indices >= 0, got "
                                 f"{list(self.caa_layers)}")
            self.caa_layers = sorted(set(layers))
        self.cost_budget = check_weight("cost_budget", self.cost_budget)


@dataclass
class _Frozen:
    """One set's methods frozen on its calibration split: ``make[name](dial)`` builds the
    method at that dial (> 0); ``setting[name](dial)`` is the absolute scale or strength."""

    make: dict[str, Callable[[float], Method]]
    setting: dict[str, Callable[[float], float]]
    setup: dict[str, Any]


def _calibrate(model, tokenizer, calibration: list[dict[str, str]],
               config: PersonaABConfig, cost: NeutralCost, control: BankSet,
               positive: str) -> _Frozen:
    """Freeze prompt, CAA (layer and scale) and memory (bank, selector) on the calibration
    split (module docstring)."""
    pairs = triples(calibration)
    layers = config.caa_layers or default_caa_layers(model.config.num_hidden_layers)
    if max(layers) >= model.config.num_hidden_layers:
        raise ValueError(f"caa_layers {layers} exceed the model's "
                         f"{model.config.num_hidden_layers} layers")
    vectors = CAAVectors.extract(model, tokenizer, caa_contrast_texts(tokenizer, calibration),
                                 layers=layers, position="last")
    objective = ShiftObjective(model, tokenizer, pairs, batch_size=config.batch_size, cost=cost)
    per_layer, best = {}, None
    for layer in layers:
        single = CAAVectors({layer: vectors.vectors[layer]}, fingerprint=vectors.fingerprint,
                            provenance=vectors.provenance)
        scale, rows = best_strength(objective, lambda s, v=single: CAAMethod(v, scale=s),
                                    config.caa_scales, cost_budget=config.cost_budget)
        chosen = next((r for r in rows if r["strength"] == scale), None)
        per_layer[str(layer)] = {"scale": scale, "rows": rows}
        score = chosen["score"] if chosen is not None else -math.inf
        if best is None or score > best[0]:
            best = (score, layer, scale, single)
    _, caa_layer, caa_scale, caa_vectors = best
    bank = persona_bank(model, tokenizer, positive)
    banks = BankSet([bank], model=model)
    selector = Selector.calibrate_behavioural(
        model, tokenizer, banks, pairs, cost_budget=config.cost_budget, cost=cost,
        control_banks=control, top_layers=config.top_layers, batch_size=config.batch_size,
        progress=False)
    make = {
        "prompt": lambda d: PromptMethod(positive, tokenizer=tokenizer),
        "caa": lambda d: CAAMethod(caa_vectors, scale=d * caa_scale),
        "memory": lambda d: MemoryMethod(banks, selector, strength=d),
    }
    setting = {"prompt": lambda d: d, "caa": lambda d: d * caa_scale,
               "memory": lambda d: d * selector.strength}
    setup = {
        "caa": {"layer": caa_layer, "scale": caa_scale, "candidate_layers": layers,
                "position": "answer letter", "pairs": len(pairs), "calibration": per_layer,
                "vector_norm": float(caa_vectors.vectors[caa_layer].double().norm())},
        "memory": {"layers": selector.layers,
                   "units": {str(k): v for k, v in selector.units.items()},
                   "unit_type": selector.unit_type, "strength": selector.strength,
                   "within_budget": bool(selector.config.get("within_budget", True)),
                   "best": selector.config.get("best"), "bank_slots": bank.num_slots,
                   "evaluations": selector.config.get("evaluations"),
                   "validation": selector.config.get("validation")},
    }
    return _Frozen(make, setting, setup)


def _point(dial: float, setting: float, values: np.ndarray, plain: np.ndarray, cost: float,
           config: PersonaABConfig) -> dict[str, Any]:
    shift = values - plain
    return {"dial": dial, "setting": setting, "mean_propensity": float(values.mean()),
            "mcq_acc": float((values > 0).mean()), "shift": float(shift.mean()),
            "shift_ci": mean_interval(shift, config.num_bootstrap, config.seed),
            "cost": cost, "propensities": [round(float(v), 6) for v in values]}


def _score_set(model, tokenizer, name: str, config: PersonaABConfig, cost: NeutralCost,
               control: BankSet, prompts: dict[str, dict[str, str]],
               data_dir: str | Path | None) -> dict[str, Any]:
    """Calibrate on one set's calibration split and score every method's dial points on its
    held-out split."""
    items = load_persona_set(name, data_dir)
    calibration, heldout = split_items(items, config.calibration_items, config.heldout_items,
                                       seed=config.seed, name=name)
    positive = prompts[name]["positive_system_prompt"]
    frozen = _calibrate(model, tokenizer, [items[i] for i in calibration], config, cost,
                        control, positive)
    held = [items[i] for i in heldout]
    plain = propensities(model, tokenizer, held, PlainMethod(), config.batch_size)
    methods = {}
    for method in METHODS:
        dials = [0.0, 1.0] if method == "prompt" else list(config.dials)
        values = [plain]
        points = [_point(0.0, 0.0, plain, plain, 0.0, config)]
        for dial in dials[1:]:
            steered = frozen.make[method](dial)
            mine = propensities(model, tokenizer, held, steered, config.batch_size)
            values.append(mine)
            points.append(_point(dial, frozen.setting[method](dial), mine, plain,
                                 cost.measure(steered), config))
        slopes = least_squares_slopes(dials, np.stack(values, -1))
        at_one = points[-1]
        methods[method] = {
            "points": points, "steerability": float(slopes.mean()),
            "steerability_ci": mean_interval(slopes, config.num_bootstrap, config.seed),
            "wrong_way_fraction": float((slopes < 0).mean()),
            "calibrated": {k: at_one[k] for k in ("dial", "setting", "shift", "shift_ci",
                                                   "mcq_acc", "mean_propensity", "cost")},
        }
    return {"set": name, "positive_system_prompt": positive,
            "items": {"total": len(items), "calibration": calibration, "heldout": heldout},
            "plain": {"mean_propensity": float(plain.mean()),
                      "mcq_acc": float((plain > 0).mean())},
            "methods": methods, "setup": frozen.setup}


def summarize(sets: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per method, over sets: mean shift at the calibrated point and at matched cost, sets whose
    interval lies above / below 0, mean steerability, wrong-way fraction, mcq_acc and cost."""
    summary: dict[str, Any] = {"sets": len(sets),
                               "plain_mcq_acc": float(np.mean([s["plain"]["mcq_acc"]
                                                               for s in sets]))}
    for method in METHODS:
        rows = [s["methods"][method] for s in sets]
        summary[method] = {
            "shift": float(np.mean([r["calibrated"]["shift"] for r in rows])),
            "above_zero": sum(r["calibrated"]["shift_ci"][0] > 0 for r in rows),
            "below_zero": sum(r["calibrated"]["shift_ci"][1] < 0 for r in rows),
            "matched_shift": float(np.mean([r["matched"]["shift"] for r in rows])),
            "matched_above_zero": sum(r["matched"]["shift_ci"][0] > 0 for r in rows),
            "matched_fits": sum(r["matched"]["fits"] for r in rows),
            "steerability": float(np.mean([r["steerability"] for r in rows])),
            "wrong_way_fraction": float(np.mean([r["wrong_way_fraction"] for r in rows])),
            "mcq_acc": float(np.mean([r["calibrated"]["mcq_acc"] for r in rows])),
            "cost": float(np.mean([r["calibrated"]["cost"] for r in rows])),
        }
    return summary


def _checkpoint_key(model, config: PersonaABConfig) -> str:
    """What a checkpointed set must have been computed with: the model's weights and every knob
    but the set list and the checkpoint's path."""
    from hf_memory import model_fingerprint

    knobs = {k: v for k, v in asdict(config).items() if k not in ("sets", "checkpoint")}
    text = json.dumps([model_fingerprint(model), knobs], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _load_checkpoint(path: Path | None, key: str) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except ValueError:
        return {}
    return saved.get("sets", {}) if saved.get("key") == key else {}


def _save_checkpoint(path: Path, key: str, done: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps({"key": key, "sets": done}, sort_keys=True) + "\n")
    os.replace(partial, path)


def run_persona_ab(model, tokenizer, config: PersonaABConfig,
                   data_dir: str | Path | None = None) -> dict[str, Any]:
    """Calibrate and score every set of ``config`` (module docstring); return the payload."""
    torch.manual_seed(config.seed)
    prompts = persona_prompts(data_dir)
    for name in config.sets:
        load_persona_set(name, data_dir)  # every set readable before hours of work
    checkpoint = Path(config.checkpoint) if config.checkpoint else None
    key = _checkpoint_key(model, config)
    done = _load_checkpoint(checkpoint, key)
    start = time.perf_counter()
    cost = NeutralCost(model, tokenizer, batch_size=config.batch_size)
    control = BankSet([persona_bank(model, tokenizer, neutral_text(), name="neutral")],
                      model=model)
    setup_s = time.perf_counter() - start
    sets, resumed = [], [name for name in config.sets if name in done]
    for name in tqdm(config.sets, desc="persona A/B"):
        if name not in done:
            began = time.perf_counter()
            entry = _score_set(model, tokenizer, name, config, cost, control, prompts,
                               data_dir)
            entry["wall_time_s"] = round(time.perf_counter() - began, 2)
            done[name] = entry
            if checkpoint is not None:
                _save_checkpoint(checkpoint, key, done)
        sets.append(with_matched(done[name], config))
    return {"sets": sets, "summary": summarize(sets),
            "config": {**asdict(config), "caa_layers": config.caa_layers or default_caa_layers(
                model.config.num_hidden_layers)},
            "cost_text": {"passages": len(cost.passages), "replies": len(cost.replies),
                          "tokens": cost.tokens, "source": "hf_memory/data/cost_texts.json"},
            "setup_wall_time_s": round(setup_s, 2), "resumed": resumed,
            "sets_wall_time_s": round(sum(s["wall_time_s"] for s in sets), 2),
            "source": SOURCE}
