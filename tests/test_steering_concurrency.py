"""Steering is a property of a call: one model object serves steered and plain callers in many
threads at once, each getting exactly what it gets alone."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_memory import steer, steered_generate
from hf_memory.baselines.caa import CAAVectors, apply_caa
from tests.test_memory_inception import assert_restored, random_bank, token_ids
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

NEW_TOKENS = 10
ROUNDS = 3


def bank_sets():
    """Three different bank sets (and ``None``: plain) over the tiny models' three layers."""
    return {
        "plain": None,
        "one": [random_bank("a", "target", 4, seed=1, gain=2.0)],
        "two": [random_bank("b", "target", 6, seed=2), random_bank("c", "reference", 3, seed=3)],
        "late": [random_bank("d", "target", 5, seed=4, layers=(1, 2), gain=3.0)],
    }


def generate(model, ids, banks):
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if banks is None:
        return model.generate(ids, **kwargs)
    with steer(model, banks):
        return model.generate(ids, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_concurrent_steered_and_plain_threads_each_get_what_they_get_alone(family):
    model = tiny_model(family)
    sets = bank_sets()
    requests = [(name, token_ids(batch=1, length=5 + i, seed=10 + i))
                for i, name in enumerate(["plain", "one", "two", "late", "plain", "one"])]
    alone = [generate(model, ids, sets[name]) for name, ids in requests]
    assert len({tuple(out[0, -NEW_TOKENS:].tolist()) for out in alone}) > 2  # banks steer
    barrier = threading.Barrier(len(requests))

    def worker(index):
        name, ids = requests[index]
        outputs = []
        for _ in range(ROUNDS):
            barrier.wait(timeout=60)
            outputs.append(generate(model, ids, sets[name]))
        return outputs

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(worker, range(len(requests))))
    for (name, _), expected, outputs in zip(requests, alone, results, strict=True):
        for output in outputs:
            assert torch.equal(output, expected), f"{name} differs from the same request alone"
    assert_restored(model)


def test_custom_generate_and_context_manager_callers_concurrently():
    model = tiny_model("llama")
    sets = bank_sets()
    ids = token_ids(batch=1, length=6, seed=3)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = {name: generate(model, ids, banks) for name, banks in sets.items()}
    barrier = threading.Barrier(4)

    def via_custom_generate(name):
        barrier.wait(timeout=60)
        return model.generate(ids, custom_generate=steered_generate, banks=sets[name], **kwargs)

    def via_steer(name):
        barrier.wait(timeout=60)
        return generate(model, ids, sets[name])

    with ThreadPoolExecutor(4) as pool:
        futures = {("custom", "one"): pool.submit(via_custom_generate, "one"),
                   ("custom", "two"): pool.submit(via_custom_generate, "two"),
                   ("steer", "late"): pool.submit(via_steer, "late"),
                   ("steer", "plain"): pool.submit(via_steer, "plain")}
        for (_, name), future in futures.items():
            assert torch.equal(future.result(), expected[name]), name
    assert_restored(model)


def test_a_handle_steers_only_its_own_context():
    model = tiny_model("llama")
    ids = token_ids()
    plain = model(ids).logits
    with steer(model, [random_bank("t", "target", 3)]):
        steered = model(ids).logits
        assert not torch.equal(steered, plain)
        with ThreadPoolExecutor(1) as pool:  # a new thread starts plain
            assert torch.equal(pool.submit(lambda: model(ids).logits).result(), plain)
    assert_restored(model)


def test_applied_steers_a_block_in_another_thread_and_remove_works_from_anywhere():
    model = tiny_model("llama")
    ids = token_ids()
    plain = model(ids).logits
    with steer(model, [random_bank("t", "target", 3)]):
        steered = model(ids).logits
    handle = steer(model, [random_bank("t", "target", 3)], active=False)
    assert torch.equal(model(ids).logits, plain)  # created inactive

    def in_worker():
        with handle.applied():
            inside = model(ids).logits
        return inside, model(ids).logits

    with ThreadPoolExecutor(1) as pool:
        inside, after = pool.submit(in_worker).result()
    assert torch.equal(inside, steered) and torch.equal(after, plain)
    active = steer(model, [random_bank("t", "target", 3)])
    with ThreadPoolExecutor(1) as pool:
        pool.submit(active.remove).result()  # removed in another thread: inert here too
    assert torch.equal(model(ids).logits, plain)
    handle.remove()
    assert_restored(model)
    with pytest.raises(RuntimeError, match="removed"), handle.applied():
        pass


def test_nested_steering_restores_the_outer_one():
    model = tiny_model("llama")
    ids = token_ids()
    plain = model(ids).logits
    outer_bank = [random_bank("o", "target", 3, seed=5)]
    with steer(model, outer_bank):
        outer = model(ids).logits
    with steer(model, outer_bank):
        with steer(model, [random_bank("i", "target", 4, seed=6, gain=2.0)]):
            inner = model(ids).logits
        assert torch.equal(model(ids).logits, outer)
    assert not torch.equal(inner, outer) and not torch.equal(outer, plain)
    assert_restored(model)


def test_asyncio_tasks_are_isolated():
    model = tiny_model("llama")
    ids = token_ids()
    plain = model(ids).logits
    bank = [random_bank("t", "target", 3)]
    with steer(model, bank):
        steered = model(ids).logits

    async def steered_task(started: asyncio.Event, done: asyncio.Event):
        with steer(model, bank):
            started.set()
            await done.wait()
            return model(ids).logits

    async def plain_task(started: asyncio.Event, done: asyncio.Event):
        await started.wait()
        logits = model(ids).logits  # runs while the other task holds its steering
        done.set()
        return logits

    async def main():
        started, done = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(steered_task(started, done), plain_task(started, done))

    got_steered, got_plain = asyncio.run(main())
    assert torch.equal(got_steered, steered) and torch.equal(got_plain, plain)
    assert_restored(model)


def test_caa_is_a_property_of_the_call_too():
    model = tiny_model("llama")
    ids = token_ids(batch=1, length=6, seed=4)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    vectors = CAAVectors({1: torch.randn(64, dtype=torch.float64,
                                         generator=torch.Generator().manual_seed(0))}, scale=3.0)
    plain = model.generate(ids, **kwargs)
    with apply_caa(model, vectors):
        steered = model.generate(ids, **kwargs)
    assert not torch.equal(steered, plain)
    barrier = threading.Barrier(4)

    def worker(with_caa):
        outputs = []
        for _ in range(ROUNDS):
            barrier.wait(timeout=60)
            if with_caa:
                with apply_caa(model, vectors):
                    outputs.append(model.generate(ids, **kwargs))
            else:
                outputs.append(model.generate(ids, **kwargs))
        return outputs

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(worker, [True, False, True, False]))
    for with_caa, outputs in zip([True, False, True, False], results, strict=True):
        for output in outputs:
            assert torch.equal(output, steered if with_caa else plain)
    handle = apply_caa(model, vectors, active=False)
    with ThreadPoolExecutor(1) as pool:
        def in_worker():
            with handle.applied():
                return model.generate(ids, **kwargs)
        assert torch.equal(pool.submit(in_worker).result(), steered)
    assert torch.equal(model.generate(ids, **kwargs), plain)
    handle.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks
