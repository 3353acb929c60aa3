"""ASM decoding through ``generate()`` against a same-width stock Llama, in this process.

Builds ``ASMForCausalLM`` at the ASM-57M shape (random weights, float32) and the stock
``LlamaForCausalLM`` of ``matched_llama_config`` (same width, depth, heads and vocabulary), then
for every context length runs greedy ``generate()`` on a random prompt of that length with both
models, alternating them round by round so load drift on a shared machine hits both alike. A
logits processor stamps the clock at every step, so the per-token time is the median gap
between consecutive steps (prefill excluded), measured through the stock ``generate()`` loop.
Prints wall and CPU ms per token and the ASM / Llama ratios per context.

Usage: python -m benchmarks.asm.decode [--contexts 256 2048 8192 16384] [--new-tokens 24]
    [--repeats 3] [--threads 1] [--layers 21]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from benchmarks.results import ResultLog, add_jsonl_argument
from modeling.asm import ASMConfig, ASMForCausalLM
from modeling.asm.baseline_asm import matched_llama_config


class StepClock(LogitsProcessor):
    """Records the wall clock and this thread's CPU time at every generation step; scores pass
    unchanged."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append((time.perf_counter(), time.thread_time()))
        return scores


def per_token_ms(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Median wall and CPU ms between consecutive decode steps of greedy ``generate()`` (the
    first gap, after the prefill, is dropped as a warm-up). CPU time is this thread's: with one
    torch thread it is the step's work, whatever else the machine runs."""
    clock = StepClock()
    with torch.inference_mode():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]))
    pairs = list(zip(clock.stamps[1:], clock.stamps[2:], strict=False))
    return tuple(1000 * statistics.median(b[i] - a[i] for a, b in pairs) for i in (0, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192, 16384])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=21, help="depth (ASM-57M: 21)")
    add_jsonl_argument(parser, "asm")
    args = parser.parse_args()
    if min([args.threads, args.layers, args.repeats] + args.contexts) < 1 or args.new_tokens < 3:
        parser.error("sizes must be positive and --new-tokens at least 3")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    longest = max(args.contexts) + args.new_tokens
    config = ASMConfig(num_hidden_layers=args.layers, max_position_embeddings=longest)
    models = {"asm": ASMForCausalLM(config).eval(),
              "llama": LlamaForCausalLM(matched_llama_config(config)).eval()}
    for model in models.values():
        model.generation_config.eos_token_id = None
    print(f"# {platform.machine()}, {torch.get_num_threads()} torch thread(s), torch "
          f"{torch.__version__}; ASM-57M shape ({args.layers} layers, d {config.hidden_size}) vs "
          f"same-width Llama, float32, batch 1, greedy generate(); median gap over "
          f"{args.new_tokens} new tokens, median of {args.repeats} alternating rounds")
    log = ResultLog(args.jsonl, "asm.decode", layers=args.layers, threads=args.threads,
                    new_tokens=args.new_tokens, repeats=args.repeats)
    print("context  wall: asm_ms  llama_ms  asm/llama   cpu: asm_ms  llama_ms  asm/llama")
    for context in args.contexts:
        prompt = torch.randint(0, config.vocab_size, (1, context))
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                runs[name].append(per_token_ms(model, prompt, args.new_tokens))
        row, figures = f"{context:<8}", {}
        for i, clock in enumerate(("wall", "cpu")):
            asm, llama = (statistics.median(x[i] for x in runs[name]) for name in ("asm", "llama"))
            row += f"      {asm:7.2f}  {llama:8.2f}  {asm / llama:8.2f}x"
            figures |= {f"{clock}_asm_ms": asm, f"{clock}_llama_ms": llama,
                        f"{clock}_ratio": asm / llama}
        print(row, flush=True)
        log.write(context=context, **figures)


if __name__ == "__main__":
    main()
