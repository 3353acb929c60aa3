"""ASM scan: chunk-parallel PyTorch vs a naive per-token loop, and O(1) decoding.

Everything runs in this process, so the printed ratios compare like with like:
* forward + backward of the scan + read (write scan, content-term read weights, first-order
  read) at T = 256, 1024, 4096: the exact chunked form vs an exact per-token recurrence written
  as a Python loop (what a straightforward implementation does), and the bytes each keeps for
  the backward pass;
* per-token decode latency of ASMForCausalLM (random weights) with its ASMCache after a context
  of 64 and of 4096 tokens, and the cache size at both.

Usage: python -m benchmarks.asm.scan [--lengths 256 1024 4096] [--threads 1] [--layers 21]
"""

from __future__ import annotations

import argparse
import platform
import statistics
from collections.abc import Callable

import torch

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.timing import median_seconds, timed
from hf_memory.models.transformers_compat import cache_kwargs, output_cache
from modeling.asm import ASMConfig, ASMForCausalLM, asa_attend_chunk_autograd


def naive_loop(logits: torch.Tensor, v: torch.Tensor, q: torch.Tensor, key_logits: torch.Tensor,
               gamma: torch.Tensor) -> torch.Tensor:
    """Exact per-token recurrence (running max, numerators, denominators) as a Python loop."""
    b, h, t, k = logits.shape
    m = torch.full((b, h, k), float("-inf"))
    den = torch.zeros(b, h, k)
    num = torch.zeros(b, h, k, v.shape[-1])
    outs = []
    for i in range(t):
        lg = logits[:, :, i]
        c = torch.maximum(m, lg).detach()
        carry, e = torch.exp(m - c), torch.exp(lg - c)
        den = den * carry + e
        num = num * carry[..., None] + e[..., None] * v[:, :, i, None, :]
        m = c
        slot = num / den[..., None]
        content = (slot * q[:, :, i, None, :]).sum(-1)
        r = torch.softmax(key_logits[:, :, i] + gamma * content, dim=-1)
        outs.append((r[..., None] * slot).sum(-2))
    return torch.stack(outs, dim=2)


def saved_bytes_and_seconds(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor],
                            repeats: int) -> tuple[int, float]:
    """Bytes of distinct tensors autograd saves for backward, and the median fwd+bwd seconds."""
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(*inputs)
    out.sum().backward()
    return sum(storages.values()), median_seconds(lambda: fn(*inputs).sum().backward(), repeats)


def scan_inputs(t: int, heads: int, slots: int, width: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, heads, t, slots), (1, heads, t, width), (1, heads, t, width),
              (1, heads, t, slots)]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    tensors[0] = tensors[0] + 0.05 * torch.arange(t, dtype=torch.float32)[:, None]  # recency
    tensors[2] = tensors[2] / width ** 0.5
    return [x.requires_grad_() for x in tensors] + [torch.tensor(0.5, requires_grad=True)]


def chunked(logits: torch.Tensor, v: torch.Tensor, q: torch.Tensor, key_logits: torch.Tensor,
            gamma: torch.Tensor) -> torch.Tensor:
    """The model's scan + read (:func:`asa_attend_chunk_autograd`, default chunk size 64)."""
    return asa_attend_chunk_autograd(logits, v, q, key_logits, gamma)[0]


def decode_ms_per_token(model: ASMForCausalLM, contexts: list[int],
                        steps: int) -> list[tuple[float, int]]:
    """Median ms per decoded token and cache bytes after each context; the steps of the
    contexts alternate, so load changes on a shared machine hit them alike."""
    caches = []
    with torch.inference_mode():
        for context in contexts:
            ids = torch.randint(0, model.config.vocab_size, (1, context))
            caches.append(output_cache(model(ids, use_cache=True)))
        token = torch.randint(0, model.config.vocab_size, (1, 1))
        runs: list[list[float]] = [[] for _ in contexts]
        for step in range(steps + 1):
            for cache, times in zip(caches, runs, strict=True):
                _, seconds = timed(lambda c=cache: model(token, **cache_kwargs(c), use_cache=True))
                if step:  # the first step is a warm-up
                    times.append(seconds)
    return [(1000 * statistics.median(times), cache.state_bytes())
            for cache, times in zip(caches, runs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=21, help="decode model depth (ASM-57M: 21)")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs=2, default=[64, 4096])
    add_jsonl_argument(parser, "asm")
    args = parser.parse_args()
    if args.threads < 1 or args.layers < 1 or min(args.lengths + args.contexts) < 1:
        parser.error("--threads, --layers, --lengths and --contexts must be positive")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ASMConfig(num_hidden_layers=args.layers)
    heads, slots, width = config.num_attention_heads, config.num_slots, config.head_dim
    print(f"# machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, cuda={torch.cuda.is_available()}")
    print(f"# scan + read, fwd+bwd, B=1 H={heads} K={slots} d={width} (ASM-57M head), "
          f"chunk {config.chunk_size}, median of {args.repeats}")
    log = ResultLog(args.jsonl, "asm.scan", threads=args.threads, repeats=args.repeats)
    print("T      chunked_s  naive_s  speedup  chunked_saved_MiB  naive_saved_MiB  mem_ratio")
    for t in args.lengths:
        inputs = scan_inputs(t, heads, slots, width)
        chunked_bytes, chunked_s = saved_bytes_and_seconds(chunked, inputs, args.repeats)
        naive_bytes, naive_s = saved_bytes_and_seconds(naive_loop, inputs, args.repeats)
        print(f"{t:<6} {chunked_s:9.3f}  {naive_s:7.3f}  {naive_s / chunked_s:6.1f}x  "
              f"{chunked_bytes / 2**20:17.1f}  {naive_bytes / 2**20:15.1f}  "
              f"{naive_bytes / chunked_bytes:8.1f}x")
        log.write(section="scan", length=t, chunked_s=chunked_s, naive_s=naive_s,
                  speedup=naive_s / chunked_s, chunked_saved_bytes=chunked_bytes,
                  naive_saved_bytes=naive_bytes, memory_ratio=naive_bytes / chunked_bytes)
    model = ASMForCausalLM(config).eval()
    short, long_ = args.contexts
    (ms_short, bytes_short), (ms_long, bytes_long) = decode_ms_per_token(
        model, [short, long_], args.decode_steps)
    print(f"# decode, ASMForCausalLM {args.layers} layers d_model {config.hidden_size}, batch 1, "
          f"median of {args.decode_steps} steps")
    print(f"context {short}: {ms_short:.2f} ms/token, cache {bytes_short / 2**10:.0f} KiB")
    print(f"context {long_}: {ms_long:.2f} ms/token, cache {bytes_long / 2**10:.0f} KiB")
    print(f"latency ratio {long_}/{short}: {ms_long / ms_short:.2f}")
    log.write(section="decode", layers=args.layers, steps=args.decode_steps,
              contexts=[short, long_], ms_per_token=[ms_short, ms_long],
              cache_bytes=[bytes_short, bytes_long], latency_ratio=ms_long / ms_short)


if __name__ == "__main__":
    main()
