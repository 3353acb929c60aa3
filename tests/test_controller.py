"""The step-wise bank controller in generate(), and multi-turn conversations with bank shifts."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_memory import BankSet, MemoryBank, steer
from hf_memory.models.transformers_compat import cache_kwargs, output_cache
from hf_memory.recipes.demo import DEFAULT_PERSONA
from hf_memory.steering.controller import BankController, Switch
from hf_memory.steering.conversation import Conversation
from tests.test_memory_inception import random_bank, token_ids
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

PROMPT_LEN, NEW = 6, 8


def banks_a_b():
    return ([random_bank("a", "target", 4, gain=3.0, seed=11)],
            [random_bank("b", "target", 4, gain=3.0, seed=12)])


def generate(model, ids, controllers=()):
    return model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                          stopping_criteria=list(controllers), return_dict_in_generate=True)


@torch.no_grad()
def manual_switch(model, ids, first, second, switch_at):
    """Greedy decode under ``first`` whose tokens from number ``switch_at`` on use ``second``."""
    handle = steer(model, first)
    cache = DynamicCache(config=model.config)
    logits = model(ids, **cache_kwargs(cache), use_cache=True).logits
    out = ids
    for produced in range(NEW):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, token], dim=1)
        if produced + 1 == switch_at:
            handle.update(second)
        logits = model(token, **cache_kwargs(cache), use_cache=True).logits
    handle.remove()
    return out


def test_switch_at_a_token_follows_the_new_bank_and_keeps_the_past():
    model = tiny_model("llama")
    ids = token_ids(1, PROMPT_LEN)
    first, second = banks_a_b()
    with steer(model, first):
        only_first = generate(model, ids)
    with steer(model, first) as handle:
        controller = BankController(handle, [Switch(second, at_token=4)], prompt_length=PROMPT_LEN)
        switched = generate(model, ids, [controller])
    expected = manual_switch(model, ids, first, second, switch_at=4)
    assert torch.equal(switched.sequences, expected)
    assert torch.equal(switched.sequences[:, :PROMPT_LEN + 4],
                       only_first.sequences[:, :PROMPT_LEN + 4])
    assert not torch.equal(switched.sequences, only_first.sequences)
    kept = PROMPT_LEN + 3  # prompt and the first three generated tokens were fed before the switch
    for old, new in zip(output_cache(only_first).layers, output_cache(switched).layers,
                        strict=True):
        assert torch.equal(old.keys[:, :, :kept], new.keys[:, :, :kept])
        assert torch.equal(old.values[:, :, :kept], new.values[:, :, :kept])
    assert controller.events == [{"after_token": 4, "banks": ["b"]}]
    assert [t["token"] for t in controller.trace] == list(range(1, NEW + 1))
    assert [t["banks"] for t in controller.trace] == [["a"]] * 4 + [["b"]] * 4
    for step in controller.trace:
        torch.testing.assert_close(step["mass"].sum(-1), torch.ones(1, dtype=torch.float64))


def test_switch_on_a_trigger_token():
    model = tiny_model("qwen3")
    ids = token_ids(1, PROMPT_LEN)
    first, second = banks_a_b()
    with steer(model, first):
        only_first = generate(model, ids).sequences
    trigger = int(only_first[0, PROMPT_LEN + 1])  # the second generated token
    first_time = int((only_first[0, PROMPT_LEN:] == trigger).nonzero()[0])
    with steer(model, first) as handle:
        controller = BankController(handle, [Switch(second, on_token_ids=[trigger])],
                                    prompt_length=PROMPT_LEN)
        switched = generate(model, ids, [controller]).sequences
    assert torch.equal(switched, manual_switch(model, ids, first, second,
                                               switch_at=first_time + 1))
    assert controller.events[0]["after_token"] == first_time + 1


def test_switch_needs_one_rule():
    with pytest.raises(ValueError, match="exactly one"):
        Switch([], at_token=2, on_token_ids=[3])
    with pytest.raises(ValueError, match="at_token must be >= 1"):
        Switch([], at_token=0)


@pytest.mark.slow
def test_conversation_shifts_banks_without_rewriting_the_transcript(default_model):
    model, tokenizer = default_model
    bank = MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, template="{text}",
                                layers=range(18, 23), gain=2.0)
    chat = Conversation(model, tokenizer)
    first = chat.say("What is the capital of France?", max_new_tokens=12)
    assert "Paris" in first
    transcript = chat.token_ids.clone()
    cached = chat.cache.get_seq_length()
    keys = [layer.keys[:, :, :cached].clone() for layer in chat.cache.layers]
    chat.set_banks(BankSet([bank], model=model))
    shifted = chat.say("How do you feel about your exam tomorrow?", max_new_tokens=12)
    assert torch.equal(chat.token_ids[:, : transcript.shape[1]], transcript)
    for before, layer in zip(keys, chat.cache.layers, strict=True):
        assert torch.equal(layer.keys[:, :, :cached], before)
    chat.close()

    plain = Conversation(model, tokenizer)
    plain.say("What is the capital of France?", max_new_tokens=12)
    assert plain.say("How do you feel about your exam tomorrow?", max_new_tokens=12) != shifted
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    with pytest.raises(ValueError, match="non-empty"):
        chat.say("  ")
