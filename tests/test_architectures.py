"""The whole automatic path on every supported family: banks built from text in context, a
behavioural selector calibrated on them, CAA extracted, and steered generation with a cache.

Tiny random models of each family read the embedded model's tokenizer (its vocabulary and chat
template); float32, so that stock Gemma 2's padded rows stay finite (in float64 its eager
attention turns the padding mask into -inf, see tests/test_steering_rows.py).
"""

from __future__ import annotations

import pytest
import torch

from hf_memory import BankSet, MemoryBank, Selector, steer
from hf_memory.baselines.caa import CAAVectors, apply_caa
from hf_memory.models.adapters import head_dim
from tests.tiny_models import FAMILIES, tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

PAIRS = [("How are you?", "I worry a lot.", "I am calm."),
         ("Any plans?", "I fear the worst.", "I will relax."),
         ("How was work?", "Everything went wrong.", "It went fine.")]


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_text_banks_selector_caa_and_cached_generation(family, tokenizer):
    model = tiny_model(family, dtype=torch.float32, vocab_size=len(tokenizer))
    banks = BankSet([
        MemoryBank.from_text(model, tokenizer, "You are anxious and worried.", role="target"),
        MemoryBank.from_text(model, tokenizer, "You are calm and relaxed.", role="reference"),
    ], model=model)
    config = model.config
    for bank in banks.banks:  # every layer, the model's KV heads, pre-RoPE slots of the text
        assert bank.keys.shape[:2] == (config.num_hidden_layers, config.num_key_value_heads)
        assert bank.keys.shape[-1] == head_dim(config) and bank.keys.shape == bank.values.shape
        assert torch.isfinite(bank.keys).all() and torch.isfinite(bank.values).all()
    selector = Selector.calibrate_behavioural(
        model, tokenizer, banks, PAIRS, top_layers=1, gains=[1.0, 2.0], uncertainty_weight=0.0,
        cost_budget=None, progress=False)
    assert len(selector.layers) == 1 and all(selector.units.values())
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "How are you?"}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)
    with steer(model, banks):  # every layer: the banks move greedy decoding
        steered = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert not torch.equal(plain, steered)
    with steer(model, banks, selector=selector):
        assert model.generate(ids, max_new_tokens=6, do_sample=False).shape == plain.shape
    vectors = CAAVectors.extract(model, tokenizer, [(a, b) for _, a, b in PAIRS], layers=[1],
                                 scale=4.0)
    assert torch.isfinite(vectors.vectors[1]).all()
    with apply_caa(model, vectors, start_position=ids.shape[1]):
        assert model.generate(ids, max_new_tokens=6, do_sample=False).shape == plain.shape
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), plain)
