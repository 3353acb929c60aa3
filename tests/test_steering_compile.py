"""torch.compile and steering: a model with steering installed traces its plain calls as the
plain model does; a steered call traces into as many graphs as the plain call (its one context
lookup comes before the first operation; Llama, Gemma 3) and computes what the eager call
computes, on every family, transformers' own compiled static-cache decoding included; a
steering acts only while an activation of it is live (contexts copied from an activated one see
it only then)."""

from __future__ import annotations

import contextvars

import pytest
import torch
import torch._dynamo as dynamo
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import CompileConfig

from hf_memory import steer
from hf_memory.baselines.caa import CAAVectors, apply_caa
from hf_memory.steering.rotary import pre_rope_query, rotate
from hf_memory.steering.stock_attention import _cudnn_attention_on
from tests.test_memory_inception import random_bank, token_ids
from tests.tiny_models import FAMILIES, tiny_model


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


@pytest.mark.compat  # the attention interface and hooks of each transformers
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.slow
def test_plain_calls_trace_as_the_plain_model_with_steering_installed(family, fresh_dynamo):
    model = tiny_model(family, dtype=torch.float32)
    ids = token_ids(batch=1, length=6, seed=0)
    plain = graphs_and_breaks(model, ids)
    assert plain == (1, 0)
    memory, caa = installed_steerings(model)
    try:
        assert model.config._attn_implementation.startswith("hf_memory_")  # installed
        assert graphs_and_breaks(model, ids) == plain
        with memory.applied():  # live: steered, still one graph
            assert graphs_and_breaks(model, ids) == plain
        assert graphs_and_breaks(model, ids) == plain  # the block's end: traceable again
    finally:
        memory.remove()
        caa.remove()


@pytest.mark.compat  # the attention interface and hooks of each transformers
@pytest.mark.slow
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


@pytest.mark.compat  # the attention interface and hooks of each transformers
@pytest.mark.slow
def test_a_compiled_model_serves_per_row_banks_exactly(fresh_dynamo):
    model = tiny_model("qwen3")
    ids = token_ids(batch=3, length=7, seed=5)
    rows = [[random_bank("a", "target", 4, seed=1, gain=2.0)], None,
            [random_bank("b", "target", 5, seed=3, layers=(1, 2))]]
    handle = steer(model, rows, active=False)
    try:
        with torch.no_grad():
            plain = model(ids).logits
            with handle.applied():
                eager = model(ids).logits
                traced = torch.compile(model, backend="eager")(ids).logits
                assert graphs_and_breaks(model, ids) == (1, 0)  # (its audit record untraced)
    finally:
        handle.remove()
    assert [torch.equal(eager[i], plain[i]) for i in range(3)] == [False, True, False]
    torch.testing.assert_close(traced, eager, rtol=0, atol=1e-12)


@pytest.mark.compat  # the attention interface and hooks of each transformers
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


# OLMo-2 applies its rotary in float32 whatever the model's dtype, so the post-RoPE query a traced
# call un-rotates carries float32 rounding (measured 5e-8 on the logits of the float64 model);
# every other family rotates in the model's dtype.
ROTARY_ROUNDING = {"olmo2": 1e-6}


@pytest.mark.compat  # the attention interface and hooks of each transformers
@pytest.mark.slow  # one trace per family, ~10 s for the MoE ones (their routing breaks graphs)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_compiled_steered_call_equals_the_eager_one_on_every_family(family, fresh_dynamo):
    model = tiny_model(family)
    ids = token_ids(batch=2, length=7, seed=5)
    handle = steer(model, [random_bank("a", "target", 4, seed=1, gain=2.0),
                           random_bank("r", "reference", 3, seed=2)], layers=[1, 2],
                   active=False)
    try:
        with torch.no_grad(), handle.applied():
            eager = model(ids).logits
            traced = torch.compile(model, backend="eager")(ids).logits
        assert not torch.allclose(eager, model(ids).logits)  # the banks steer
        torch.testing.assert_close(traced, eager, rtol=0,
                                   atol=ROTARY_ROUNDING.get(family, 1e-12))
    finally:
        handle.remove()


@settings(max_examples=100, deadline=None)
@given(rotated=st.sampled_from([4, 8, 16]), scaling=st.floats(0.5, 2.0),
       seed=st.integers(0, 2**16))
def test_pre_rope_query_inverts_the_rotary(rotated, scaling, seed):
    """Rotating a query as transformers does (half-split, partial, with an attention scaling
    folded into cos and sin) is what ``rotate`` (which places bank keys) computes, and
    un-rotating it gives it back."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 3, 5, 16, generator=generator, dtype=torch.float64)
    angles = torch.rand(2, 5, rotated // 2, generator=generator, dtype=torch.float64) * 1e3
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = scaling * angles.cos(), scaling * angles.sin()
    turned, kept = query[..., :rotated], query[..., rotated:]
    half = rotated // 2
    rotate_half = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    post = torch.cat([turned * cos[:, None] + rotate_half * sin[:, None], kept], dim=-1)
    assert torch.equal(rotate(query, cos[:, None], sin[:, None]), post)
    torch.testing.assert_close(pre_rope_query(post, cos, sin), query, rtol=0, atol=1e-12)


def test_steered_generate_with_transformers_own_compiled_static_cache(fresh_dynamo):
    """``generate(cache_implementation="static")`` compiles the forward pass itself (on CUDA by
    default; here forced on the CPU): steered decoding through it equals the dynamic cache's.
    (Before the sites were keyed by id, the compiled steps ran plain.)"""
    model = tiny_model("llama")
    ids = token_ids(batch=2, length=7, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    handle = steer(model, [random_bank("a", "target", 4, seed=1, gain=2.0),
                           random_bank("r", "reference", 3, seed=2)], layers=[1, 2],
                   active=False)
    settings_ = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=mask,
                     output_scores=True, return_dict_in_generate=True)
    compile_config = CompileConfig(backend="eager")
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only
    dynamo.utils.counters.clear()
    try:
        with torch.no_grad():
            plain = model.generate(ids, **settings_).sequences
            with handle.applied():
                dynamic = model.generate(ids, **settings_)
                static = model.generate(ids, **settings_, cache_implementation="static",
                                        compile_config=compile_config)
    finally:
        handle.remove()
    assert dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the decoding steps compiled
    assert not torch.equal(dynamic.sequences, plain)
    assert torch.equal(static.sequences, dynamic.sequences)
    for compiled_step, eager_step in zip(static.scores, dynamic.scores, strict=True):
        torch.testing.assert_close(compiled_step, eager_step, rtol=0, atol=1e-12)


@pytest.mark.compat  # the Dynamo of the oldest supported stack too
def test_the_cuda_kernel_choice_is_a_constant_to_torch_compile(monkeypatch, fresh_dynamo):
    """Whether cuDNN's attention runs is asked of backend functions Dynamo cannot trace (on an
    H200 they broke a compiled steered call at every steered layer): the choice is taken as a
    constant while tracing, so a compiled CUDA call stays one graph. Here the capability query
    breaks the graph by construction, and CUDA is faked for the check alone."""
    def capability(device):
        dynamo.graph_break()
        return (9, 0)

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    cuda = torch.device("cuda", 0)

    def asked_directly(x):
        return x + 1 if torch.cuda.get_device_capability(cuda) >= (9, 0) else x - 1

    def asked_as_steering_does(x):
        return x + 1 if _cudnn_attention_on(cuda) else x - 1

    with pytest.raises(dynamo.exc.Unsupported):
        torch.compile(asked_directly, fullgraph=True, backend="eager")(torch.zeros(2))
    compiled = torch.compile(asked_as_steering_does, fullgraph=True, backend="eager")
    expected = 1.0 if torch.backends.cuda.cudnn_sdp_enabled() else -1.0
    assert torch.equal(compiled(torch.zeros(2)), torch.full((2,), expected))
    assert _cudnn_attention_on(cuda) == (expected > 0)  # eager: the same answer
