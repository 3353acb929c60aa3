"""Memory-inception generation on the embedded model: speed and KV bytes vs plain and prompt.

One process, three methods on the same prompt: plain, prompt baseline (the descriptor as a
visible system message), memory inception (target + reference bank at the chosen layers).
Prints tokens/s (median of repeats) with ratios to plain, and the KV bytes of the banks vs the
descriptor as a visible prompt (eq. 10).
Usage: python -m benchmarks.steering.generate [--new-tokens 48] [--repeats 3] [--layers 18-22]
"""

from __future__ import annotations

import argparse
import platform

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import median_seconds
from hf_memory import BankSet, MemoryBank, kv_footprint, load_default_model, steer
from hf_memory.chat.generation import chat_messages
from hf_memory.recipes.demo import DEFAULT_PERSONA, DEFAULT_REFERENCE
from hf_memory_cli.types import parse_layers

PROMPT = "How do you feel about your exam tomorrow?"


def tokens_per_second(model, tokenizer, text: str, new_tokens: int, repeats: int) -> float:
    batch = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    return new_tokens / median_seconds(lambda: model.generate(
        **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        pad_token_id=tokenizer.pad_token_id), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=parse_layers, default=parse_layers("18-22"))
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "steering.generate")
    model, tokenizer = load_default_model()
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, cuda={torch.cuda.is_available()}; model "
          f"{model.name_or_path}; steered layers {args.layers[0]}-{args.layers[-1]}")
    banks = BankSet([
        MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, role="target", name="persona",
                             template="{text}", layers=args.layers, gain=2.0),
        MemoryBank.from_text(model, tokenizer, DEFAULT_REFERENCE, role="reference",
                             name="opposite", template="{text}", layers=args.layers, gain=2.0),
    ], model=model)

    def chat(system: str | None) -> str:
        return tokenizer.apply_chat_template(chat_messages(PROMPT, system),
                                             add_generation_prompt=True, tokenize=False)

    with torch.inference_mode():
        tokens_per_second(model, tokenizer, chat(None), 4, 1)  # warm-up
        plain = tokens_per_second(model, tokenizer, chat(None), args.new_tokens, args.repeats)
        prompted = tokens_per_second(model, tokenizer, chat(DEFAULT_PERSONA), args.new_tokens,
                                     args.repeats)
        with steer(model, banks):
            steered = tokens_per_second(model, tokenizer, chat(None), args.new_tokens,
                                        args.repeats)
    print(f"greedy decode, batch 1, {args.new_tokens} new tokens, median of {args.repeats}:")
    print(f"  plain              {plain:6.1f} tok/s  1.00x")
    print(f"  prompt baseline    {prompted:6.1f} tok/s  {prompted / plain:.2f}x")
    print(f"  memory inception   {steered:6.1f} tok/s  {steered / plain:.2f}x "
          f"({steered / prompted:.2f}x of prompt)")
    log.write(new_tokens=args.new_tokens, repeats=args.repeats, layers=list(args.layers),
              plain_tok_s=plain, prompt_tok_s=prompted, memory_tok_s=steered,
              memory_ratio=steered / plain, prompt_ratio=prompted / plain)

    descriptor = tokenizer(DEFAULT_PERSONA, return_tensors="pt", add_special_tokens=False)
    persona_only = BankSet([banks["persona"]], model=model)
    for label, bank_set in (("persona bank", persona_only), ("persona + reference", banks)):
        fp = kv_footprint(model, bank_set, descriptor.input_ids)
        print(f"KV, {label}: bank {fp.bank_slots} slots x {fp.controlled_layers} layers = "
              f"{fp.bank_bytes / 1024:.0f} KiB; descriptor as visible prompt "
              f"{fp.prompt_tokens} tokens x {fp.num_layers} layers = "
              f"{fp.prompt_kv_bytes / 1024:.0f} KiB; bank is {fp.actual_ratio:.2f}x smaller "
              f"(idealised {fp.idealised_ratio:.2f}x)")
        log.write(kv=label, bank_bytes=fp.bank_bytes, prompt_kv_bytes=fp.prompt_kv_bytes,
                  ratio=fp.actual_ratio, idealised_ratio=fp.idealised_ratio)

if __name__ == "__main__":
    main()
