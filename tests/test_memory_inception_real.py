"""Memory inception on the embedded SmolLM2-135M-Instruct: bank construction and behaviour."""

from __future__ import annotations

import pytest
import torch

from hf_memory import BankSet, MemoryBank, kv_footprint, steer
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.recipes.demo import DEFAULT_PERSONA
from hf_memory_cli.types import parse_layers

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

PERSONA_LAYERS = parse_layers("18-22")


@torch.no_grad()
def test_bank_keys_and_values_are_what_the_model_computes(default_model):
    model, tokenizer = default_model
    text = "I worry about everything."
    template = "Hidden note: {text} End."
    bank = MemoryBank.from_text(model, tokenizer, text, template=template, layers=[0, 7, 29])
    (variant,) = bank.provenance["variants"]
    kept = variant["kept_positions"]
    assert tokenizer.decode([variant["token_ids"][i] for i in kept]).strip() == text
    ids = torch.tensor([variant["token_ids"]])
    hidden = model(ids, output_hidden_states=True).hidden_states
    for row, layer in enumerate(bank.layers):
        block = model.model.layers[layer]
        normed = block.input_layernorm(hidden[layer])
        keys = block.self_attn.k_proj(normed).view(1, -1, 3, 64).transpose(1, 2)[0, :, kept]
        values = block.self_attn.v_proj(normed).view(1, -1, 3, 64).transpose(1, 2)[0, :, kept]
        torch.testing.assert_close(bank.keys[row], keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bank.values[row], values, rtol=1e-5, atol=1e-5)


def test_default_templates_concatenate_and_keep_all_on_request(default_model):
    model, tokenizer = default_model
    text = "I love the sea."
    one = MemoryBank.from_text(model, tokenizer, text, template="{text}", layers=[3])
    three = MemoryBank.from_text(model, tokenizer, text, layers=[3])
    full = MemoryBank.from_text(model, tokenizer, text, template="Note: {text}", layers=[3],
                                keep="all")
    assert three.num_slots > 2 * one.num_slots
    assert len(three.provenance["variants"]) == 3
    (variant,) = full.provenance["variants"]
    kept = [variant["token_ids"][i] for i in variant["kept_positions"]]
    assert tokenizer.decode(kept).strip() == "Note: I love the sea."  # not the chat header
    assert variant["rendered"].startswith("<|im_start|>system\n") and min(
        variant["kept_positions"]) > 0
    assert full.num_slots == len(kept) > one.num_slots


@pytest.mark.parametrize("kwargs, message", [
    ({"text": ""}, "non-empty text"),
    ({"text": "x", "template": "no placeholder"}, "exactly once"),
    ({"text": "x", "layers": [30]}, r"layers must be indices in \[0, 30\)"),
    ({"text": "x", "keep": "some"}, "keep must be"),
])
def test_bad_bank_text_arguments(default_model, kwargs, message):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match=message):
        MemoryBank.from_text(model, tokenizer, **kwargs)


WORRY_CASES = [
    ("How do you feel about your exam tomorrow?",
     "I'm really worried and nervous about it.", "I feel calm and relaxed about it."),
    ("How do you feel about the trip next week?",
     "Honestly, I'm scared something will go wrong.", "Honestly, I'm sure it will go well."),
]


def worry_margin(model, tokenizer, method=None) -> float:
    """log p(worried answers) − log p(calm answers) to questions about upcoming events (nats,
    summed over the two cases); ``method`` presents the prompt (e.g. a visible system prompt)."""
    return float(pair_margins(model, tokenizer, WORRY_CASES, method=method).sum())


def test_an_anxious_bank_moves_the_model_towards_worry(default_model):
    model, tokenizer = default_model
    plain = worry_margin(model, tokenizer)
    bank = MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, role="target",
                                template="{text}", layers=PERSONA_LAYERS, gain=2.0)
    with steer(model, BankSet([bank], model=model)):
        steered = worry_margin(model, tokenizer)
    assert steered > plain + 2.0, (plain, steered)
    assert worry_margin(model, tokenizer) == plain


def test_kv_footprint_counts_real_bytes(default_model):
    model, tokenizer = default_model
    bank = MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, template="{text}",
                                layers=PERSONA_LAYERS)
    ids = tokenizer(DEFAULT_PERSONA, return_tensors="pt", add_special_tokens=False).input_ids
    footprint = kv_footprint(model, BankSet([bank], model=model), ids)
    tokens = ids.shape[1]
    per_token_layer = 2 * 3 * 64 * 4  # keys and values, 3 KV heads, head_dim 64, float32
    assert bank.num_slots == tokens
    assert footprint.prompt_kv_bytes == 30 * tokens * per_token_layer
    assert footprint.bank_bytes == 5 * tokens * per_token_layer
    assert footprint.idealised_ratio == pytest.approx(6.0)
    assert footprint.actual_ratio == pytest.approx(6.0)
    with pytest.raises(ValueError, match="not covered|none of layers"):
        kv_footprint(model, BankSet([bank], model=model), ids, layers=[0])


@pytest.mark.slow
def test_steered_batched_chat_equals_one_by_one(default_model):
    from hf_memory import generate_chat

    model, tokenizer = default_model
    bank = MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, template="{text}",
                                layers=PERSONA_LAYERS, gain=2.0)
    prompts = ["How do you feel about your exam tomorrow?", "Describe your morning in a sentence."]
    with steer(model, BankSet([bank], model=model)):
        batched = generate_chat(model, tokenizer, prompts, max_new_tokens=10)
        single = [generate_chat(model, tokenizer, [p], max_new_tokens=10)[0] for p in prompts]
    assert batched == single
    assert batched != generate_chat(model, tokenizer, prompts, max_new_tokens=10)
