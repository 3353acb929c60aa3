"""The default persona call's wall time as a user makes it, and the pirate of ``make demo``
calibrated by it: does the memory row at its KV ceiling voice the pirate?

1. ``calibrate_persona(model, tokenizer, text, pairs)`` with every default (recipes screened,
   KV and capability ceilings, the reply judge) on a user persona's first 20 items, timed.
2. The pirate (``hf_memory/data/personas/pirate``): the same call on its pairs within its own
   budget (the visible prompt's cost on the neutral text, as ``build_persona`` calibrates it),
   then ``make demo``'s four questions answered by plain, the prompt and that memory: the share
   of the pirate's words (``lexicon_rate``), the judge's score, KV against the prompt's, cost.

The first call's probes are counted and timed by kind (capability, neutral text, objective):
where its time goes.

Usage: python -m benchmarks.steering.persona_call_time [--direction caution+] [--skip-pirate]
"""

from __future__ import annotations

import argparse
import platform
import time
from contextlib import contextmanager

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from experiments.mi_user_persona import direction_items
from hf_memory import PlainMethod, PromptMethod, generate_with, load_default_model
from hf_memory.metrics.factual import AnswerCost
from hf_memory.metrics.reply_judge import ReplyJudge
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.metrics.text_quality import lexicon_rate
from hf_memory.recipes.demo import DEFAULT_PROMPTS
from hf_memory.recipes.persona import calibrate_persona
from hf_memory.recipes.shipped import persona_spec
from hf_memory.selection.behavioural_search import ShiftObjective

PROBES = {"capability": AnswerCost, "neutral": NeutralCost, "objective": ShiftObjective}


@contextmanager
def counted_probes():
    """``{kind: [calls, seconds]}`` of every probe's ``measure`` while the block runs (the
    classes are restored after it)."""
    counts = {kind: [0, 0.0] for kind in PROBES}
    originals = {kind: cls.measure for kind, cls in PROBES.items()}

    def timed_measure(kind):
        def measure(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return originals[kind](self, *args, **kwargs)
            finally:
                counts[kind][0] += 1
                counts[kind][1] += time.perf_counter() - start
        return measure

    try:
        for kind, cls in PROBES.items():
            cls.measure = timed_measure(kind)
        yield counts
    finally:
        for kind, cls in PROBES.items():
            cls.measure = originals[kind]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direction", default="caution+")
    parser.add_argument("--skip-pirate", action="store_true")
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "steering.persona_call_time")
    print(f"# {platform.machine()} {platform.processor()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    (model, tokenizer), loaded = timed(load_default_model)
    text, items = direction_items(args.direction)
    with counted_probes() as probes:
        found, seconds = timed(lambda: calibrate_persona(model, tokenizer, text, items[:20],
                                                         progress=False))
    log.write(persona=args.direction, call_s=seconds, load_s=loaded, recipe=found.recipe,
              layers=found.selector.layers, kv_fraction=found.trials[0]["kv_fraction"],
              probes=probes)
    print(f"# {args.direction}: the default call {seconds:.0f} s (model "
          f"loaded in {loaded:.1f} s); kept {found.recipe} at layers {found.selector.layers}, "
          f"KV {found.trials[0]['kv_fraction']:.2f}x the prompt's; probes "
          + ", ".join(f"{kind} {n} ({t:.0f} s)" for kind, (n, t) in probes.items()),
          flush=True)
    if args.skip_pirate:
        return
    spec = persona_spec("pirate")
    cost = NeutralCost(model, tokenizer)
    prompt = PromptMethod(spec["text"], tokenizer=tokenizer)
    budget = cost.measure(prompt)
    pirate, seconds = timed(lambda: calibrate_persona(
        model, tokenizer, spec["text"], spec["pairs"], cost=cost, cost_budget=budget,
        progress=False))
    log.write(persona="pirate", call_s=seconds, cost_budget=budget, recipe=pirate.recipe,
              layers=pirate.selector.layers, kv_fraction=pirate.trials[0]["kv_fraction"])
    print(f"# pirate: the call within the prompt's own cost ({budget:.3f}) "
          f"{seconds:.0f} s; kept {pirate.recipe} at layers "
          f"{pirate.selector.layers}, units {pirate.selector.units}, trials "
          f"{[(t['recipe'], t.get('screened')) for t in pirate.trials]}")
    judge = ReplyJudge.fit(spec["pairs"], min_accuracy=None)
    print(f"# judge held-out accuracy {judge.held_out_accuracy:.2f}")
    print("| method | pirate words | judged | KV / prompt | cost | a reply |")
    print("| --- | --- | --- | --- | --- | --- |")
    kv = {"plain": None, "prompt": 1.0, "memory": pirate.trials[0]["kv_fraction"]}
    for name, method in (("plain", PlainMethod()), ("prompt", prompt),
                         ("memory", pirate.method())):
        replies = generate_with(method, model, tokenizer, list(DEFAULT_PROMPTS),
                                max_new_tokens=32)
        scores = judge.score(replies)
        share = "–" if kv[name] is None else f"{kv[name]:.2f}"
        print(f"| {name} | {lexicon_rate(replies, spec['lexicon']):.3f} | "
              f"{sum(scores) / len(scores):.2f} | {share} | {cost.measure(method):+.3f} | "
              f"{replies[1][:90]!r} |", flush=True)


if __name__ == "__main__":
    main()
