"""The clock every benchmark reads: one timed call, or the median of repeated calls.

CUDA work is asynchronous, so on a CUDA device the clock is read after ``torch.cuda.synchronize``
(on the CPU nothing is waited for).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the device's queued work (CUDA only)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device | str | None = None) -> tuple[T, float]:
    """``fn()``'s result and its wall seconds."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int, warmups: int = 0,
                   device: torch.device | str | None = None) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn()``, after ``warmups`` untimed ones."""
    for _ in range(warmups):
        fn()
    return statistics.median(timed(fn, device)[1] for _ in range(repeats))


def wall_and_cpu_seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall seconds of ``fn()`` and this thread's CPU seconds in it (with one torch thread, the
    call's own work, whatever else the machine runs)."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - start, time.thread_time() - start_cpu


def median_cuda_ms(fn: Callable[[], object], repeats: int = 50, warmups: int = 5) -> float:
    """Median milliseconds of ``fn()`` by CUDA events (the GPU's own clock, without the host's
    launch gaps around the call), after ``warmups`` untimed calls."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
