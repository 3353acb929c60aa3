"""A persona made the README's way (``hf-memory persona --text ... --out DIR``) against the visible
prompt and CAA within the same budget (the call's, or its voice band's when it kept one), on
fresh held-out starter pairs: held-out shift, judged replies, KV, neutral and factual cost.

Usage: python -m experiments.mi_readme_persona DIR
"""

import json
import sys
import time
from pathlib import Path

from hf_memory import PlainMethod, PromptMethod, load_default_model
from hf_memory.metrics.factual import AnswerCost, exact_match
from hf_memory.metrics.kv_accounting import kv_footprint
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.reply_judge import ReplyJudge, judge_methods
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.calibration_data import everyday_questions
from hf_memory.recipes.persona import PersonaSteering, calibrate_caa
from hf_memory.recipes.starter_pairs import starter_pairs

folder = Path(sys.argv[1])
model, tok = load_default_model()
steering = PersonaSteering.from_pretrained(folder, model=model)
text = steering.selector.config["bank_recipe"]["text"]
calib = [
    tuple(json.loads(line)[k] for k in ("prompt", "target", "reference"))
    for line in (folder / "pairs.jsonl").read_text().splitlines()
    if line.strip()
]
used = {p for p, _, _ in calib}
fresh = [q for q in everyday_questions() if q not in used][:16]
held = starter_pairs(model, tok, text, prompts=fresh)
cost = NeutralCost(model, tok)
start = time.perf_counter()
voiced = (steering.voice or {}).get("kept", False)  # a voice band: CAA within its budget
budget = steering.voice["budget"] if voiced else steering.selector.config["cost_budget"]
caa, chosen = calibrate_caa(model, tok, calib, cost=cost, cost_budget=budget)
caa_s = time.perf_counter() - start
methods = {
    "plain": PlainMethod(),
    "prompt": PromptMethod(text, tokenizer=tok),
    "memory": steering.method(),
}
if caa is not None:
    methods["caa"] = caa
limits = steering.limits
if "kv_bytes" in steering.selector.config:  # the search's sites (KV groups counted)
    kv_bytes = steering.selector.config["kv_bytes"]
else:  # a voice band: every head of its layers, measured afresh
    kv_bytes = kv_footprint(model, steering.banks, tok(text, return_tensors="pt",
                                                       add_special_tokens=False).input_ids,
                            layers=steering.selector.layers).bank_bytes
kv = {"prompt": 1.0, "memory": kv_bytes / limits["prompt_kv_bytes"], "caa": None}
plain = pair_margins(model, tok, held)
facts = AnswerCost(model, tok, split="report")
rows = {}
for name in ("prompt", "caa", "memory"):
    if name not in methods:
        continue
    m = methods[name]
    shift = (pair_margins(model, tok, held, method=m) - plain).double()
    rows[name] = dict(
        shift=float(shift.mean()),
        se=float(shift.std() / len(shift) ** 0.5),
        cost=cost.measure(m),
        capability=facts.measure(m),
        exact_match=exact_match(model, tok, m)["exact_match"],
        kv=kv[name],
    )
judge = ReplyJudge.fit(calib, min_accuracy=None)
judged = judge_methods(model, tok, judge, [q for q, _, _ in held], methods, max_new_tokens=40)
print(f"# held-out pairs {len(held)}; judge held-out accuracy {judge.held_out_accuracy:.2f}; "
      f"CAA layer {chosen['layer']}, scale {chosen['scale']} within {budget:.3f} ({caa_s:.0f} s)")
print(f"plain: judged {judged['plain']['judge_score']:.2f}")
for name, r in rows.items():
    j = judged[name]
    print(f"{name}: judged {j['judge_score']:.2f}; shift {r['shift']:+.2f} ± {r['se']:.2f}; "
          f"KV {r['kv']}; cost {r['cost']:+.3f}; factual {r['capability']:+.2f} per answer, "
          f"exact match {r['exact_match']:.2f}; perplexity {j['perplexity']:.2f}, "
          f"distinct-2 {j['distinct_2']:.2f} | {j['replies'][0][:100]!r}")
with open(folder.parent / (folder.name + "_compare.json"), "w") as out:
    json.dump({"rows": rows, "judge": judge.as_dict(), "caa": chosen, "judged": judged}, out,
              default=str)
