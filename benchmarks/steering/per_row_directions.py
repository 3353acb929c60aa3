"""Several steering directions on the same prompts: one batch per direction vs one batch with
per-row banks (each row under its own direction's banks and shipped selector); and the
harness's plain / prompt / memory trio on the same prompts: ``generate_with`` per method vs
``generate_with_each`` (one shared batch).

The embedded model; the Big Five generation task's open-ended prompts; per direction its shipped
selector and the demo's bank recipe (target and reference descriptor). Prints the wall time of
both ways, their ratio, and how many replies agree token for token (the batches differ in
padding width, so float32 rounding may flip a close greedy choice).
Usage: python -m benchmarks.steering.per_row_directions [--directions N+ A+ ...] [--prompts 6]
"""

from __future__ import annotations

import argparse
import platform

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import timed
from eval_harness.bigfive.generation import GENERATION_PROMPTS
from hf_memory import (
    BankSet,
    MemoryMethod,
    PlainMethod,
    PromptMethod,
    generate_with,
    generate_with_each,
    load_default_model,
    steer,
)
from hf_memory.chat.generation import chat_messages, generate_conversations
from hf_memory.recipes.calibration_data import direction_parts
from hf_memory.recipes.shipped import SHIPPED_DIRECTIONS, persona_bank, shipped_selector


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directions", nargs="+", default=list(SHIPPED_DIRECTIONS))
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=2)
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "steering.per_row_directions", directions=args.directions,
                    prompts=args.prompts, new_tokens=args.new_tokens)
    model, tokenizer = load_default_model()
    prompts = list(GENERATION_PROMPTS[:args.prompts])
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}; model {model.name_or_path}; "
          f"{len(args.directions)} directions x {len(prompts)} prompts, "
          f"{args.new_tokens} new tokens")
    handles = []
    for direction in args.directions:
        _, _, target, reference = direction_parts(direction)
        banks = BankSet([persona_bank(model, tokenizer, target),
                         persona_bank(model, tokenizer, reference, role="reference",
                                      name="reference")], model=model)
        handles.append(steer(model, banks, selector=shipped_selector(direction, model=model),
                             active=False))
    conversations = [chat_messages(p) for p in prompts]
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)

    def one_batch_per_direction() -> list[str]:
        replies = []
        for handle in handles:
            replies += generate_conversations(model, tokenizer, conversations,
                                              attach=lambda _end, h=handle: h.applied(),
                                              **kwargs)
        return replies

    def per_row_batch() -> list[str]:
        rows = [handle for handle in handles for _ in prompts]
        return generate_conversations(model, tokenizer, conversations * len(handles),
                                      attach=lambda _end: steer(model, rows), **kwargs)

    with torch.inference_mode():
        generate_conversations(model, tokenizer, conversations, max_new_tokens=2)  # warm-up
        sequential, sequential_s = timed(one_batch_per_direction)
        batched, batched_s = timed(per_row_batch)
    same = sum(a == b for a, b in zip(sequential, batched, strict=True))
    print(f"one batch per direction: {sequential_s:7.2f} s")
    print(f"per-row banks, 1 batch:  {batched_s:7.2f} s   speed-up x{sequential_s / batched_s:.2f}")
    print(f"replies identical: {same} / {len(batched)}")
    log.write(comparison="per-row banks vs one batch per direction", baseline_s=sequential_s,
              batched_s=batched_s, speedup=sequential_s / batched_s, identical=same,
              replies=len(batched))
    for handle in handles:
        handle.remove()

    _, _, target, reference = direction_parts(args.directions[0])
    banks = BankSet([persona_bank(model, tokenizer, target),
                     persona_bank(model, tokenizer, reference, role="reference",
                                  name="reference")], model=model)
    methods = [PlainMethod(), PromptMethod(target, tokenizer=tokenizer),
               MemoryMethod(banks, shipped_selector(args.directions[0], model=model))]
    with torch.inference_mode():
        alone, alone_s = timed(lambda: [generate_with(m, model, tokenizer, prompts, **kwargs)
                                        for m in methods])
        shared, shared_s = timed(lambda: generate_with_each(methods, model, tokenizer, prompts,
                                                            **kwargs))
    same = sum(a == b for x, y in zip(alone, shared, strict=True)
               for a, b in zip(x, y, strict=True))
    print(f"plain/prompt/memory ({args.directions[0]}), generate_with per method: "
          f"{alone_s:7.2f} s")
    print(f"plain/prompt/memory, generate_with_each:  {shared_s:7.2f} s   speed-up "
          f"x{alone_s / shared_s:.2f}; replies identical: {same} / {len(prompts) * 3}")
    log.write(comparison="generate_with_each vs generate_with per method", baseline_s=alone_s,
              batched_s=shared_s, speedup=alone_s / shared_s, identical=same,
              replies=len(prompts) * 3)


if __name__ == "__main__":
    main()
