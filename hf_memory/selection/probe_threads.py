"""Probes of a search measured side by side, in threads.

A search's probes are forward passes of one model (the neutral-text cost, the factual answers,
the calibration pairs under a steering). Steering belongs to the calling context
(:mod:`hf_memory.steering.attention`), so passes of different configurations can run at the same
time in threads of one process, each one's numbers the same, to the bit, as when it runs alone
(CPU kernels are deterministic for a given shape and intra-op thread count, which this leaves
as it is). On the 2-core build machine two threads measure eight single-layer costs in 0.78x the
time of one after the other, where PyTorch's two intra-op threads already share each pass
(personas page, "Two probes at a time").
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, TypeVar

import torch

__all__ = ["DEFAULT_WORKERS", "check_workers", "map_in_threads"]

T = TypeVar("T")

# Threads a search measures independent probes in: 2 where the process may use two cores or more.
# A guess beyond the 2-core build machine, where it was measured (module docstring): more threads,
# each with PyTorch's intra-op threads, share the same cores.
DEFAULT_WORKERS = min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                      else os.cpu_count() or 1)


def check_workers(workers: Any) -> int:
    """``workers`` as a thread count (an int >= 1; None: :data:`DEFAULT_WORKERS`)."""
    if workers is None:
        return DEFAULT_WORKERS
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a thread count (an int >= 1) or None, got "
                         f"{workers!r}")
    return workers


def map_in_threads(function: Callable[[Any], T], items: Sequence[Any], workers: int, *,
                   finished: Callable[[T], Any] | None = None) -> list[T]:
    """``[function(item) for item in items]``, in up to ``workers`` threads. Each call runs in a
    copy of the caller's context (its steering, if any) with the caller's grad mode;
    ``finished`` is called with each result, in the caller's thread, as it comes (a progress
    bar's update). An error is raised once the calls under way finish (those not started are
    cancelled)."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        results = []
        for item in items:
            results.append(function(item))
            if finished is not None:
                finished(results[-1])
        return results
    grad = torch.is_grad_enabled()

    def call(item: Any) -> T:
        with torch.set_grad_enabled(grad):
            return function(item)

    pool = ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="hf-memory-probe")
    try:
        futures = [pool.submit(contextvars.copy_context().run, call, item) for item in items]
        for future in as_completed(futures):
            result = future.result()
            if finished is not None:
                finished(result)
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
