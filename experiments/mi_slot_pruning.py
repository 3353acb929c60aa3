"""A persona's voice band within a quarter of the prompt's KV: fewer slots instead of fewer layers.

The pirate's voice needs its descriptor at 14–18 consecutive upper layers (0.47–0.60x the
visible prompt's KV, docs/benchmarks/personas.md, "A voice band"); bands of 4–8 layers, within
¼ of the prompt's KV, carried none of its words. This keeps the long bands and drops slots
instead, the same slots at every layer of the band (a ``prompt_like`` bank's slots share one
position each), until the band holds at most ``--kv-ceiling`` of the prompt's KV. Three ways to
choose the slots kept:

- ``mass``: the descriptor tokens the conversation attends to most, read off the plain model with
  the descriptor as its visible system message and each pair's persona reply teacher-forced:
  attention from the reply's tokens to each descriptor token, summed over the band's layers,
  averaged over heads (a proxy for the steered queries' attention to the slots: the queries of
  a model that sees the prompt, not of the steered one);
- ``random``: as many slots drawn at random (seed 0): the control for the ranking;
- ``content``: the descriptor's content words (``MemoryBank.from_text(keep="content")``), however
  many there are (its KV may be over the ceiling: reported).

Per band and choice: the largest ρ of ``--gains`` within the visible prompt's own neutral-text
cost, then greedy 40-token replies to the demo's four questions and ``--more-prompts`` everyday
questions outside the persona's pairs, scored by the persona's word share and a reply judge
fitted on its pairs; beside plain and the prompt. Rows are appended as they come (``--out``).

Usage: python -m experiments.mi_slot_pruning [--persona pirate] [--bands 12,14,16]
    [--choices mass,random,content] [--kv-ceiling 0.25] [--gains ...] [--more-prompts 20]
    [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from dataclasses import replace

import torch

from hf_memory import MemoryMethod, PromptMethod, load_default_model
from hf_memory.banks.bank import MemoryBank
from hf_memory.banks.bank_set import BankSet
from hf_memory.baselines.methods import PlainMethod, generate_with
from hf_memory.metrics.kv_accounting import kv_footprint
from hf_memory.metrics.reply_judge import ReplyJudge
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.metrics.text_quality import lexicon_rate, repetition
from hf_memory.recipes.calibration_data import everyday_questions
from hf_memory.recipes.demo import DEFAULT_PROMPTS
from hf_memory.recipes.persona import persona_banks
from hf_memory.recipes.shipped import persona_spec
from hf_memory.recipes.starter_pairs import starter_pairs

GAINS = (-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def prompt_mass(model, tokenizer, bank: MemoryBank, pairs, layers) -> torch.Tensor:
    """``[M]``: per slot of ``bank`` (one variant, template ``{text}``, system context), the
    attention the persona replies' tokens give its descriptor token with the descriptor as the
    visible system message (module docstring), summed over ``layers``, mean over heads."""
    (variant,) = bank.provenance["variants"]
    kept, text = variant["kept_positions"], bank.provenance["text"]
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    mass = torch.zeros(len(kept))
    for prompt, reply, _ in pairs:
        asked = [{"role": "system", "content": text}, {"role": "user", "content": prompt}]
        head = tokenizer.apply_chat_template(asked, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(head + reply, add_special_tokens=False).input_ids
        start = len(tokenizer(head, add_special_tokens=False).input_ids)
        if [ids[p] for p in kept] != [variant["token_ids"][p] for p in kept]:
            raise RuntimeError("the visible prompt's tokens are not the bank's slots")
        with torch.no_grad():
            out = eager(torch.tensor([ids]), output_attentions=True)
        for layer in layers:
            weights = out.attentions[layer][0, :, start:, :]  # [H, T_reply, T]
            mass += weights[:, :, kept].sum(1).mean(0)
    return mass


def pruned(banks: BankSet, keep: torch.Tensor) -> BankSet:
    """``banks`` with only the slots ``keep`` (indices) of its one bank, at every layer."""
    (bank,) = banks.banks
    keep = keep.sort().values
    smaller = replace(bank, keys=bank.keys[:, :, keep].clone(),
                      values=bank.values[:, :, keep].clone(),
                      positions=None if bank.positions is None else bank.positions[keep].clone(),
                      provenance={**bank.provenance, "slots_kept": keep.tolist()})
    return BankSet([smaller], fingerprint=banks.fingerprint, gamma=banks.gamma,
                   size_normalize=banks.size_normalize, sink_reads_banks=banks.sink_reads_banks)


def fitting_slots(model, banks: BankSet, ids, layers, ceiling: float) -> int:
    """The most slots a band of ``layers`` may keep within ``ceiling`` of the prompt's KV."""
    full = kv_footprint(model, banks, ids, layers=layers)
    per_slot = full.bank_bytes / banks.banks[0].num_slots
    return int(ceiling * full.prompt_kv_bytes // per_slot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--persona", default="pirate")
    parser.add_argument("--text", help="a user's persona text (with --pairs, in place of "
                        "--persona)")
    parser.add_argument("--pairs", help="its pairs: JSON lines of prompt, target, reference "
                        "(default: starter pairs, the model's replies with and without the text)")
    parser.add_argument("--budget", default="prompt",
                        help="nats per neutral token, or 'prompt': the visible prompt's cost")
    parser.add_argument("--bands", default="10,12,14,16,18",
                        help="first layers of the bands (each runs to the last layer)")
    parser.add_argument("--choices", default="mass,random,content")
    parser.add_argument("--kv-ceiling", type=float, default=0.25)
    parser.add_argument("--gains", type=lambda t: [float(g) for g in t.split(",")],
                        default=GAINS)
    parser.add_argument("--more-prompts", type=int, default=20)
    parser.add_argument("--baselines", action="store_true", help="also plain and the prompt")
    parser.add_argument("--out", default="slot_pruning.jsonl")
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    if args.text and args.pairs:
        with open(args.pairs) as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
        spec = {"text": args.text, "pairs": [(r["prompt"], r["target"], r["reference"])
                                             for r in rows]}
        args.persona = "user"
    elif args.text:
        spec = {"text": args.text, "pairs": starter_pairs(model, tokenizer, args.text)}
        args.persona = "user"
    else:
        spec = persona_spec(args.persona)
    text, lexicon, pairs = spec["text"], spec.get("lexicon") or [], spec["pairs"]
    cost = NeutralCost(model, tokenizer)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    asked = {prompt for prompt, _, _ in pairs}
    prompts = list(DEFAULT_PROMPTS) + [q for q in everyday_questions() if q not in asked
                                       and q not in DEFAULT_PROMPTS][:args.more_prompts]
    judge = ReplyJudge.fit(pairs, min_accuracy=None)  # reported, not refused
    prompt_method = PromptMethod(text, tokenizer=tokenizer)
    prompt_cost = cost.measure(prompt_method)
    budget = prompt_cost if args.budget == "prompt" else float(args.budget)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; persona {args.persona!r}; judge held-out "
          f"accuracy {judge.held_out_accuracy:.2f}; {len(prompts)} prompts; budget {budget:.3f} "
          f"(the prompt's cost {prompt_cost:.3f})", flush=True)
    banks = persona_banks(model, tokenizer, text, recipe="prompt_like", sink_reads_banks=False)
    content = MemoryBank.from_text(model, tokenizer, text, role="target", name="persona",
                                   template="{text}", context="system", placement="before",
                                   keep="content")
    content_banks = BankSet([content], fingerprint=banks.fingerprint,
                            size_normalize=banks.size_normalize, sink_reads_banks=False)
    depth = model.config.num_hidden_layers

    with open(args.out, "a") as out:
        def row(label: str, method, **extra) -> None:
            start = time.perf_counter()
            replies = generate_with(method, model, tokenizer, prompts, max_new_tokens=40)
            quality = repetition(replies)
            record = {"persona": args.persona, "method": label, **extra,
                      "persona_words": lexicon_rate(replies, lexicon) if lexicon else None,
                      "distinct_2": quality["distinct_2"],
                      "judged": judge.summary(replies)["judge_score"], "prompts": len(prompts),
                      "replies": replies, "seconds": time.perf_counter() - start}
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"{label:34s} cost {extra.get('cost', 0):+.3f} words "
                  f"{record['persona_words'] or 0:.3f} judged {record['judged']:.2f} distinct-2 "
                  f"{record['distinct_2']:.2f} KV {extra.get('kv_fraction', 0):.2f}x | "
                  f"{replies[1][:60]!r}", flush=True)

        if args.baselines:
            row("plain", PlainMethod(), cost=0.0, kv_fraction=0.0)
            row("prompt", prompt_method, cost=prompt_cost, kv_fraction=1.0)
        for first in (int(b) for b in args.bands.split(",")):
            layers = list(range(first, depth))
            k = fitting_slots(model, banks, ids, layers, args.kv_ceiling)
            mass = prompt_mass(model, tokenizer, banks.banks[0], pairs, layers)
            drawn = torch.randperm(banks.banks[0].num_slots,
                                   generator=torch.Generator().manual_seed(0))[:k]
            for choice in args.choices.split(","):
                these = (pruned(banks, mass.topk(k).indices) if choice == "mass" else
                         pruned(banks, drawn) if choice == "random" else content_banks)
                fraction = 1 / kv_footprint(model, these, ids, layers=layers).actual_ratio
                found = None
                for rho in sorted(args.gains):
                    spent = cost.measure(MemoryMethod(these, layers=layers,
                                                      layer_gains=dict.fromkeys(layers, rho)))
                    if spent > budget:
                        break
                    found = (rho, spent)
                if found is None:
                    print(f"{first}-{depth - 1} {choice}: over the budget at every gain")
                    continue
                rho, spent = found
                (variant,) = these.banks[0].provenance["variants"]
                kept = these.banks[0].provenance.get("slots_kept",
                                                     range(these.banks[0].num_slots))
                words = [tokenizer.decode([variant["token_ids"][variant["kept_positions"][i]]])
                         for i in kept]
                print(f"# {first}-{depth - 1} {choice} keeps {words}", flush=True)
                row(f"{first}-{depth - 1} {choice} ({these.banks[0].num_slots} slots) "
                    f"rho {rho:g}", MemoryMethod(these, layers=layers,
                                                 layer_gains=dict.fromkeys(layers, rho)),
                    band=[first, depth - 1], choice=choice, rho=rho, cost=spent,
                    kv_fraction=fraction, slots=these.banks[0].num_slots, kept=words,
                    of_slots=banks.banks[0].num_slots)


if __name__ == "__main__":
    main()
