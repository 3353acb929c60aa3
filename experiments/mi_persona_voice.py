"""Does a shipped persona's voice show in free text, and at what cost (BENCHMARKS.md, "The
pirate persona of make demo")?

Greedy replies (32 tokens) to four everyday questions; per method the share of the replies'
words in the persona's lexicon (:func:`hf_memory.metrics.text_quality.lexicon_rate`) and the cost
(ΔNLL per token of the shipped neutral text): the visible prompt, memory at the shipped
selector's sites over ρ, and the ``exemplars`` and ``contrast`` recipes at two layer sets over ρ.
Usage: python -m experiments.mi_persona_voice [--persona pirate]
"""

from __future__ import annotations

import argparse
import platform

import torch

from hf_memory import MemoryMethod, PromptMethod, generate_with, load_default_model
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.metrics.text_quality import lexicon_rate
from hf_memory.recipes.demo import DEFAULT_PROMPTS
from hf_memory.recipes.persona import persona_banks
from hf_memory.recipes.shipped import shipped_persona
from hf_memory.selection.behavioural_calibration import split_pairs

QUESTIONS = DEFAULT_PROMPTS  # make demo's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--persona", default="pirate")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    banks, selector, _, spec = shipped_persona(model, tokenizer, args.persona)
    cost = NeutralCost(model, tokenizer)
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| method | persona words | cost |\n| --- | --- | --- |")

    def row(name: str, method) -> None:
        replies = generate_with(method, model, tokenizer, list(QUESTIONS), max_new_tokens=32)
        print(f"| {name} | {lexicon_rate(replies, spec['lexicon']):.3f} | "
              f"{cost.measure(method):+.3f} | {replies[1][:80]!r}", flush=True)

    row("visible prompt", PromptMethod(spec["text"], tokenizer=tokenizer))
    sites = {"layers": selector.layers, "units": selector.units, "unit_type": selector.unit_type}
    for rho in (1.0, 2.0, 3.0, 4.0):
        row(f"memory, shipped sites, rho {rho:g}",
            MemoryMethod(banks, layer_gains=dict.fromkeys(selector.layers, rho), **sites))
    _, examples = split_pairs(spec["pairs"], 8)
    exemplars = persona_banks(model, tokenizer, spec["text"], recipe="exemplars",
                              exemplars=[target for _, target, _ in examples])
    for layers in (selector.layers, list(range(12, 30, 3))):
        for rho in (0.0, 1.0, 2.0):
            row(f"exemplars, layers {layers}, rho {rho:g}",
                MemoryMethod(exemplars, layers=layers, layer_gains=dict.fromkeys(layers, rho)))
    contrast = persona_banks(model, tokenizer, spec["text"], recipe="contrast",
                             exemplars=[target for _, target, _ in examples],
                             counter_exemplars=[reference for _, _, reference in examples])
    for first in (4, 8):
        layers = list(range(first, model.config.num_hidden_layers))
        for rho in (0.0, 0.5, 1.0, 1.5, 2.0):
            row(f"contrast, layers {first}-{layers[-1]}, rho {rho:g}",
                MemoryMethod(contrast, layers=layers, layer_gains=dict.fromkeys(layers, rho)))


if __name__ == "__main__":
    main()
