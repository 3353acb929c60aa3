"""Steered / plain forward passes timed in adjacent pairs: the prefill and the decoding step alone.

``serving_shapes.py`` times whole ``generate()`` calls, one after the other; on a small shared
machine a round moves by ±5–10 % (memory bandwidth shared with other tenants sets the speed of
the weight products), more than a steered layer costs. Here each round times one forward pass
plain and one through each mixture path back to back, on the same input, and reports the median
over rounds of the ratio within a round (plain seconds / steered seconds) with its quartiles, so
that slow drift cancels. "prefill": a pass over the prompt into an empty cache; "decode": one
token over the prompt's cache, which is cropped back after each step, so every step sees the
same history. Models and banks as in ``serving_shapes.py`` (random weights; 2 × 24 slots at
five layers).

Usage: python -m benchmarks.steering.step_ratios [--models llama-1b] [--batches 8 32]
       [--prompts 64 2048] [--prefill-rounds 3] [--decode-rounds 20] [--jsonl FILE]
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import nullcontext

import torch
from transformers import DynamicCache

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.steering.serving_shapes import (
    MODELS,
    PATHS,
    add_device_arguments,
    banks_for,
    build,
    device_dtype_and_machine,
)
from benchmarks.timing import timed
from hf_memory import steer
from hf_memory.models.transformers_compat import cache_kwargs


def paired_ratios(seconds_of, labels: tuple[str, ...], rounds: int) -> dict[str, list[float]]:
    """For each steered label, the ratio plain / steered of ``seconds_of(label)`` in each of
    ``rounds`` rounds (all labels back to back within a round, which one goes first rotating)."""
    ratios: dict[str, list[float]] = {label: [] for label in labels[1:]}
    for round_ in range(rounds):
        first = round_ % len(labels)
        seconds = {label: seconds_of(label) for label in labels[first:] + labels[:first]}
        for label in ratios:
            ratios[label].append(seconds["plain"] / seconds[label])
    return ratios


def summary(ratios: list[float]) -> dict[str, float]:
    low, median, high = (statistics.quantiles(ratios, n=4) if len(ratios) > 1
                         else (ratios[0],) * 3)
    return {"median": median, "q1": low, "q3": high, "rounds": len(ratios)}


def measure(model, banks, batch: int, prompt: int, paths: tuple[str, ...],
            prefill_rounds: int, decode_rounds: int) -> dict:
    device = model.device
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=device)
    mask = torch.ones_like(ids)
    labels = ("plain",) + paths

    def steering(label: str):
        return nullcontext() if label == "plain" else steer(model, banks, mixture_path=label)

    def forward(label: str, tokens, cache, attention_mask) -> float:
        with steering(label):
            return timed(lambda: model(  # (as generate() asks: the last position's logits only)
                tokens, attention_mask=attention_mask, **cache_kwargs(cache), use_cache=True,
                logits_to_keep=1), device)[1]

    with torch.inference_mode():
        prefill = paired_ratios(
            lambda label: forward(label, ids, DynamicCache(config=model.config), mask),
            labels, prefill_rounds) if prefill_rounds else {}
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
        token = torch.randint(1, model.config.vocab_size, (batch, 1), device=device)
        longer = torch.cat([mask, torch.ones_like(token)], 1)

        def step(label: str) -> float:
            seconds = forward(label, token, cache, longer)
            cache.crop(-1)  # the next step sees the same history
            return seconds

        step("plain")  # (a warm-up: the first step at a new cache shape)
        decode = paired_ratios(step, labels, decode_rounds)
    return {"batch": batch, "prompt": prompt,
            **{path: {"prefill": summary(prefill[path]) if prefill else None,
                      "decode": summary(decode[path])} for path in paths}}


def shown(figures: dict | None) -> str:
    if figures is None:
        return f"{'—':>17}"
    return f"{figures['median']:.3f} [{figures['q1']:.2f}, {figures['q3']:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_arguments(parser)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["llama-1b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--prompts", nargs="+", type=int, default=[64])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--prefill-rounds", type=int, default=3,
                        help="paired prefill rounds (0: decode only, for prompts whose prefill "
                             "takes minutes)")
    parser.add_argument("--decode-rounds", type=int, default=20)
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    if args.decode_rounds < 1 or args.prefill_rounds < 0:
        parser.error("--decode-rounds must be at least 1 and --prefill-rounds at least 0")
    device, dtype, where = device_dtype_and_machine(args)
    print(f"# {where}, torch {torch.__version__}, {dtype}; banks 2 x 24 slots at 5 layers; "
          "plain / steered seconds of adjacent passes: median [quartiles] over rounds")
    print(f"{'model':>13} {'B':>3} {'prompt':>6} {'path':>9} {'prefill':>17} {'decode':>17}")
    log = ResultLog(args.jsonl, "steering.step_ratios")
    for name in args.models:
        model = build(name, device, dtype)
        banks = banks_for(model)
        for prompt in args.prompts:
            for batch in args.batches:
                row = {"model": name, "device": where, "dtype": str(dtype),
                       **measure(model, banks, batch, prompt, tuple(args.paths),
                                 args.prefill_rounds, args.decode_rounds)}
                log.write(**row)
                for path in args.paths:
                    print(f"{name:>13} {batch:>3} {prompt:>6} {path:>9} "
                          f"{shown(row[path]['prefill'])} {shown(row[path]['decode'])}",
                          flush=True)
        del model, banks


if __name__ == "__main__":
    main()
