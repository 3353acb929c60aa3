"""Banks that carry content, not noise: a descriptor bank against its content-only slots.

For each direction, at its shipped selector's sites and calibrated strength (and at full
strength), memory with the persona bank built with ``keep="descriptor"`` (every token of the
descriptor, the default) and with ``keep="content"`` (punctuation and function words dropped):
held-out trait shift (mean margin shift over plain on the direction's 16 likelihood pairs,
towards the target) and cost (ΔNLL per token of 20 seeded KJV sentences as the assistant's
reply, as ``hf-memory eval capability`` scores neutral text).
Usage: python -m experiments.mi_bank_pruning [--directions N+,A+,E-]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from eval_harness.capability.task import _neutral_nll
from eval_harness.directions import eval_pairs
from hf_memory import BankSet, MemoryBank, MemoryMethod, PlainMethod, load_default_model
from hf_memory.analysis.corpus import kjv_sentences
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.calibration_data import direction_parts, oriented
from hf_memory.recipes.shipped import BANK_RECIPE, shipped_selector


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directions", default="N+,A+,E-")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    sentences = kjv_sentences(20, seed=0)
    plain_nll, counts = _neutral_nll(model, tokenizer, sentences, PlainMethod(), 16)
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch "
          f"{torch.__version__}")
    print("direction | keep | slots | strength | shift (nats) | cost (nats/token)")
    start = time.perf_counter()
    for direction in args.directions.split(","):
        trait, sign, target, _ = direction_parts(direction)
        pairs = [oriented(i, sign) for i in eval_pairs() if i["trait"] == trait]
        plain = pair_margins(model, tokenizer, pairs)
        selector = shipped_selector(direction, model=model)
        sites = dict(layers=selector.layers, units=selector.units, unit_type=selector.unit_type,
                     layer_gains=selector.layer_gains)
        for keep in ("descriptor", "content"):
            bank = MemoryBank.from_text(model, tokenizer, target, name="persona", keep=keep,
                                        template=BANK_RECIPE["template"],
                                        context=BANK_RECIPE["context"])
            banks = BankSet([bank], model=model)
            for strength in sorted({selector.strength, 1.0}):
                method = MemoryMethod(banks, strength=strength, **sites)
                shift = float((pair_margins(model, tokenizer, pairs, method=method)
                               - plain).mean())
                nll, _ = _neutral_nll(model, tokenizer, sentences, method, 16)
                cost = float((nll - plain_nll).sum() / counts.sum())
                print(f"{direction} | {keep} | {bank.num_slots} | {strength:g} | {shift:+.3f} | "
                      f"{cost:+.4f}", flush=True)
    print(f"# {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
