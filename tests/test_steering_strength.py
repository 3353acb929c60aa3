"""The strength dial: zero is the plain model bit for bit, one the full mixture, and between them
each steered head's output moves linearly from the plain output to the mixture."""

from __future__ import annotations

import pytest
import torch

from hf_memory import steer
from tests.test_memory_inception import TOL, assert_restored, random_bank, token_ids
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers


def attention_outputs(model, ids, layer):
    """The input of ``o_proj`` at ``layer``: the heads' outputs, concatenated."""
    seen = []
    attention = model.model.layers[layer].self_attn
    hook = attention.o_proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    try:
        logits = model(ids).logits
    finally:
        hook.remove()
    return seen[0], logits


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("units", [None, [1, 3]])  # every head, and two of four
def test_the_dial_moves_each_steered_head_linearly_from_plain_to_the_mixture(family, units):
    model = tiny_model(family)
    ids = token_ids()
    bank = [random_bank("t", "target", 5, gain=2.0)]
    plain, plain_logits = attention_outputs(model, ids, 1)
    with steer(model, bank, layers=[1], units=units) as handle:
        full, full_logits = attention_outputs(model, ids, 1)
        handle.set_strength(0.0)
        zero, zero_logits = attention_outputs(model, ids, 1)
        for strength in (0.25, 0.6):
            handle.set_strength(strength)
            part, _ = attention_outputs(model, ids, 1)
            torch.testing.assert_close(part, plain + strength * (full - plain), **TOL)
    assert torch.equal(zero, plain) and torch.equal(zero_logits, plain_logits)
    assert not torch.equal(full_logits, plain_logits)
    with steer(model, bank, layers=[1], units=units, strength=1.0):
        assert torch.equal(model(ids).logits, full_logits)
    assert_restored(model)


def test_zero_strength_generates_exactly_the_plain_model_and_is_audited():
    model = tiny_model("llama")
    ids = token_ids(batch=1)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, **kwargs)
    with steer(model, [random_bank("t", "target", 4, gain=3.0)], strength=0.0) as handle:
        assert torch.equal(model.generate(ids, **kwargs), plain)
        handle.set_strength(0.5)
        assert handle.audit_log[-1]["event"] == "strength"
        assert handle.audit_log[-1]["strength"] == 0.5


def test_rows_at_different_strengths_equal_each_alone():
    model = tiny_model("llama")
    ids = token_ids(batch=3)
    bank = [random_bank("t", "target", 4, gain=2.0)]
    handles = [steer(model, bank, strength=s, active=False) for s in (1.0, 0.3, 0.0)]
    with steer(model, handles):
        mixed = model(ids).logits
    for i, handle in enumerate(handles):
        with handle.applied():
            alone = model(ids).logits
        torch.testing.assert_close(mixed[i], alone[i], **TOL)
    for handle in handles:
        handle.remove()
    assert_restored(model)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "half", None])
def test_a_strength_outside_the_dial_is_one_clear_error(bad):
    model = tiny_model("llama")
    bank = [random_bank("t", "target", 4)]
    with pytest.raises(ValueError, match=r"strength must be a number in \[0, 1\]"):
        steer(model, bank, strength=bad)
    with steer(model, bank) as handle:
        with pytest.raises(ValueError, match=r"strength must be a number in \[0, 1\]"):
            handle.set_strength(bad)
        assert handle.strength == 1.0
    assert_restored(model)
