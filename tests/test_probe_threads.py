"""Independent probes measured side by side: results in order, in threads of their own, with
the caller's context and grad mode; progress in the caller's thread; errors raised, the calls not
started cancelled; bad thread counts refused."""

from __future__ import annotations

import threading
import time
from contextvars import ContextVar

import pytest
import torch

from hf_memory.selection.probe_threads import DEFAULT_WORKERS, check_workers, map_in_threads

CALLER_VALUE: ContextVar[str] = ContextVar("caller_value", default="unset")


def test_results_come_in_order_from_calls_that_ran_at_the_same_time():
    both = threading.Barrier(2, timeout=10)  # broken (an error) unless two calls overlap
    caller = threading.get_ident()

    def call(item):
        if item < 2:
            both.wait()
        time.sleep(0.01 * (5 - item))  # later items finish first
        return item * item, threading.get_ident()

    results = map_in_threads(call, range(5), 2)
    assert [value for value, _ in results] == [0, 1, 4, 9, 16]
    assert caller not in {ident for _, ident in results}


def test_each_call_sees_the_callers_context_and_grad_mode():
    token = CALLER_VALUE.set("the caller's")
    try:
        with torch.no_grad():
            seen = map_in_threads(lambda _: (CALLER_VALUE.get(), torch.is_grad_enabled()),
                                  range(4), 2)
        assert seen == [("the caller's", False)] * 4
        assert map_in_threads(lambda _: torch.is_grad_enabled(), range(2), 2) == [True, True]
    finally:
        CALLER_VALUE.reset(token)

    def sets_its_own(item):  # a call's own context changes stay in it
        CALLER_VALUE.set(f"call {item}")
        return CALLER_VALUE.get()

    assert map_in_threads(sets_its_own, range(4), 2) == [f"call {i}" for i in range(4)]
    assert CALLER_VALUE.get() == "unset"


def test_finished_runs_in_the_callers_thread_once_per_result():
    caller, seen = threading.get_ident(), []
    results = map_in_threads(lambda item: item + 1, range(6), 2,
                             finished=lambda result: seen.append((result,
                                                                  threading.get_ident())))
    assert results == [1, 2, 3, 4, 5, 6]
    assert sorted(result for result, _ in seen) == results
    assert {ident for _, ident in seen} == {caller}
    one = []
    assert map_in_threads(lambda item: -item, [3, 4], 1, finished=one.append) == [-3, -4]
    assert one == [-3, -4]


def test_an_error_is_raised_and_the_calls_not_started_are_cancelled():
    started = []

    def call(item):
        started.append(item)
        if item == 0:
            raise RuntimeError("probe 0 failed")
        time.sleep(0.05)
        return item

    with pytest.raises(RuntimeError, match="probe 0 failed"):
        map_in_threads(call, range(40), 2)
    assert 0 in started and len(started) < 40


def test_one_worker_or_one_item_runs_in_the_callers_thread():
    caller = threading.get_ident()
    assert map_in_threads(lambda _: threading.get_ident(), range(3), 1) == [caller] * 3
    assert map_in_threads(lambda _: threading.get_ident(), [7], 4) == [caller]
    assert map_in_threads(lambda _: 1, [], 2) == []


def test_thread_counts_are_checked():
    assert check_workers(None) == DEFAULT_WORKERS and 1 <= DEFAULT_WORKERS <= 2
    assert check_workers(3) == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="workers must be a thread count"):
            check_workers(bad)
