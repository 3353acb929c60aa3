"""What the conversation's first token reading the banks costs (``BankSet.sink_reads_banks``).

The ``prompt_like`` bank of a shipped persona's text (the pirate of ``make demo`` by default),
at each of a few layer sets and layer gains ρ, twice: with the first token reading the banks (the
paper's injection, what persona banks did before 2026-12-07) and keeping the stock output
(``sink_reads_banks=False``). Per configuration: its cost (ΔNLL per token of the shipped neutral
text), the greedy replies to the demo's four questions (40 new tokens), the share of the
persona's lexicon in them, their distinct-2 and repeated 4-grams, and the KV the banks carry as
a fraction of the text's as a visible prompt; beside plain and the visible prompt. Rows are
written as they come (``--out``, JSON lines).

``--layers 12-29,14-29 --gains 0.25,0.5 --first-token plain`` sweeps other contiguous bands,
gains and one of the two settings instead of the default grid. ``--more-prompts 20`` adds that many
everyday questions outside the persona's calibration pairs to the demo's four, and ``--judge``
scores every row's replies by a reply judge fitted on those pairs (what users see beside the
lexicon's word share).

Usage: python -m experiments.mi_sink_banks [--persona pirate] [--layers A-B,...] [--gains G,...]
    [--first-token reads|plain|both] [--more-prompts N] [--judge] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from hf_memory import MemoryMethod, PromptMethod, load_default_model
from hf_memory.baselines.methods import PlainMethod, generate_with
from hf_memory.metrics.kv_accounting import kv_footprint
from hf_memory.metrics.reply_judge import ReplyJudge
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.metrics.text_quality import lexicon_rate, repetition
from hf_memory.recipes.calibration_data import everyday_questions
from hf_memory.recipes.demo import DEFAULT_PROMPTS
from hf_memory.recipes.persona import persona_banks
from hf_memory.recipes.shipped import persona_spec

LAYER_SETS = {"all": range(0, 30), "from 12": range(12, 30), "from 15": range(15, 30),
              "every 3rd": range(0, 30, 3)}
GAINS = (0.0, 0.5, 1.0, 2.0)
FIRST_TOKEN = {"reads": (True,), "plain": (False,), "both": (True, False)}


def bands(text: str) -> dict[str, range]:
    """``"12-29,14-29"`` → contiguous layer bands by name."""
    found = {}
    for part in text.split(","):
        first, _, last = part.partition("-")
        found[f"{int(first)}-{int(last)}"] = range(int(first), int(last) + 1)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--persona", default="pirate")
    parser.add_argument("--layers", type=bands, default=LAYER_SETS,
                        help="contiguous bands, e.g. 12-29,14-29 (default: four layer sets)")
    parser.add_argument("--gains", type=lambda t: [float(g) for g in t.split(",")],
                        default=GAINS, help="layer gains rho (default: 0,0.5,1,2)")
    parser.add_argument("--first-token", choices=sorted(FIRST_TOKEN), default="both")
    parser.add_argument("--more-prompts", type=int, default=0,
                        help="everyday questions outside the persona's pairs, beside the demo's")
    parser.add_argument("--judge", action="store_true",
                        help="score the replies by a reply judge fitted on the persona's pairs")
    parser.add_argument("--out", default="sink_banks.jsonl")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    spec = persona_spec(args.persona)
    text, lexicon = spec["text"], spec.get("lexicon") or []
    cost = NeutralCost(model, tokenizer)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    asked = {prompt for prompt, _, _ in spec["pairs"]}
    prompts = list(DEFAULT_PROMPTS) + [q for q in everyday_questions() if q not in asked
                                       and q not in DEFAULT_PROMPTS][:args.more_prompts]
    judge = ReplyJudge.fit(spec["pairs"]) if args.judge else None
    if judge is not None:
        print(f"# judge held-out accuracy {judge.held_out_accuracy:.2f} on "
              f"{len(spec['pairs'])} pairs; {len(prompts)} prompts")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; persona {args.persona!r}")

    with open(args.out, "a") as out:
        def row(label: str, method, kv_fraction: float, **extra) -> None:
            start = time.perf_counter()
            replies = generate_with(method, model, tokenizer, prompts, max_new_tokens=40)
            quality = repetition(replies)
            record = {"persona": args.persona, "method": label, **extra,
                      "cost": cost.measure(method),
                      "persona_words": lexicon_rate(replies, lexicon) if lexicon else None,
                      "distinct_2": quality["distinct_2"],
                      "repeated_4gram": quality["repeated_4gram"],
                      "judged": None if judge is None else judge.summary(replies)["judge_score"],
                      "prompts": len(prompts),
                      "kv_fraction": kv_fraction, "replies": replies,
                      "seconds": time.perf_counter() - start}
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"{label:44s} cost {record['cost']:+.3f} words "
                  f"{record['persona_words'] or 0:.3f} judged {record['judged'] or 0:.2f} "
                  f"distinct-2 {record['distinct_2']:.2f} "
                  f"KV {record['kv_fraction']:.2f}x | {replies[1][:70]!r}", flush=True)

        row("plain", PlainMethod(), 0.0)
        row("prompt", PromptMethod(text, tokenizer=tokenizer), 1.0)
        for sink_reads in FIRST_TOKEN[args.first_token]:
            banks = persona_banks(model, tokenizer, text, recipe="prompt_like",
                                  sink_reads_banks=sink_reads)
            for name, layers in args.layers.items():
                layers = list(layers)
                kv_fraction = 1 / kv_footprint(model, banks, ids, layers=layers).actual_ratio
                for rho in args.gains:
                    row(f"{'sink reads' if sink_reads else 'first token plain'}, {name}, "
                        f"rho {rho:g}",
                        MemoryMethod(banks, layers=layers,
                                     layer_gains=dict.fromkeys(layers, rho)),
                        kv_fraction, sink_reads_banks=sink_reads, layers=layers, rho=rho)


if __name__ == "__main__":
    main()
