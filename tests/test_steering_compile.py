"""A model with steering installed stays compilable for its plain calls, and a compiled model
switches between plain and steered calls exactly; a steering acts only while an activation of it
is live (contexts copied from an activated one see it only then)."""

from __future__ import annotations

import contextvars

import pytest
import torch
import torch._dynamo as dynamo

from hf_memory import steer
from hf_memory.baselines.caa import CAAVectors, apply_caa
from tests.test_memory_inception import random_bank, token_ids
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # the attention interface and hooks of each transformers


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches are process state: empty before and after each test."""
    dynamo.reset()
    yield
    dynamo.reset()


def graphs_and_breaks(model, ids) -> tuple[int, int]:
    dynamo.reset()
    explained = dynamo.explain(model)(ids)
    return explained.graph_count, explained.graph_break_count


def installed_steerings(model):
    """A memory steering and a CAA handle on ``model``, neither live anywhere."""
    memory = steer(model, [random_bank("a", "target", 4, seed=1, gain=2.0)], layers=[1],
                   active=False)
    caa = apply_caa(model, CAAVectors({1: torch.randn(64, dtype=model.dtype)}, scale=2.0),
                    active=False)
    return memory, caa


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_plain_calls_trace_as_the_plain_model_with_steering_installed(family, fresh_dynamo):
    model = tiny_model(family, dtype=torch.float32)
    ids = token_ids(batch=1, length=6, seed=0)
    plain = graphs_and_breaks(model, ids)
    assert plain == (1, 0)
    memory, caa = installed_steerings(model)
    try:
        assert model.config._attn_implementation.startswith("hf_memory_")  # installed
        assert graphs_and_breaks(model, ids) == plain
        with memory.applied():  # live: the running call looks its steering up (a break)
            assert graphs_and_breaks(model, ids)[1] > 0
        assert graphs_and_breaks(model, ids) == plain  # the block's end: traceable again
    finally:
        memory.remove()
        caa.remove()


def test_a_compiled_model_serves_plain_and_steered_calls_exactly(fresh_dynamo):
    model = tiny_model("llama")
    ids = token_ids(batch=2, length=7, seed=3)
    memory, caa = installed_steerings(model)
    try:
        with torch.no_grad():
            plain = model(ids).logits
            with memory.applied():
                steered = model(ids).logits
            with caa.applied():
                added = model(ids).logits
            compiled = torch.compile(model, backend="eager")
            assert torch.equal(compiled(ids).logits, plain)
            with memory.applied():  # the guard on the live count sends it past the plain graph
                assert torch.equal(compiled(ids).logits, steered)
            with caa.applied():
                assert torch.equal(compiled(ids).logits, added)
            assert torch.equal(compiled(ids).logits, plain)
        assert not torch.allclose(steered, plain) and not torch.allclose(added, plain)
    finally:
        memory.remove()
        caa.remove()


def test_a_copied_context_sees_a_steering_only_while_it_is_live():
    model = tiny_model("llama")
    ids = token_ids(batch=1, length=6, seed=4)
    memory, caa = installed_steerings(model)
    try:
        with torch.no_grad():
            plain = model(ids).logits
            for handle in (memory, caa):
                with handle.applied():
                    steered = model(ids).logits
                    copied = contextvars.copy_context()
                    assert torch.equal(copied.run(model, ids).logits, steered)
                assert not torch.allclose(steered, plain)
                assert torch.equal(copied.run(model, ids).logits, plain)  # no longer live
        active = steer(model, [random_bank("b", "target", 3, seed=2)], layers=[2])
        with torch.no_grad():  # active in this context until removed: copies see it till then
            copied = contextvars.copy_context()
            steered = copied.run(model, ids).logits
            assert not torch.allclose(steered, plain)
            active.remove()
            assert torch.equal(copied.run(model, ids).logits, plain)
    finally:
        memory.remove()
        caa.remove()
