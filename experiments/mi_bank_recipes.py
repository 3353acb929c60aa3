"""Bank recipes at hand-picked sites: what each moves and what it costs (hf_memory/README.md,
"Bank construction", the ``placement`` paragraph).

One Big Five direction's descriptor (default N+, anxious) on the embedded model; its held-out
trait pairs (``eval_harness/trait_steering/trait_pairs.json``) scored against plain (mean margin
shift, nats, ± standard error) and the cost (ΔNLL per token of the shipped neutral text), for
the visible prompt, the paper's bank (size-normalised, no position) over the strength dial at
every layer, and the ``prompt_like`` bank (slots before the conversation, concatenated
attention) over layer sets and ρ.
Usage: python -m experiments.mi_bank_recipes [--direction N+]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from eval_harness.directions import eval_pairs
from hf_memory import MemoryMethod, PromptMethod, load_default_model
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.calibration_data import direction_parts, oriented
from hf_memory.recipes.persona import persona_banks

LAYER_SETS = {"0-9": range(0, 10), "10-29": range(10, 30), "all": range(30),
              "12-27 every 3rd": range(12, 30, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direction", default="N+")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    cost = NeutralCost(model, tokenizer)
    trait, sign, target, _ = direction_parts(args.direction)
    held = [oriented(i, sign) for i in eval_pairs() if i["trait"] == trait]
    plain = pair_margins(model, tokenizer, held)
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads;"
          f" {args.direction}, {len(held)} held-out pairs")
    print("| condition | shift (nats) | cost (nats/token) |\n| --- | --- | --- |")

    def row(name: str, method) -> None:
        start = time.perf_counter()
        shift = (pair_margins(model, tokenizer, held, method=method) - plain).double()
        print(f"| {name} | {shift.mean():+.2f} ± {shift.std() / len(shift) ** 0.5:.2f} | "
              f"{cost.measure(method):+.3f} | [{time.perf_counter() - start:.0f}s]", flush=True)

    row("visible prompt", PromptMethod(target, tokenizer=tokenizer))
    paper = persona_banks(model, tokenizer, target, recipe="descriptor")
    for strength in (0.25, 0.5, 1.0):
        row(f"descriptor bank, all layers, strength {strength:g}",
            MemoryMethod(paper, layers=list(range(30)), strength=strength))
    placed = persona_banks(model, tokenizer, target, recipe="prompt_like")
    for name, layers in LAYER_SETS.items():
        row(f"prompt_like, layers {name}, rho 0",
            MemoryMethod(placed, layers=list(layers), layer_gains=dict.fromkeys(layers, 0.0)))
    sparse = LAYER_SETS["12-27 every 3rd"]
    for rho in (1.0, 2.0, 3.0):
        row(f"prompt_like, layers 12-27 every 3rd, rho {rho:g}",
            MemoryMethod(placed, layers=list(sparse), layer_gains=dict.fromkeys(sparse, rho)))


if __name__ == "__main__":
    main()
