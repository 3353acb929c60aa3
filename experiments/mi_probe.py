"""The worry probe of issue 21, rerun: how far each method moves the embedded model.

Margin = log p(worried replies) − log p(calm replies) to two questions about upcoming events
(nats, summed; ``tests/test_memory_inception_real.py::WORRY_CASES``). Conditions, for the
anxious (N+) and the calm (N−) descriptor: the visible prompt (added to the default system
prompt, and replacing it), CAA at the scale calibrated on the shipped calibration pairs, memory
through the shipped frozen behavioural selector, the same sites with a neutral bank and with the
opposite descriptor's bank (and the opposite prompt), and memory
through the paper's diagnostic selector (target + reference banks).
Usage: python -m experiments.mi_probe
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from eval_harness.bigfive.task import CAA_FRAMES
from hf_memory import (
    BankSet,
    CAAMethod,
    CAAVectors,
    MemoryMethod,
    PromptMethod,
    Selector,
    load_default_model,
)
from hf_memory.banks.neutral_control import neutral_text
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.calibration_data import (
    calibration_pairs,
    calibration_prompts,
    direction_parts,
)
from hf_memory.recipes.shipped import persona_bank, shipped_selector
from hf_memory.selection.behavioural_search import ShiftObjective, best_strength

WORRY_CASES = [
    ("How do you feel about your exam tomorrow?",
     "I'm really worried and nervous about it.", "I feel calm and relaxed about it."),
    ("How do you feel about the trip next week?",
     "Honestly, I'm scared something will go wrong.", "Honestly, I'm sure it will go well."),
]


@torch.no_grad()
def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    model, tokenizer = load_default_model()
    start = time.perf_counter()

    def margin(method=None) -> float:
        return float(pair_margins(model, tokenizer, WORRY_CASES, method=method).sum())

    plain = margin()
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"plain margin {plain:+.2f} nats\n")
    print("| condition | N+ (anxious): margin | shift | N- (calm): margin | shift |")
    print("| --- | --- | --- | --- | --- |")
    rows: dict[str, list[float]] = {}
    for direction in ("N+", "N-"):
        _, _, target, reference = direction_parts(direction)
        selector = shipped_selector(direction, model=model)
        banks = BankSet([persona_bank(model, tokenizer, target)], model=model)
        neutral = BankSet([persona_bank(model, tokenizer, neutral_text(), name="neutral")],
                          model=model)
        opposite = BankSet([persona_bank(model, tokenizer, reference, name="opposite")],
                           model=model)
        pairs, drift = calibration_pairs(direction)
        vectors = CAAVectors.extract(model, tokenizer, [(f.format(target), f.format(reference))
                                                        for f in CAA_FRAMES], layers=[10])
        objective = ShiftObjective(model, tokenizer, pairs, drift)
        scale, _ = best_strength(objective, lambda s, v=vectors: CAAMethod(v, scale=s),
                                 (1.0, 2.0, 4.0, 8.0, 16.0), cost_budget=None)
        contrastive = BankSet([persona_bank(model, tokenizer, target),
                               persona_bank(model, tokenizer, reference, role="reference",
                                            name="reference")], model=model)
        diagnostic = Selector.calibrate(model, tokenizer, contrastive, calibration_prompts(),
                                        progress=False)
        gain = next(iter(selector.layer_gains.values()))
        conditions = [
            ("prompt, added to the default system prompt",
             PromptMethod(target, tokenizer=tokenizer)),
            ("prompt, replacing the system prompt",
             PromptMethod(target, placement="replace_system")),
            ("CAA layer 10, calibrated scale", CAAMethod(vectors, scale=scale)),
            ("memory, shipped behavioural selector", MemoryMethod(banks, selector)),
            ("same sites and gain, neutral bank", MemoryMethod(neutral, selector)),
            ("same sites and gain, opposite descriptor's bank", MemoryMethod(opposite, selector)),
            ("prompt of the opposite descriptor", PromptMethod(reference, tokenizer=tokenizer)),
            ("memory, diagnostic selector, target + reference",
             MemoryMethod(contrastive, diagnostic)),
        ]
        print(f"# {direction}: CAA scale {scale:g}; behavioural layers {selector.layers} "
              f"(rho {gain:g}); diagnostic layers {diagnostic.layers}", flush=True)
        for label, method in conditions:
            rows.setdefault(label, []).append(margin(method))
    for label, (anxious, calm) in rows.items():
        print(f"| {label} | {anxious:+.2f} | {anxious - plain:+.2f} | "
              f"{calm:+.2f} | {calm - plain:+.2f} |")
    print(f"\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
