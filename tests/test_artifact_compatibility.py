"""Artifacts written before hf_memory was arranged by role load and steer as they did.

``tests/fixtures/artifacts_b54bc12/`` holds a bank set, a selector and CAA vectors for the tiny
Llama of ``tests.tiny_models`` written by the code of commit b54bc12 (the flat layout) with
``write_with_b54bc12.py`` beside them. Today's code must load them (the fingerprint checked
against the same tiny model), steer with them exactly as with the same objects built today, and
write them back byte for byte (the format did not move with the code).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_memory import BankSet, CAAVectors, MemoryBank, Selector, apply_caa, steer
from tests.tiny_models import tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "artifacts_b54bc12"
FILES = {"banks": ("config.json", "banks.safetensors", "README.md"),
         "selector": ("selector.json", "diagnostics.safetensors", "README.md"),
         "caa": ("config.json", "caa_vectors.safetensors", "README.md")}


def rebuilt(model):
    """The objects the fixture script saved, built again today from the same random draws."""
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    kv, d, layers = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, 3

    def bank(name, role, m):
        keys = torch.randn(layers, kv, m, d, generator=g, dtype=torch.float64)
        values = torch.randn(layers, kv, m, d, generator=g, dtype=torch.float64)
        return MemoryBank.from_tensors(keys, values, layers=[0, 1, 2], role=role, name=name,
                                       gain=1.5)

    banks = BankSet([bank("t", "target", 3), bank("r", "reference", 2)], model=model, gamma=2.0)
    vectors = CAAVectors({1: torch.randn(cfg.hidden_size, generator=g, dtype=torch.float64)},
                         scale=2.0)
    return banks, vectors


def test_old_artifacts_load_and_steer_as_the_same_objects_built_today():
    model = tiny_model("llama")
    banks = BankSet.from_pretrained(FIXTURES / "banks", model=model)
    selector = Selector.from_pretrained(FIXTURES / "selector", model=model)
    vectors = CAAVectors.from_pretrained(FIXTURES / "caa", model=model)
    today_banks, today_vectors = rebuilt(model)
    assert [b.content_hash() for b in banks] == [b.content_hash() for b in today_banks]
    assert (selector.layers, selector.units, selector.strength) == ([1, 2], {1: [0, 2], 2: [1]},
                                                                    0.75)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with steer(model, banks, selector=selector):
        old = model(ids).logits
    with steer(model, today_banks, selector=selector):
        new = model(ids).logits
    plain = model(ids).logits
    assert torch.equal(old, new) and not torch.allclose(old, plain)
    with apply_caa(model, vectors):
        old = model(ids).logits
    with apply_caa(model, today_vectors):
        assert torch.equal(model(ids).logits, old)


@pytest.mark.parametrize("kind", sorted(FILES))
def test_todays_code_writes_the_old_artifacts_back_byte_for_byte(kind, tmp_path):
    model = tiny_model("llama")
    loader = {"banks": BankSet, "selector": Selector, "caa": CAAVectors}[kind]
    loader.from_pretrained(FIXTURES / kind, model=model).save_pretrained(tmp_path)
    config, weights, card = FILES[kind]
    assert (json.loads((tmp_path / config).read_text())
            == json.loads((FIXTURES / kind / config).read_text()))
    assert (tmp_path / card).read_text() == (FIXTURES / kind / card).read_text()
    saved, old = load_file(tmp_path / weights), load_file(FIXTURES / kind / weights)
    assert saved.keys() == old.keys()
    assert all(torch.equal(saved[name], old[name]) for name in old)
