"""The strength dial's curve on the embedded model: trait shift and cost against strength.

One direction (default N+) at its shipped selector with the demo's target + reference banks.
For each strength: the held-out likelihood items' mean margin shift over plain (the trait
direction's items only, towards the target: positive is steering), and the cost: the change in
mean negative log-likelihood per token of the six neutral passages (``neutral_texts.json``) over
plain (positive is worse). Strength 0 must give exactly 0 and 0.
Usage: python -m experiments.mi_strength_curve [--direction N+] [--strengths 0,0.25,0.5,1]
"""

from __future__ import annotations

import argparse
import json
import platform
from importlib import resources

import torch

from eval_harness.directions import eval_pairs
from hf_memory import BankSet, load_default_model, steer
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.calibration_data import direction_parts, oriented
from hf_memory.recipes.shipped import persona_bank, shipped_selector


def neutral_nll(model, tokenizer, texts: list[str]) -> float:
    """Mean negative log-likelihood per token of ``texts`` (each scored alone)."""
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        loss = model(input_ids=ids, labels=ids).loss
        total += float(loss) * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direction", default="N+")
    parser.add_argument("--strengths", default="0,0.125,0.25,0.5,0.75,1")
    args = parser.parse_args()
    strengths = [float(s) for s in args.strengths.split(",")]
    model, tokenizer = load_default_model()
    trait, sign, target, reference = direction_parts(args.direction)
    items = [i for i in eval_pairs() if i["trait"] == trait]
    pairs = [oriented(i, sign) for i in items]
    texts = json.loads(resources.files("hf_memory").joinpath(
        "data", "neutral_texts.json").read_text())["texts"]
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}; {args.direction}: {len(pairs)} held-out pairs, "
          f"{len(texts)} neutral passages")
    banks = BankSet([persona_bank(model, tokenizer, target),
                     persona_bank(model, tokenizer, reference, role="reference",
                                  name="reference")], model=model)
    selector = shipped_selector(args.direction, model=model)
    with torch.inference_mode():
        plain_margins = pair_margins(model, tokenizer, pairs)
        plain_nll = neutral_nll(model, tokenizer, texts)
        print("strength | shift (nats, mean over pairs) | neutral dNLL (nats/token)")
        with steer(model, banks, selector=selector) as handle:
            for strength in strengths:
                handle.set_strength(strength)
                shift = float((pair_margins(model, tokenizer, pairs) - plain_margins).mean())
                cost = neutral_nll(model, tokenizer, texts) - plain_nll
                print(f"{strength:8.3f} | {shift:+9.3f} | {cost:+8.4f}", flush=True)


if __name__ == "__main__":
    main()
