"""A rule the model follows when told, carried as banks by the one-line persona call: does memory
comply in generation at a fraction of the prompt's KV? (issue 78, guidance banks)

The rule's pairs come from the model itself, as the shipped pirate's do: its greedy replies to
20 held-out questions (``trait_pairs.json``) when told the rule as the system message are the
targets, its plain replies the references, a pair kept only where the told reply complies and
the plain one does not (the checks of :mod:`experiments.guidance_rule_survey`). Then
``calibrate_persona(model, tokenizer, rule, pairs, kv_ceiling=...)`` with every other default
(recipes screened, cost budget, capability ceiling, reply judge), and the survey's 16 requests
answered greedily by plain, the visible rule and the memory it kept: compliance, the judge's
score and KV against the prompt's.

``--style-sheet``: long guidance instead of the one-line rule: the rule stated first and last in
the help-desk style sheet of ``experiments/data/style_sheet.txt`` (436 tokens with the Spanish
rule; fifteen rules, of which the language is the one a program checks), so the prompt's KV at
every layer is what the banks at a few layers save (issue 78 asks for at least 10x less). With
``--sheet-check frame`` compliance is the sheet's frame instead of its language rule: a reply
that speaks as the library's help desk (it names the library), which the model does under the
sheet as a prompt where it does not answer in Spanish.

Usage: python -m experiments.guidance_rule_banks [--rule spanish] [--kv-ceiling 0.1667 | 0]
    [--style-sheet [--sheet-check frame]] [--pairs 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from experiments.guidance_rule_survey import RULES
from hf_memory import PlainMethod, PromptMethod, load_default_model
from hf_memory.baselines.methods import generate_with
from hf_memory.recipes.calibration_data import calibration_prompts
from hf_memory.recipes.demo import DEFAULT_PROMPTS
from hf_memory.recipes.persona import calibrate_persona

TRAIT_PAIRS = Path(__file__).resolve().parents[1] / "eval_harness/trait_steering/trait_pairs.json"
STYLE_SHEET = Path(__file__).resolve().parent / "data" / "style_sheet.txt"


def speaks_for_the_library(reply: str) -> bool:
    """The style sheet's frame: the reply names the library it speaks for."""
    return "library" in reply.lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rule", choices=sorted(RULES), default="spanish")
    parser.add_argument("--kv-ceiling", type=float, default=1 / 6,
                        help="the banks' KV as a fraction of the rule's as a prompt (issue 78: "
                             "at least 6x less, 1/6; 0: no ceiling)")
    parser.add_argument("--style-sheet", action="store_true",
                        help="the rule inside a 436-token style sheet (long guidance)")
    parser.add_argument("--sheet-check", choices=("rule", "frame"), default="rule",
                        help="with --style-sheet: check the rule's own compliance, or that the "
                             "reply speaks as the sheet's help desk (names the library)")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/guidance_banks.jsonl"))
    args = parser.parse_args()
    text, check = RULES[args.rule]
    if args.style_sheet:
        text = STYLE_SHEET.read_text().format(rule=text)
        if args.sheet_check == "frame":
            check = speaks_for_the_library
    model, tokenizer = load_default_model()
    start = time.perf_counter()
    items = json.loads(TRAIT_PAIRS.read_text())["items"]
    questions = list(dict.fromkeys(i["question"] for i in items))[:args.pairs]
    told = generate_with(PromptMethod(text, tokenizer=tokenizer), model, tokenizer, questions,
                         max_new_tokens=args.max_new_tokens)
    plain = generate_with(PlainMethod(), model, tokenizer, questions,
                          max_new_tokens=args.max_new_tokens)
    pairs = [(q, t, p) for q, t, p in zip(questions, told, plain, strict=True)
             if check(t) and not check(p)]
    print(f"# rule {args.rule!r}: {len(pairs)} of {len(questions)} pairs kept")
    row = {"rule": args.rule, "text": text, "pairs": len(pairs), "kv_ceiling": args.kv_ceiling,
           "style_sheet": args.style_sheet, "sheet_check": args.sheet_check,
           "text_tokens": len(tokenizer(text, add_special_tokens=False).input_ids)}
    try:
        found = calibrate_persona(model, tokenizer, text, pairs,
                                  kv_ceiling=args.kv_ceiling or None)
    except ValueError as error:  # e.g. no recipe fits the KV ceiling
        row["refused"] = str(error)
        print(f"# the call refused: {error}")
    else:
        chosen = next(t for t in found.trials if t["recipe"] == found.recipe and "layers" in t)
        prompts = calibration_prompts() + list(DEFAULT_PROMPTS)
        methods = {"plain": PlainMethod(), "prompt": PromptMethod(text, tokenizer=tokenizer),
                   "memory": found.method()}
        replies = {name: generate_with(method, model, tokenizer, prompts,
                                       max_new_tokens=args.max_new_tokens)
                   for name, method in methods.items()}
        row.update(recipe=found.recipe, layers=chosen["layers"],
                   kv_fraction=chosen["kv_fraction"], cost=chosen["cost"],
                   validation=chosen["validation_target"], judged=found.judged,
                   trials=[{k: t.get(k) for k in ("recipe", "skipped", "screened", "layers",
                                                  "kv_fraction", "validation_target")}
                           for t in found.trials],
                   compliance={name: sum(map(check, r)) / len(prompts)
                               for name, r in replies.items()},
                   replies={name: r[:4] for name, r in replies.items()})
        print(f"# kept {found.recipe} at layers {chosen['layers']}, KV {chosen['kv_fraction']:.2f}"
              f"x the prompt's; compliance on {len(prompts)} requests: "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["compliance"].items()))
        for name, r in replies.items():
            print(f"  [{name}] {' '.join(r[0].split())[:100]}")
    row["seconds"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(json.dumps(row) + "\n")
    print(f"# {row['seconds']:.0f} s")


if __name__ == "__main__":
    main()
