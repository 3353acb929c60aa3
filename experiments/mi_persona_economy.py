"""Memory inception at the paper's economy: the default persona call against the prompt and CAA,
judged where users look — replies, KV, capability, fluency, wall time — beside the likelihood.

Per direction (a user persona of ``experiments/data/user_personas.json``: the first 20 items
calibrate, the other 12 are held out; or a Big Five direction such as ``A-``: its 24 shipped
calibration pairs calibrate, its 16 held-out evaluation items are held out):

- memory: :func:`hf_memory.recipes.persona.calibrate_persona` as a user calls it (its default
  recipes, budget, KV ceiling and capability ceiling); CAA: :func:`calibrate_caa` on the same
  pairs within the same budget; the prompt: the persona text as the system prompt;
- likelihood: the held-out margin shift over plain (nats) and the neutral-text cost;
- replies: greedy replies (40 tokens) to the held-out questions, scored by a
  :class:`~hf_memory.metrics.reply_judge.ReplyJudge` fitted on the calibration pairs (its
  held-out accuracy printed; a judge under 0.8 is reported, not used to rank), with their
  perplexity under the plain model and distinct-2;
- KV: the banks at the chosen sites over the persona text's KV as a visible prompt;
- capability: the held-out factual answers (the ``report`` half of
  :mod:`hf_memory.metrics.factual`): nats per answer lost and greedy exact match.

Results are appended per direction as they come (``--out``, JSON lines).
Usage: python -m experiments.mi_persona_economy --directions caution+,A- [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from experiments.mi_user_persona import direction_items
from hf_memory import PlainMethod, PromptMethod, load_default_model
from hf_memory.metrics.factual import AnswerCost, exact_match
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.reply_judge import ReplyJudge, judge_methods
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.persona import calibrate_caa, calibrate_persona

METHODS = ("prompt", "caa", "memory")


def items_of(name: str) -> tuple[str, list, list]:
    """(persona text, calibration triples, held-out triples) of a direction."""
    if name[:-1] in "OCEAN" and len(name) == 2:
        from eval_harness.directions import eval_pairs
        from hf_memory.recipes.calibration_data import calibration_pairs, direction_parts

        trait, sign, text, _ = direction_parts(name)
        pairs, _ = calibration_pairs(name)
        pole, other = ("high", "low") if sign > 0 else ("low", "high")
        held = [(i["question"], i[pole], i[other]) for i in eval_pairs() if i["trait"] == trait]
        return text, pairs, held
    text, items = direction_items(name)
    return text, items[:20], items[20:]


def run_direction(model, tokenizer, cost: NeutralCost, name: str, max_new_tokens: int) -> dict:
    text, calib, held = items_of(name)
    record: dict = {"direction": name, "calibration": len(calib), "held_out": len(held)}
    start = time.perf_counter()
    steering = calibrate_persona(model, tokenizer, text, calib, progress=False)
    record["memory_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    caa, chosen = calibrate_caa(model, tokenizer, calib, cost=cost)
    record["caa_seconds"] = time.perf_counter() - start
    methods = {"plain": PlainMethod(), "prompt": PromptMethod(text, tokenizer=tokenizer),
               "memory": steering.method()}
    if caa is not None:
        methods["caa"] = caa
    limits = steering.limits
    record["limits"] = limits
    record["memory"] = {"recipe": steering.recipe, "trials": steering.trials,
                        "kv_fraction": steering.selector.config["kv_bytes"]
                        / limits["prompt_kv_bytes"]}
    record["prompt"] = {"kv_fraction": 1.0}
    record["caa"] = {"layer": chosen["layer"], "scale": chosen["scale"]}
    plain = pair_margins(model, tokenizer, held)
    facts = AnswerCost(model, tokenizer, split="report")
    for method_name in METHODS:
        row = record[method_name]
        if method_name not in methods:
            row.update(shift=0.0, se=0.0, cost=0.0, capability=0.0, exact_match=None)
            continue
        method = methods[method_name]
        shift = (pair_margins(model, tokenizer, held, method=method) - plain).double()
        row.update(shift=float(shift.mean()), se=float(shift.std() / len(shift) ** 0.5),
                   cost=cost.measure(method), capability=facts.measure(method),
                   exact_match=exact_match(model, tokenizer, method)["exact_match"])
    record["plain_exact_match"] = exact_match(model, tokenizer, PlainMethod())["exact_match"]
    judge = ReplyJudge.fit(calib, min_accuracy=None)
    record["judge"] = judge.as_dict()
    judged = judge_methods(model, tokenizer, judge, [q for q, _, _ in held], methods,
                           max_new_tokens=max_new_tokens)
    record["replies"] = judged
    return record


def line(record: dict) -> str:
    replies = record["replies"]

    def cell(name: str) -> str:
        row, judged = record[name], replies.get(name)
        if judged is None:
            return "-"
        kv = row.get("kv_fraction")
        return (f"{judged['judge_score']:.2f} ({row['shift']:+.2f}; "
                f"KV {'-' if kv is None else format(kv, '.2f')}; "
                f"cap {row['capability']:+.2f}; ppl {judged['perplexity']:.1f}, "
                f"d2 {judged['distinct_2']:.2f})")

    return (f"| {record['direction']} | {record['judge']['held_out_accuracy']:.2f} | "
            f"{replies['plain']['judge_score']:.2f} | {cell('prompt')} | {cell('caa')} | "
            f"{cell('memory')} | {record['memory']['recipe']} | "
            f"{record['memory_seconds']:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directions", default="caution+,caution-")
    parser.add_argument("--out", default="persona_economy.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    model, tokenizer = load_default_model()
    cost = NeutralCost(model, tokenizer)
    print(f"# {platform.machine()} {platform.processor()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| direction | judge accuracy | plain | prompt: judged (shift; KV; cap; ppl, d2) | CAA "
          "| memory | recipe | memory call |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.directions.split(","):
        record = run_direction(model, tokenizer, cost, name.strip(), args.max_new_tokens)
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        print(line(record), flush=True)


if __name__ == "__main__":
    main()
