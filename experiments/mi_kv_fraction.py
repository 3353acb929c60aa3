"""How little of the visible prompt's KV memory matches the prompt's held-out shift.

The ``prompt_like`` bank (:mod:`hf_memory.recipes.persona`) at every layer, with ρ = 0 (plain
concatenated attention), is the visible system prompt less its chat markers; fewer layers hold a
fraction of its KV. Per direction of the user personas (``experiments/data/user_personas.json``,
the split of ``mi_user_persona.py``: the first ``--calibration`` items calibrate, the rest are
held out):

1. each layer alone, all KV groups, ρ = 0, is scored on the calibration items (margin shift
   against plain) and on the neutral text (its cost); the layers whose cost alone is within the
   budget are ranked by their shift (the held-out items play no part; a layer over the budget
   alone cannot be part of a budgeted configuration, and the early ones are: on the embedded
   model layer 1 alone costs more than a nat per token);
2. the top ``k`` layers, for ``k`` in ``--ks`` and for ``k`` = every layer within the budget
   alone (the visible prompt less the layers a bank alone breaks), and ρ in ``--gains``, are
   scored on the held-out items, with their cost (ΔNLL per token of the shipped neutral text)
   and KV as a fraction of the descriptor prompt's;
3. the least KV fraction whose held-out shift reaches the prompt's is reported, at any cost and
   within the budget.

Results are written per direction as they come (``--out``, JSON lines).
Usage: python -m experiments.mi_kv_fraction [--directions optimism+,arrogance+] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from experiments.mi_user_persona import direction_items
from hf_memory import MemoryMethod, PromptMethod, load_default_model
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.persona import persona_banks
from hf_memory.selection.budget_search import DEFAULT_COST_BUDGET


def least_fraction(rows: list[dict], target: float, budget: float | None) -> dict | None:
    """The row of least KV fraction (then highest shift) whose shift reaches ``target`` and whose
    cost is within ``budget`` (None: any cost); None if no row does."""
    hits = [r for r in rows if r["shift"] >= target and (budget is None or r["cost"] <= budget)]
    return min(hits, key=lambda r: (r["kv_fraction"], -r["shift"]), default=None)


def run_direction(model, tokenizer, cost: NeutralCost, name: str, calibration: int,
                  ks: list[int], gains: list[float]) -> dict:
    text, items = direction_items(name)
    calib, held = items[:calibration], items[calibration:]
    depth = model.config.num_hidden_layers
    banks = persona_banks(model, tokenizer, text, recipe="prompt_like")

    def method(layers, gain: float) -> MemoryMethod:
        return MemoryMethod(banks, layers=list(layers),
                            layer_gains={layer: gain for layer in layers})

    start = time.perf_counter()
    plain_calib = pair_margins(model, tokenizer, calib)
    single, single_cost = {}, {}
    for layer in range(depth):
        alone = method([layer], 0.0)
        single[layer] = float((pair_margins(model, tokenizer, calib, method=alone)
                               - plain_calib).mean())
        single_cost[layer] = cost.measure(alone)
    ranked = sorted((layer for layer in single if single_cost[layer] <= DEFAULT_COST_BUDGET),
                    key=single.get, reverse=True)
    ranked += sorted(set(single) - set(ranked), key=single.get, reverse=True)  # then the rest
    plain = pair_margins(model, tokenizer, held)

    def scored(m) -> dict:
        shift = (pair_margins(model, tokenizer, held, method=m) - plain).double()
        return {"shift": float(shift.mean()), "se": float(shift.std() / len(shift) ** 0.5),
                "cost": cost.measure(m)}

    prompt = scored(PromptMethod(text, tokenizer=tokenizer))
    rows = []
    cheap = sum(single_cost[layer] <= DEFAULT_COST_BUDGET for layer in single)
    for k in sorted({min(k, depth) for k in ks} | {cheap}):
        for gain in gains:
            row = {"k": k, "gain": gain, "layers": sorted(ranked[:k]), "kv_fraction": k / depth,
                   **scored(method(ranked[:k], gain))}
            rows.append(row)
            print(f"  {name} k {k:2d} ρ {gain:g}: {row['shift']:+.2f} ± {row['se']:.2f} "
                  f"(cost {row['cost']:.3f})", flush=True)
    return {"direction": name, "calibration": len(calib), "held_out": len(held),
            "single_layer_calibration_shift": single, "single_layer_cost": single_cost,
            "ranked": ranked, "prompt": prompt,
            "within_budget_alone": cheap, "rows": rows,
            "least_any_cost": least_fraction(rows, prompt["shift"], None),
            "least_within_budget": least_fraction(rows, prompt["shift"], DEFAULT_COST_BUDGET),
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directions", default="optimism+,optimism-,formality+,formality-,"
                                                "arrogance+,arrogance-,curiosity+,curiosity-")
    parser.add_argument("--calibration", type=int, default=20)
    parser.add_argument("--ks", default="1,2,3,4,6,8,12,16,24,30")
    parser.add_argument("--gains", default="0,1,2")
    parser.add_argument("--out", default="kv_fraction.jsonl")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    cost = NeutralCost(model, tokenizer)
    ks = [int(k) for k in args.ks.split(",")]
    gains = [float(g) for g in args.gains.split(",")]
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    table = ["| direction | prompt shift (cost) | all layers, ρ 0 (cost) | least KV / prompt "
             "reaching it, any cost (k, ρ, shift, cost) | least within the budget |",
             "| --- | --- | --- | --- | --- |"]

    def cell(row: dict | None) -> str:
        return ("not reached" if row is None else
                f"**{row['kv_fraction']:.2f}** ({row['k']}, {row['gain']:g}, "
                f"{row['shift']:+.2f}, {row['cost']:.3f})")

    for name in args.directions.split(","):
        record = run_direction(model, tokenizer, cost, name.strip(), args.calibration, ks, gains)
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        p = record["prompt"]
        full = next((r for r in record["rows"]
                     if r["k"] == model.config.num_hidden_layers and r["gain"] == 0), None)
        table.append(f"| {name} | {p['shift']:+.2f} ± {p['se']:.2f} ({p['cost']:.3f}) | "
                     + ("-" if full is None else f"{full['shift']:+.2f} ({full['cost']:.3f})")
                     + f" | "
                     f"{cell(record['least_any_cost'])} | {cell(record['least_within_budget'])} |")
        print(table[-1], f"[{record['seconds']:.0f}s]", flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
