"""A persona calibrated the README's step-by-step way (``hf-memory bank build`` + ``hf-memory
selector calibrate``), scored on held-out items against the visible prompt and CAA under the
same budget.

The direction's items come from ``experiments/data/user_personas.json`` (as in
``mi_user_persona.py``): the first ``--calibration`` items are the pairs the selector and CAA
were calibrated on, the rest are held out. Prints held-out margin shift against plain (nats,
± standard error) and cost (ΔNLL per token of neutral text) per method.
Usage: python -m experiments.mi_saved_persona --banks DIR --selector DIR --direction arrogance-
"""

from __future__ import annotations

import argparse
import platform

import torch

from experiments.mi_user_persona import direction_items
from hf_memory import BankSet, MemoryMethod, PromptMethod, Selector, load_default_model
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.persona import calibrate_caa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--banks", required=True)
    parser.add_argument("--selector", required=True)
    parser.add_argument("--direction", required=True)
    parser.add_argument("--calibration", type=int, default=20)
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    text, items = direction_items(args.direction)
    calib, held = items[:args.calibration], items[args.calibration:]
    cost = NeutralCost(model, tokenizer)
    plain = pair_margins(model, tokenizer, held)
    banks = BankSet.from_pretrained(args.banks, model=model)
    selector = Selector.from_pretrained(args.selector, model=model)
    caa, chosen = calibrate_caa(model, tokenizer, calib, cost=cost)
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads;"
          f" {args.direction}, {len(held)} held-out items")
    print("| method | held-out shift | cost |\n| --- | --- | --- |")
    methods = {"memory (README's bank build + selector calibrate)": MemoryMethod(banks, selector),
               "visible prompt": PromptMethod(text, tokenizer=tokenizer)}
    if caa is not None:
        methods[f"CAA (layer {chosen['layer']}, scale {chosen['scale']:g})"] = caa
    for name, method in methods.items():
        shift = (pair_margins(model, tokenizer, held, method=method) - plain).double()
        print(f"| {name} | {shift.mean():+.2f} ± {shift.std() / len(shift) ** 0.5:.2f} | "
              f"{cost.measure(method):+.3f} |", flush=True)
    if caa is None:
        print("| CAA | no scale within the budget | - |")


if __name__ == "__main__":
    main()
