"""One training step of ASM against its parameter-matched Llama, in this process.

Times forward + backward + AdamW step of ``ASMForCausalLM`` and of the stock
``LlamaForCausalLM`` from ``matched_llama_config`` (same width, depth, heads, vocabulary and
parameter count within 5 %) on the same random token batch, alternating the two so drift in the
machine's load hits both, and prints the median step time, tokens per second and the ASM /
Llama ratio, by the wall clock and by this thread's CPU time (with one torch thread the step's
own work, whatever else runs on the machine). Defaults: the CPU-scale run of BENCHMARKS.md.

Usage: python -m benchmarks.asm.training_step [--hidden 256] [--layers 4] [--heads 4]
    [--block 128] [--batch 16] [--vocab 4096] [--chunk 32] [--repeats 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
from transformers import LlamaForCausalLM

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import wall_and_cpu_seconds
from modeling.asm import ASMConfig, ASMForCausalLM
from modeling.asm.baseline_asm import count_parameters, matched_llama_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=32, help="ASM scan chunk size")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    add_jsonl_argument(parser, "asm")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "asm.training_step", hidden=args.hidden, layers=args.layers,
                    heads=args.heads, batch=args.batch, block=args.block, threads=args.threads)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ASMConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       max_position_embeddings=args.block, chunk_size=min(args.chunk, args.block))
    models = {"asm": ASMForCausalLM(config),
              "llama": LlamaForCausalLM(matched_llama_config(config))}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    batch = torch.randint(0, args.vocab, (args.batch, args.block))
    times: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}

    def step(name: str) -> None:
        models[name](input_ids=batch, labels=batch, use_cache=False).loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    for repeat in range(args.repeats + 1):
        for name in models:
            wall, thread = wall_and_cpu_seconds(lambda n=name: step(n))
            if repeat:  # the first round warms up
                times[name].append(wall)
                cpu[name].append(thread)
    print(f"# {platform.processor() or platform.machine()}, {args.threads} thread(s), torch "
          f"{torch.__version__}; batch {args.batch} x {args.block} tokens, ASM chunk "
          f"{config.chunk_size}")
    tokens = args.batch * args.block
    for name, model in models.items():
        median = statistics.median(times[name])
        print(f"{name:6s} {count_parameters(model):>11,} parameters  step {median * 1e3:8.1f} ms  "
              f"{tokens / median:9.0f} tokens/s  cpu {statistics.median(cpu[name]) * 1e3:8.1f} ms")
        log.write(model=name, parameters=count_parameters(model), step_ms=median * 1e3,
                  tokens_s=tokens / median, cpu_ms=statistics.median(cpu[name]) * 1e3)
    for label, runs in (("step time", times), ("cpu time", cpu)):
        ratio = statistics.median(runs["asm"]) / statistics.median(runs["llama"])
        print(f"asm / llama {label}: {ratio:.2f}")
        log.write(model="asm / llama", **{label.replace(" ", "_") + "_ratio": ratio})


if __name__ == "__main__":
    main()
