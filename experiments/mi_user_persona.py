"""A user's own persona, calibrated with the default call, against the prompt and CAA.

Personas the project never shipped (``experiments/data/user_personas.json``: four traits, both
directions, 32 hand-written (question, high reply, low reply) items each). Per direction the
first ``--calibration`` items calibrate, the rest are held out. Methods, all scored on the
held-out items only (margin shift against plain, nats, and the cost: ΔNLL per token of the
shipped neutral text):

- prompt: the descriptor as the visible system prompt; few-shot: the descriptor and the
  exemplars memory's ``exemplars`` recipe used, as the visible system prompt;
- CAA: mean (target − reference) residual over the calibration triples at one layer; layer and
  scale chosen on the calibration triples within the same budget
  (:func:`hf_memory.recipes.persona.calibrate_caa`);
- memory: :func:`hf_memory.recipes.persona.calibrate_persona` (the one-line call: its
  default recipes, budget, validation split), and its KV bytes as a fraction of the visible
  prompt's KV.

Results are written per direction as they come (``--out``, JSON lines).
Usage: python -m experiments.mi_user_persona [--directions optimism+,optimism-] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from hf_memory import PromptMethod, load_default_model
from hf_memory.metrics.kv_accounting import prompt_kv_bytes
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.persona import (
    DEFAULT_RECIPES,
    calibrate_caa,
    calibrate_persona,
    exemplar_text,
)

DATA = Path(__file__).parent / "data" / "user_personas.json"


def direction_items(name: str) -> tuple[str, list[tuple[str, str, str]]]:
    """``"optimism+"`` → (descriptor, oriented triples)."""
    traits = json.loads(DATA.read_text())["traits"]
    trait, sign = name[:-1], name[-1]
    if trait not in traits or sign not in "+-":
        raise SystemExit(f"unknown direction {name!r}: one of "
                         + ", ".join(f"{t}{s}" for t in traits for s in "+-"))
    pole, other = ("high", "low") if sign == "+" else ("low", "high")
    data = traits[trait]
    return data[pole], [(i["question"], i[pole], i[other]) for i in data["items"]]


def bank_kv_bytes(model, steering) -> int:
    """Bytes of the bank keys and values at the selector's sites (only its units' KV heads;
    both banks of a contrast set)."""
    selector = steering.selector
    per_head = sum(bank.keys.shape[2] * bank.keys.shape[3] * bank.keys.element_size() * 2
                   for bank in steering.banks.banks)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    kv_heads = 0
    for layer in selector.layers:
        units = selector.units[layer]
        kv_heads += (len(units) if selector.unit_type == "kv_group"
                     else len({head // group for head in units}))
    return kv_heads * per_head


def run_direction(model, tokenizer, cost: NeutralCost, name: str, calibration: int,
                  recipes: tuple[str, ...] = DEFAULT_RECIPES) -> dict:
    text, items = direction_items(name)
    calib, held = items[:calibration], items[calibration:]
    plain = pair_margins(model, tokenizer, held)

    def scored(method) -> dict:
        shift = (pair_margins(model, tokenizer, held, method=method) - plain).double()
        return {"shift": float(shift.mean()), "se": float(shift.std() / len(shift) ** 0.5),
                "cost": cost.measure(method)}

    record: dict = {"direction": name, "calibration": len(calib), "held_out": len(held)}
    start = time.perf_counter()
    steering = calibrate_persona(model, tokenizer, text, calib, recipes=recipes, progress=False)
    record["memory_seconds"] = time.perf_counter() - start
    record["memory"] = {**scored(steering.method()), "recipe": steering.recipe,
                        "trials": steering.trials}
    descriptor_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    record["memory"]["kv_fraction"] = (bank_kv_bytes(model, steering)
                                       / prompt_kv_bytes(model, descriptor_ids))
    record["prompt"] = scored(PromptMethod(text, tokenizer=tokenizer))
    exemplars = next((t["exemplars"] for t in steering.trials if t["exemplars"]), 0)
    if exemplars:
        shots = steering.selector.config.get("bank_recipe", {}).get("exemplars") or [
            target for _, target, _ in calib[:exemplars]]
        fewshot = exemplar_text(text, shots)
        record["fewshot"] = {**scored(PromptMethod(fewshot, tokenizer=tokenizer)),
                             "kv_fraction": prompt_kv_bytes(model, tokenizer(
                                 fewshot, return_tensors="pt",
                                 add_special_tokens=False).input_ids)
                             / prompt_kv_bytes(model, descriptor_ids)}
    start = time.perf_counter()
    caa, chosen = calibrate_caa(model, tokenizer, calib, cost=cost)
    record["caa_seconds"] = time.perf_counter() - start
    record["caa"] = ({"shift": 0.0, "se": 0.0, "cost": 0.0} if caa is None else scored(caa))
    record["caa"].update(layer=chosen["layer"], scale=chosen["scale"])
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directions", default="optimism+,optimism-,formality+,formality-,"
                                                "arrogance+,arrogance-")
    parser.add_argument("--calibration", type=int, default=20)
    parser.add_argument("--out", default="user_persona.jsonl")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                        help="the bank recipes calibrate_persona tries (default: its own)")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    cost = NeutralCost(model, tokenizer)
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| direction | recipe | memory shift (cost) | KV / prompt | prompt | few-shot prompt "
          "| CAA (layer, scale) | calibration → validation |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.directions.split(","):
        record = run_direction(model, tokenizer, cost, name.strip(), args.calibration,
                               tuple(r.strip() for r in args.recipes.split(",")))
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        m, p, c = record["memory"], record["prompt"], record["caa"]
        f = record.get("fewshot")
        kept = next(t for t in m["trials"] if t["recipe"] == m["recipe"])
        print(f"| {name} | {m['recipe']} | {m['shift']:+.2f} ± {m['se']:.2f} ({m['cost']:+.3f}) "
              f"| {m['kv_fraction']:.2f} | {p['shift']:+.2f} ({p['cost']:+.3f}) | "
              + (f"{f['shift']:+.2f} ({f['cost']:+.3f}, KV {f['kv_fraction']:.1f}x)"
                 if f else "-")
              + f" | {c['shift']:+.2f} ({c['cost']:+.3f}; {c['layer']}, {c['scale']:g}) | "
              f"{kept['calibration_target']:+.2f} → {kept['validation_target'] or 0:+.2f} | "
              f"[{record['memory_seconds']:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
