"""Operations a steered decoding step dispatches, per steered layer: a count any machine can take.

On a GPU each dispatched operation (views aside) is a kernel launch, and at small batches a
decoding step's time is set by its launches (``gpu/mi_profile.py``: ~36 µs each on the H200
host), so this count is what a steered layer costs there before any arithmetic. One decoding
step of a model of the embedded SmolLM2-135M's shape (random weights, float32, CPU) after a
64-token prompt, plain and steered by a target + reference bank of 24 slots at five layers
through each mixture path; every aten operation that reaches the dispatcher is counted, views
and allocations left out. Batch 1 without a mask, batch 8 with left padding.

Usage: python -m benchmarks.steering.step_ops
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from benchmarks.ops import NOT_KERNELS
from benchmarks.results import ResultLog, add_jsonl_argument
from benchmarks.steering.serving_shapes import banks_for, build
from hf_memory import steer
from hf_memory.models.transformers_compat import cache_kwargs

STEERED_LAYERS = 5


class Dispatched(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(model, ids, mask, steering) -> collections.Counter:
    with torch.inference_mode(), steering:
        cache = DynamicCache(config=model.config)
        logits = model(ids, attention_mask=mask, **cache_kwargs(cache), use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        with Dispatched() as counted:
            model(token, attention_mask=mask, **cache_kwargs(cache), use_cache=True)
    return counted.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_jsonl_argument(parser, "steering")
    log = ResultLog(parser.parse_args().jsonl, "steering.step_ops")
    torch.manual_seed(0)
    model = build("smollm2-135m", torch.device("cpu"), torch.float32)
    banks = banks_for(model)
    print("# one decoding step after 64 tokens, SmolLM2-135M shape, 2 x 24 slots at 5 layers; "
          "aten operations dispatched (views and allocations left out)")
    for batch in (1, 8):
        ids = torch.randint(1, model.config.vocab_size, (batch, 64))
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[1::2, :8] = 0  # left padding on every other row
        plain = decode_step_ops(model, ids, mask, contextlib.nullcontext())
        print(f"batch {batch}: plain {sum(plain.values())} operations")
        log.write(batch=batch, path="plain", operations=sum(plain.values()))
        for path in ("reference", "auto"):
            ops = decode_step_ops(model, ids, mask, steer(model, banks, mixture_path=path))
            extra = ops - plain
            log.write(batch=batch, path=path, operations=sum(ops.values()),
                      per_steered_layer=sum(extra.values()) / STEERED_LAYERS,
                      extra={name: n // STEERED_LAYERS for name, n in extra.most_common()})
            print(f"  {path:9} {sum(ops.values())} (+{sum(extra.values()) / STEERED_LAYERS:.0f} "
                  f"per steered layer): "
                  + ", ".join(f"{name} {n // STEERED_LAYERS}" for name, n in extra.most_common()))


if __name__ == "__main__":
    main()
