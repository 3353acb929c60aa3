"""Memory inception at serving shapes on a CUDA GPU: steered vs plain ``generate()`` in bf16.

Speed does not depend on the weights, so the models are randomly initialised from configs built
here: the embedded SmolLM2-135M's shape, a Llama-3.2-1B shape and a Qwen3-MoE shape. Each is
steered by a target and a reference bank of 24 slots at five layers (the size of a shipped
selector's sites), built with ``MemoryBank.from_tensors`` in bf16. For batch 1, 8, 32 and
prompts of 64 and 2,048 tokens: greedy ``generate()`` of 64 new tokens, plain and steered
alternating, median of the repeats; tokens/s and the steered / plain ratio, and the same for the
prefill alone (1 new token).

Usage: python benchmarks/gpu_mi_generate.py [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_memory import BankSet, MemoryBank, steer

CUDA = torch.device("cuda")
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                max_position_embeddings=8192)
QWEN3_MOE = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=12,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
                 num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=3072,
                 decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=8192)
MODELS = {
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, SMOLLM2_135M),
    "llama-1b": (LlamaConfig, LlamaForCausalLM, LLAMA_1B),
    "qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_MOE),
}


def build(name: str):
    config_class, model_class, shape = MODELS[name]
    torch.manual_seed(0)
    with CUDA:
        model = model_class(config_class(**shape, pad_token_id=0)).to(torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    return model


def banks_for(model, slots: int = 24, sites: int = 5) -> BankSet:
    config = model.config
    layers = sorted({round(i * (config.num_hidden_layers - 1) / (sites - 1))
                     for i in range(sites)})
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    gen = torch.Generator(device=CUDA).manual_seed(0)
    shape = (len(layers), config.num_key_value_heads, slots, head_dim)
    made = [MemoryBank.from_tensors(
        torch.randn(shape, generator=gen, device=CUDA).bfloat16(),
        torch.randn(shape, generator=gen, device=CUDA).bfloat16(),
        name=role, role=role, layers=layers, gain=1.0) for role in ("target", "reference")]
    return BankSet(made, model=model)


def generate_seconds(model, ids: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model, banks: BankSet, batch: int, prompt: int, new_tokens: int,
            repeats: int) -> dict:
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=CUDA)
    times: dict[str, list[float]] = {k: [] for k in ("plain", "steered", "plain_1", "steered_1")}
    with torch.inference_mode():
        for repeat in range(repeats + 1):  # the first round warms up
            for label, n in (("", new_tokens), ("_1", 1)):
                plain = generate_seconds(model, ids, n)
                with steer(model, banks):
                    steered = generate_seconds(model, ids, n)
                if repeat:
                    times["plain" + label].append(plain)
                    times["steered" + label].append(steered)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "prompt": prompt, "new_tokens": new_tokens,
            "plain_tok_s": batch * new_tokens / median["plain"],
            "steered_tok_s": batch * new_tokens / median["steered"],
            "ratio": median["plain"] / median["steered"],
            "prefill_ratio": median["plain_1"] / median["steered_1"],
            "decode_ratio": (median["plain"] - median["plain_1"])
            / (median["steered"] - median["steered_1"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every measurement here (JSON lines)")
    parser.add_argument("--quick", action="store_true", help="a small grid, to check the script")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_mi_generate.py needs a CUDA device")
    batches, prompts = ([1, 2], [16]) if args.quick else ([1, 8, 32], [64, 2048])
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; greedy generate() "
          f"of {args.new_tokens} new tokens, bf16, banks 2 x 24 slots at 5 layers", flush=True)
    print(f"{'model':>13} {'B':>3} {'prompt':>6} {'plain tok/s':>12} {'steered tok/s':>14} "
          f"{'ratio':>6} {'prefill':>8} {'decode':>7}")
    rows = []
    try:
        for name in args.models:
            model = build(name)
            banks = banks_for(model)
            for prompt in prompts:
                for batch in batches:
                    row = {"model": name, **measure(model, banks, batch, prompt,
                                                    args.new_tokens, args.repeats)}
                    rows.append(row)
                    print(f"{name:>13} {batch:>3} {prompt:>6} {row['plain_tok_s']:>12,.0f} "
                          f"{row['steered_tok_s']:>14,.0f} {row['ratio']:>5.2f}x "
                          f"{row['prefill_ratio']:>7.2f}x {row['decode_ratio']:>6.2f}x",
                          flush=True)
            del model, banks
            torch.cuda.empty_cache()
    finally:
        if args.json:
            with open(args.json, "w") as handle:
                handle.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
