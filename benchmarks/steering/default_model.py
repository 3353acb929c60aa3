"""Default model: cold GGUF conversion vs cached load, and decoding with vs without a KV cache.

Both baselines run in this process, so the printed ratios compare like with like.
Usage: python -m benchmarks.steering.default_model [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import platform
import tempfile

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import median_seconds, timed
from hf_memory import generate_chat, load_default_model
from hf_memory.chat.generation import chat_messages


def decode_tokens_per_second(
    model, tokenizer, new_tokens: int, use_cache: bool, repeats: int
) -> float:
    """Median tokens/s over ``repeats`` greedy generations of exactly ``new_tokens`` tokens."""
    text = tokenizer.apply_chat_template(
        chat_messages("Write a short paragraph about the sea."), add_generation_prompt=True,
        tokenize=False)
    batch = tokenizer([text], return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        return new_tokens / median_seconds(lambda: model.generate(
            **batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            use_cache=use_cache, pad_token_id=tokenizer.pad_token_id), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_jsonl_argument(parser, "steering")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "steering.default_model")
    torch.manual_seed(0)
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, cuda={torch.cuda.is_available()}")

    with tempfile.TemporaryDirectory() as cache:
        _, cold = timed(lambda: load_default_model(cache_dir=cache))
        (model, tokenizer), warm = timed(lambda: load_default_model(cache_dir=cache))
    print(f"load: first (GGUF de-quantize + cache) {cold:.2f}s, cached {warm:.2f}s, "
          f"ratio {cold / warm:.1f}x")
    log.write(load_cold_s=cold, load_cached_s=warm, ratio=cold / warm)

    generate_chat(model, tokenizer, ["Hi"], max_new_tokens=4)  # warm-up
    with_cache = decode_tokens_per_second(model, tokenizer, args.new_tokens, use_cache=True,
                                          repeats=args.repeats)
    without = decode_tokens_per_second(model, tokenizer, args.new_tokens, use_cache=False,
                                       repeats=args.repeats)
    print(f"greedy decode, {args.new_tokens} tokens, batch 1, median of {args.repeats}: "
          f"DynamicCache {with_cache:.1f} tok/s, "
          f"no cache {without:.1f} tok/s, ratio {with_cache / without:.2f}x")
    log.write(new_tokens=args.new_tokens, repeats=args.repeats, cached_tok_s=with_cache,
              uncached_tok_s=without, ratio=with_cache / without)


if __name__ == "__main__":
    main()
