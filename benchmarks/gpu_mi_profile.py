"""Where a steered decode step's time goes on a CUDA GPU: kernels launched and GPU busy time.

For two serving shapes of ``mi_serving_shapes.py`` (SmolLM2-135M shape at batch 1 / prompt 64:
launch-bound; Llama-1B shape at batch 32 / prompt 2,048: memory-bound), one decode step of
the bf16 model, plain and steered (2 x 24 slots at five layers):

* CUDA kernels per step and their summed GPU time (torch.profiler), so a step's wall time can be
  split into GPU work and launch/host overhead;
* median wall time per step, plain vs steered.

Usage: python benchmarks/gpu_mi_profile.py [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from benchmarks.mi_serving_shapes import banks_for, build
from hf_memory import steer
from hf_memory.models.transformers_compat import cache_kwargs

CUDA = torch.device("cuda")
SHAPES = [("smollm2-135m", 1, 64), ("llama-1b", 32, 2048)]


def prefilled(model, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(ids, **cache_kwargs(cache), use_cache=True)
    return cache


def step_ms(model, ids: torch.Tensor, steps: int) -> float:
    """Median ms of a decode step after ``ids`` (the first two steps warm up)."""
    cache = prefilled(model, ids)
    token = ids[:, -1:]
    times = []
    for _ in range(steps + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(token, **cache_kwargs(cache), use_cache=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[2:])


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_mi_profile.py needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; one decode step, bf16")
    for name, batch, prompt in SHAPES:
        model = build(name, CUDA, torch.bfloat16)
        banks = banks_for(model)
        ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device=CUDA)
        with torch.inference_mode():
            plain_n, plain_gpu = kernels(model, ids)
            step_ms(model, ids, args.steps)  # warm-up: the GPU's clocks rise from idle
            plain_ms = step_ms(model, ids, args.steps)
            steered = {}
            for path in ("reference", "torch", "auto"):
                with steer(model, banks, mixture_path=path):
                    steered[path] = (*kernels(model, ids), step_ms(model, ids, args.steps))
        print(f"{name} batch {batch} prompt {prompt}:")
        print(f"  plain    {plain_ms:7.2f} ms/step, {plain_n:5d} kernels, GPU busy "
              f"{plain_gpu:6.2f} ms")
        for path, (steered_n, steered_gpu, steered_ms) in steered.items():
            print(f"  {path:9}{steered_ms:7.2f} ms/step, {steered_n:5d} kernels, GPU busy "
                  f"{steered_gpu:6.2f} ms  (ratio {plain_ms / steered_ms:.2f}x)", flush=True)
        del model, banks
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
