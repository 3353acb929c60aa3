"""Where a steered decode step's time goes on a CUDA GPU: kernels launched and GPU busy time.

For two serving shapes of ``serving_shapes.py`` (SmolLM2-135M shape at batch 1 / prompt 64:
launch-bound; Llama-1B shape at batch 32 / prompt 2,048: memory-bound), one decode step of
the bf16 model, plain and steered (2 x 24 slots at five layers):

* CUDA kernels per step and their summed GPU time (torch.profiler), so a step's wall time can be
  split into GPU work and launch/host overhead;
* median wall time per step, plain vs steered, the paths interleaved in rounds.

Usage: python -m benchmarks.gpu.mi_profile [--steps 10] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import nullcontext

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.steering.serving_shapes import banks_for, build
from benchmarks.timing import timed
from hf_memory import steer
from hf_memory.models.transformers_compat import cache_kwargs

CUDA = torch.device("cuda")
SHAPES = [("smollm2-135m", 1, 64), ("llama-1b", 32, 2048)]


def prefilled(model, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(cache), use_cache=True)
    return cache


def step_times(model, ids: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps after ``ids`` (two more steps warm up)."""
    cache = prefilled(model, ids)
    token = ids[:, -1:]
    times = [timed(lambda: model(token, **cache_kwargs(cache), use_cache=True), CUDA)[1]
             for _ in range(steps + 2)]
    return times[2:]


def kernels(model, ids: torch.Tensor) -> tuple[int, float]:
    """CUDA kernels launched by one decode step and their summed GPU time in ms."""
    cache = prefilled(model, ids)
    token = ids[:, -1:]
    model(token, **cache_kwargs(cache), use_cache=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(token, **cache_kwargs(cache), use_cache=True)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in events)
    return len(events), busy / 1000


def scope(model, banks, path: str):
    """Plain, or steered by ``banks`` through the mixture ``path``."""
    return nullcontext() if path == "plain" else steer(model, banks, mixture_path=path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    add_jsonl_argument(parser, "gpu")
    args = parser.parse_args()
    log = ResultLog(args.jsonl, "gpu.mi_profile", steps=args.steps, rounds=args.rounds)
    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu.mi_profile needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; one decode step, bf16")
    for name, batch, prompt in SHAPES:
        model = build(name, CUDA, torch.bfloat16)
        banks = banks_for(model)
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=CUDA)
        paths = ("plain", "reference", "torch", "auto")
        counts, times = {}, {path: [] for path in paths}
        with torch.inference_mode():
            step_times(model, ids, args.steps)  # warm-up: the GPU's clocks rise from idle
            for path in paths:
                with scope(model, banks, path):
                    counts[path] = kernels(model, ids)
            for _ in range(args.rounds):  # the paths interleaved: the host's drift hits all
                for path in paths:
                    with scope(model, banks, path):
                        times[path] += step_times(model, ids, args.steps)
        ms = {path: 1000 * statistics.median(times[path]) for path in paths}
        print(f"{name} batch {batch} prompt {prompt} (median of {args.rounds} x {args.steps} "
              "steps per path, interleaved):")
        for path in paths:
            n, gpu = counts[path]
            print(f"  {path:9}{ms[path]:7.2f} ms/step, {n:5d} kernels, GPU busy {gpu:6.2f} ms"
                  + ("" if path == "plain" else f"  (ratio {ms['plain'] / ms[path]:.2f}x)"),
                  flush=True)
            log.write(model=name, batch=batch, prompt=prompt, path=path, ms_per_step=ms[path],
                      kernels=n, gpu_busy_ms=gpu, ratio=ms["plain"] / ms[path])
        del model, banks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
