"""What each steering method costs on lm-eval's offline tasks, on the embedded SmolLM2.

One Big Five direction (default N+): memory inception (the direction's shipped selector over a
bank of its descriptor, the selector's own recipe), CAA (descriptor vs opposite descriptor in the
bigfive frames, layer 10, at each ``--caa-scales``) and the prompt (the descriptor in the visible
context), each through the ``hf-memory`` lm-eval model type on ``hfm_local`` (capability
questions as multiple choice and as generation; the trait likelihood pairs), against plain.

    python -m benchmarks.steering.lm_eval_cost --docs 20
"""

from __future__ import annotations

import argparse

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from eval_harness.bigfive.task import CAA_FRAMES
from eval_harness.lm_eval_model.model import HFMemoryLM
from eval_harness.lm_eval_model.task import run_lm_eval
from hf_memory import BankSet, CAAVectors, load_default_model
from hf_memory.recipes.calibration_data import direction_parts
from hf_memory.recipes.shipped import persona_bank, shipped_selector

TASKS = ["hfm_capability_mc", "hfm_capability_gen", "hfm_trait_pairs"]
COLUMNS = ["hfm_capability_mc/acc", "hfm_capability_mc/acc_norm",
           "hfm_capability_gen/exact_match:last_answer", "hfm_trait_pairs/acc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direction", default="N+")
    parser.add_argument("--docs", type=int, default=20, help="documents per task")
    parser.add_argument("--caa-scales", default="2,8")
    parser.add_argument("--batch-size", type=int, default=8)
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "steering.lm_eval_cost", direction=args.direction,
                    docs=args.docs)
    model, tokenizer = load_default_model()
    _, _, target, reference = direction_parts(args.direction)
    runs = {"plain": {}, "prompt": {"prompt": target},
            "memory": {"banks": BankSet([persona_bank(model, tokenizer, target)], model=model),
                       "selector": shipped_selector(args.direction, model)}}
    vectors = CAAVectors.extract(model, tokenizer, [(f.format(target), f.format(reference))
                                                    for f in CAA_FRAMES], layers=[10])
    for scale in (float(s) for s in args.caa_scales.split(",")):
        runs[f"caa×{scale:g}"] = {"caa": vectors, "scale": scale}
    print(f"direction {args.direction} ({target!r}); {args.docs} documents per task\n")
    print("| method | " + " | ".join(COLUMNS) + " | wall s |")
    print("|" + " --- |" * (len(COLUMNS) + 2))
    for name, steering in runs.items():
        metrics, seconds = timed(lambda s=steering: run_lm_eval(HFMemoryLM(
            pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size, **s), TASKS,
            limit=args.docs)["metrics"])
        log.write(method=name, **{c: metrics[c] for c in COLUMNS}, wall_s=seconds)
        print(f"| {name} | " + " | ".join(f"{metrics[c]:.3f}" for c in COLUMNS)
              + f" | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
