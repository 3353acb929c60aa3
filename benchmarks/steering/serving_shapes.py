"""Memory inception at serving shapes: steered vs plain ``generate()``, CPU or CUDA GPU.

Speed does not depend on the weights, so the models are randomly initialised from configs built
here: the embedded SmolLM2-135M's shape, a Llama-3.2-1B shape and a Qwen3-MoE shape (or the
embedded model itself, ``embedded``). Each is steered by a target and a reference bank of 24
slots at five layers (the size of a shipped selector's sites), built with
``MemoryBank.from_tensors``. For each batch and prompt length: greedy ``generate()`` of the new
tokens, plain and steered by each mixture path alternating (``auto``: the banks merged into the
stock kernel's output by its log-sum-exp where the device has such a kernel, on CUDA in one
Triton kernel; ``torch``: that merge in PyTorch ops; ``reference``: the history recomputed
beside the stock call, the path before both), median of the repeats after a
warm-up round (``--warmups``); tokens/s and the steered / plain ratio of the whole call, and
apart the ratio of its prefill (its first forward pass, into an empty cache) and of a decoding
step (the median of its later forward passes, and of their mean: slow outliers), all timed
inside the same call, and the seconds the call spent outside forward passes (plain → steered).

Usage: python -m benchmarks.steering.serving_shapes [--device cpu|cuda] [--models ...]
       [--batches 1 8 32] [--prompts 64 2048] [--jsonl FILE] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from contextlib import nullcontext

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import synchronize, timed
from hf_memory import BankSet, MemoryBank, load_default_model, steer

PATHS = ("reference", "torch", "auto")
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
    "embedded": None,  # the embedded SmolLM2-135M-Instruct itself
}


def build(name: str, device: torch.device, dtype: torch.dtype):
    if MODELS[name] is None:
        model, _ = load_default_model()
        model = model.to(device=device, dtype=dtype).eval()
    else:
        config_class, model_class, shape = MODELS[name]
        torch.manual_seed(0)
        with device:
            model = model_class(config_class(**shape, pad_token_id=0)).to(dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def banks_for(model, slots: int = 24, sites: int = 5) -> BankSet:
    device, dtype = model.device, model.dtype
    config = model.config
    layers = sorted({round(i * (config.num_hidden_layers - 1) / (sites - 1))
                     for i in range(sites)})
    head_dim = (getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (len(layers), config.num_key_value_heads, slots, head_dim)
    made = [MemoryBank.from_tensors(
        torch.randn(shape, generator=gen, device=device).to(dtype),
        torch.randn(shape, generator=gen, device=device).to(dtype),
        name=role, role=role, layers=layers, gain=1.0) for role in ("target", "reference")]
    return BankSet(made, model=model)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``, read back by :func:`device_dtype_and_machine`."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="default: bfloat16 on CUDA, float32 on the CPU")


def device_dtype_and_machine(args) -> tuple[torch.device, torch.dtype, str]:
    """The device, the dtype (bfloat16 on CUDA, float32 on the CPU unless given) and the machine
    in words (the GPU's name, or the CPU's and its torch threads)."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    where = (torch.cuda.get_device_name() if device.type == "cuda"
             else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                  "threads")
    return device, dtype, where


def timed_generate(model, ids: torch.Tensor,
                   new_tokens: int) -> tuple[float, float, float, float, float]:
    """Seconds of a greedy ``generate()`` of ``new_tokens``, of its prefill (its first forward
    pass, into an empty cache), the median and the mean seconds of its decoding steps (the later
    forward passes; a mean above the median: slow outliers) and the seconds it spent outside
    forward passes, each forward timed by hooks on the model that run outside every steering
    hook."""
    starts, seconds = [], []

    def begin(module, args, kwargs):
        synchronize(ids.device)
        starts.append(time.perf_counter())

    def end(module, args, kwargs, output):
        synchronize(ids.device)
        seconds.append(time.perf_counter() - starts[-1])

    hooks = [model.register_forward_pre_hook(begin, with_kwargs=True, prepend=True),
             model.register_forward_hook(end, with_kwargs=True)]
    try:
        _, total = timed(lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0), ids.device)
    finally:
        for hook in hooks:
            hook.remove()
    return (total, seconds[0], statistics.median(seconds[1:]), statistics.fmean(seconds[1:]),
            total - sum(seconds))


def measure(model, banks: BankSet, batch: int, prompt: int, new_tokens: int,
            repeats: int, paths: tuple[str, ...] = PATHS, warmups: int = 1) -> dict:
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=model.device)
    labels = ("plain",) + paths
    times: dict[str, list] = {label: [] for label in labels}
    with torch.inference_mode():
        for repeat in range(warmups + repeats):  # the first rounds warm up
            for label in labels:
                with (nullcontext() if label == "plain"
                      else steer(model, banks, mixture_path=label)):
                    measured = timed_generate(model, ids, new_tokens)
                if repeat >= warmups:
                    times[label].append(measured)
    median = {label: [statistics.median(column) for column in zip(*rows, strict=True)]
              for label, rows in times.items()}
    plain = median["plain"]
    row = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens,
           "plain_tok_s": batch * new_tokens / plain[0],
           "plain_prefill_s": plain[1], "plain_step_ms": 1000 * plain[2],
           "plain_outside_s": plain[4]}
    for path in paths:
        generate, prefill, step, mean_step, outside = median[path]
        row[path] = {"tok_s": batch * new_tokens / generate, "ratio": plain[0] / generate,
                     "prefill_ratio": plain[1] / prefill, "decode_ratio": plain[2] / step,
                     "decode_mean_ratio": plain[3] / mean_step, "outside_s": outside}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_jsonl_argument(parser, "steering")
    parser.add_argument("--quick", action="store_true", help="a small grid, to check the script")
    add_device_arguments(parser)
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        default=["smollm2-135m", "llama-1b", "qwen3-moe"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompts", nargs="+", type=int, default=[64, 2048])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmups", type=int, default=1,
                        help="untimed rounds before the repeats at each shape (0: none, for "
                             "shapes so large that one round takes many minutes, measured after "
                             "a smaller shape in the same process)")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=["reference", "auto"],
                        help="the mixture paths to time beside plain (default: reference and "
                             "auto; torch: the log-sum-exp merge in PyTorch ops, which auto is "
                             "on a CPU)")
    args = parser.parse_args()
    paths = tuple(args.paths)
    device, dtype, where = device_dtype_and_machine(args)
    batches, prompts = ([1, 2], [16]) if args.quick else (args.batches, args.prompts)
    print(f"# {where}, torch {torch.__version__}; greedy generate() of {args.new_tokens} new "
          f"tokens, {dtype}, banks 2 x 24 slots at 5 layers; ratios steered / plain, "
          f"{' | '.join(paths)} path", flush=True)
    print(f"{'model':>13} {'B':>3} {'prompt':>6} {'plain tok/s':>12} {'ratio':>13} "
          f"{'prefill':>13} {'decode':>13} {'decode mean':>13} {'outside ms':>13}")
    log = ResultLog(args.jsonl, "steering.serving_shapes")
    for name in args.models:
        model = build(name, device, dtype)
        banks = banks_for(model)
        for prompt in prompts:
            for batch in batches:
                row = {"model": name, "device": where, "dtype": str(dtype),
                       **measure(model, banks, batch, prompt, args.new_tokens,
                                 args.repeats, paths, warmups=args.warmups)}
                log.write(**row)
                print(f"{name:>13} {batch:>3} {prompt:>6} {row['plain_tok_s']:>12,.1f} "
                      + " ".join("|".join(f"{row[path][k]:>5.2f}" for path in paths) + "x"
                                 for k in ("ratio", "prefill_ratio", "decode_ratio",
                                           "decode_mean_ratio"))
                      + f" {1e3 * row['plain_outside_s']:.0f}→"
                      + "|".join(f"{1e3 * row[path]['outside_s']:.0f}" for path in paths),
                      flush=True)
        del model, banks
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
