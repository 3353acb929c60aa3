"""What keeping the plain stream buys a persona calibration (``hf_memory.metrics.plain_states``).

Runs one :func:`hf_memory.recipes.persona.calibrate_persona` call twice in one process, on the
same pairs and neutral text: first with every probe a full forward pass (no layer kept), then
with steered probes starting at their lowest site; checks that both calibrations chose the same
selector (layers, units, dial, every searched configuration's score) and prints their times.

Usage: OMP_NUM_THREADS=1 python -m benchmarks.steering.calibration_speed [--direction caution+]
       [--pairs 12] [--neutral 8] [--recipes contrast]
"""

from __future__ import annotations

import argparse
import platform

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from experiments.mi_user_persona import direction_items
from hf_memory import load_default_model
from hf_memory.metrics import plain_states
from hf_memory.metrics.steering_cost import NeutralCost, neutral_sample
from hf_memory.recipes.persona import calibrate_persona


def calibrate(model, tokenizer, text, pairs, args, max_bytes):
    plain_states.DEFAULT_MAX_BYTES = max_bytes  # this process only: the before and the after

    def run():
        cost = NeutralCost(model, tokenizer, **neutral_sample(args.neutral))
        return cost, calibrate_persona(model, tokenizer, text, pairs,
                                       recipes=args.recipes.split(","), cost=cost, progress=False)

    (cost, steering), seconds = timed(run)
    return seconds, steering, cost.evaluations


def record(steering) -> dict:
    """What a calibration decided: the selector's sites and dial, the search's history with
    every configuration's scores, the recipes' trials."""
    selector = steering.selector
    return {"layers": selector.layers, "units": selector.units, "gains": selector.layer_gains,
            "strength": selector.strength, "config": selector.config, "trials": steering.trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--direction", default="caution+")
    parser.add_argument("--pairs", type=int, default=12, help="the first N items calibrate")
    parser.add_argument("--neutral", type=int, default=8,
                        help="shipped neutral passages and prompts for the cost (each)")
    parser.add_argument("--recipes", default="contrast")
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    model, tokenizer = load_default_model()
    text, items = direction_items(args.direction)
    pairs = items[:args.pairs]
    default = plain_states.DEFAULT_MAX_BYTES
    before, old, probes = calibrate(model, tokenizer, text, pairs, args, 0)
    after, new, _ = calibrate(model, tokenizer, text, pairs, args, default)
    same = record(old) == record(new)
    print(f"{args.direction}, {len(pairs)} pairs, recipes {args.recipes}, {probes} cost probes: "
          f"full passes {before:.0f} s, from the lowest site {after:.0f} s "
          f"({before / after:.2f}x); the same selector and trials: {same}")
    ResultLog(args.jsonl, "steering.calibration_speed").write(
        direction=args.direction, pairs=len(pairs), recipes=args.recipes, probes=probes,
        full_passes_s=before, lowest_site_s=after, ratio=before / after, same=same)
    print("selector:", new.selector.layers, new.selector.layer_gains, new.selector.strength)
    if not same:
        raise SystemExit("the calibrations differ")


if __name__ == "__main__":
    main()
