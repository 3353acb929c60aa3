"""Automatic site selection: eq. 3, 11, 12 on hand-made tensors; calibration; the artifact."""

from __future__ import annotations

import statistics

import pytest
import torch
from transformers import BatchEncoding

from hf_memory import BankSet, FingerprintMismatchError, MemoryBank, steer
from hf_memory.recipes.demo import DEFAULT_PERSONA, DEFAULT_REFERENCE
from hf_memory.selection.attention_search import alignment_margin, select_sites, unit_scores
from hf_memory.selection.selector import Selector, SelectorFormatError
from tests.test_memory_inception import random_bank, token_ids
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

PROMPTS = ["How do you feel about your exam tomorrow?", "What are your plans for the weekend?",
           "Describe your morning.", "How was your day at work?",
           "What do you think about flying?", "Tell me about your last holiday."]


def test_alignment_margin_is_eq_3():
    queries = torch.tensor([[[[1.0, 0.0]], [[0.0, 2.0]]]])  # [B=1, H=2, T=1, D=2]
    target = torch.tensor([[[3.0, 0.0], [1.0, 1.0]], [[0.0, 1.0], [0.0, -1.0]]])  # [H, M, D]
    reference = torch.tensor([[[0.5, 9.0]], [[0.0, 4.0]]])
    margin = alignment_margin(queries, target, reference, scale=0.5)
    # head 0: max(3, 1) - 0.5 = 2.5; head 1: max(2, -2) - 8 = -6; times 0.5
    torch.testing.assert_close(margin, torch.tensor([[[1.25], [-3.0]]]))


def test_unit_scores_are_eq_11():
    a, m_plus, m_x = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.2]]), torch.tensor(
        [[0.4, 0.1]])
    torch.testing.assert_close(unit_scores(a, m_plus, m_x, xi=2.0, chi=3.0),
                               torch.tensor([[1.0 + 1.0 - 1.2, 0.0 + 0.4 - 0.3]]))


def test_select_sites_is_eq_12_with_deterministic_ties():
    scores = torch.tensor([[0.1, 0.9, 0.5],
                           [0.8, 0.8, 0.0],
                           [1.5, -1.0, -1.0],
                           [0.3, 0.3, 0.3]])
    rows, units, layer_scores = select_sites(scores, top_units=2, top_layers=2, aggregate="sum")
    torch.testing.assert_close(layer_scores, torch.tensor([1.4, 1.6, 0.5, 0.6]))
    assert rows == [1, 0]
    assert units == {1: [0, 1], 0: [1, 2]}
    rows, _, means = select_sites(scores, top_units=2, top_layers=3, aggregate="mean")
    torch.testing.assert_close(means, torch.tensor([0.7, 0.8, 0.25, 0.3]))
    assert rows == [1, 0, 3]
    with pytest.raises(ValueError, match="top_units"):
        select_sites(scores, top_units=4, top_layers=1)
    with pytest.raises(ValueError, match="aggregate"):
        select_sites(scores, top_units=1, top_layers=1, aggregate="max")


class CharTokenizer:
    """A tiny character tokenizer with the interface calibration uses (chat_template=False)."""

    pad_token, pad_token_id, padding_side = "\0", 0, "right"

    def __call__(self, texts, return_tensors=None, padding=False, add_special_tokens=False):
        ids = [[1 + ord(c) % 96 for c in text] for text in texts]
        width = max(map(len, ids))
        pad = [[0] * (width - len(row)) for row in ids]
        left = self.padding_side == "left"
        rows = [p + r if left else r + p for p, r in zip(pad, ids, strict=True)]
        masks = [[0] * len(p) + [1] * len(r) if left
                 else [1] * len(r) + [0] * len(p) for p, r in zip(pad, ids, strict=True)]
        return BatchEncoding({"input_ids": torch.tensor(rows),
                              "attention_mask": torch.tensor(masks)})


def tiny_calibration(model, **kwargs):
    banks = BankSet([random_bank("t", "target", 5, seed=1), random_bank("r", "reference", 4,
                                                                        seed=2)])
    return Selector.calibrate(model, CharTokenizer(), banks, ["hello there", "abc", "worry"],
                              chat_template=False, progress=False, **kwargs)


# not gemma2: calibration batches are left-padded, and in float64 its stock attention returns
# NaN on padded rows (tests/test_steering_rows.py says why)
@pytest.mark.parametrize("family", ["qwen3_moe", "mistral", "granite", "olmo2", "phi3",
                                    "gemma3_text"])
def test_calibration_shapes_units_and_determinism(family):
    model = tiny_model(family)
    selector = tiny_calibration(model, top_layers=2, top_units=1)
    assert selector.unit_type == "kv_group"  # grouped-query model: auto picks KV groups
    assert len(selector.layers) == 2 and selector.layers == sorted(selector.layers)
    assert all(len(units) == 1 for units in selector.units.values())
    assert selector.layer_gains == {layer: 1.0 for layer in selector.layers}
    for name in ("alignment", "target_mass", "reference_mass", "prompt_mass", "score"):
        assert selector.diagnostics[name].shape == (3, 2)
    masses = sum(selector.diagnostics[k] for k in ("target_mass", "reference_mass",
                                                   "prompt_mass"))
    torch.testing.assert_close(masses, torch.ones(3, 2), rtol=1e-5, atol=1e-5)
    again = tiny_calibration(model, top_layers=2, top_units=1)
    assert (again.layers, again.units) == (selector.layers, selector.units)
    for name, table in selector.diagnostics.items():
        assert torch.equal(table, again.diagnostics[name])
    heads = tiny_calibration(model, top_layers=2, top_units=3, unit_type="head")
    assert all(len(units) == 3 for units in heads.units.values())


def test_calibration_traces_without_changing_the_model():
    model = tiny_model("llama")
    ids = token_ids()
    plain = model(ids).logits
    tiny_calibration(model, top_layers=1)
    assert torch.equal(model(ids).logits, plain)


def test_kv_group_selector_steers_its_query_heads():
    model = tiny_model("qwen2")
    selector = tiny_calibration(model, top_layers=2, top_units=1, unit_type="kv_group")
    banks = BankSet([random_bank("t", "target", 5, seed=1), random_bank("r", "reference", 4,
                                                                        seed=2)])
    expanded = {layer: [2 * g + i for g in units for i in range(2)]
                for layer, units in selector.units.items()}
    ids = token_ids()
    with steer(model, banks, selector=selector) as handle:
        by_selector = model(ids).logits
        assert handle.active_sites == expanded
    with steer(model, banks, units=expanded, unit_type="head"):
        assert torch.equal(model(ids).logits, by_selector)


def test_selector_round_trip_and_model_check(tmp_path):
    model = tiny_model("llama")
    selector = tiny_calibration(model, top_layers=2, layer_gains="relative")
    selector.save_pretrained(tmp_path)
    loaded = Selector.from_pretrained(tmp_path, model=model)
    assert (loaded.layers, loaded.units, loaded.unit_type, loaded.layer_gains) == (
        selector.layers, selector.units, selector.unit_type, selector.layer_gains)
    assert loaded.config == selector.config
    for name, table in selector.diagnostics.items():
        assert torch.equal(loaded.diagnostics[name], table)
    assert "| layer | units | ρ |" in (tmp_path / "README.md").read_text()
    with pytest.raises(FingerprintMismatchError):
        Selector.from_pretrained(tmp_path, model=tiny_model("llama", seed=3))
    with pytest.raises(FingerprintMismatchError):
        steer(tiny_model("llama", seed=3), [], selector=loaded)
    (tmp_path / "diagnostics.safetensors").write_bytes(b"garbage")
    with pytest.raises(SelectorFormatError, match="corrupt"):
        Selector.from_pretrained(tmp_path)


def test_calibration_rejects_bad_input():
    model = tiny_model("llama")
    lone = BankSet([random_bank("t", "target", 5)])
    with pytest.raises(ValueError, match="target and a reference"):
        Selector.calibrate(model, CharTokenizer(), lone, ["x"], chat_template=False)
    banks = BankSet([random_bank("t", "target", 5), random_bank("r", "reference", 4)])
    with pytest.raises(ValueError, match="non-empty list"):
        Selector.calibrate(model, CharTokenizer(), banks, [], chat_template=False)
    with pytest.raises(ValueError, match="not covered"):
        Selector.calibrate(model, CharTokenizer(), banks, ["x"], chat_template=False,
                           candidate_layers=[5])


@pytest.mark.parametrize("order, criterion", [
    ("alignment", lambda r: r["alignment"]),  # appendix C: ā first
    ("score", lambda r: r["target_mass"] - r["prompt_mass"]),  # eq. 11 with ξ = χ = 1
])
@pytest.mark.slow
def test_calibration_on_the_embedded_model_beats_random_layers(default_model, order, criterion):
    model, tokenizer = default_model
    banks = BankSet([
        MemoryBank.from_text(model, tokenizer, DEFAULT_PERSONA, role="target", template="{text}"),
        MemoryBank.from_text(model, tokenizer, DEFAULT_REFERENCE, role="reference",
                             template="{text}"),
    ], model=model)
    selector = Selector.calibrate(model, tokenizer, banks, PROMPTS, top_layers=5, order=order,
                                  progress=False)
    assert selector.unit_type == "kv_group" and len(selector.layers) == 5
    assert selector.config["positions"] == "user"
    value = {r["layer"]: criterion(r) for r in selector.summary()}
    chosen = statistics.mean(value[layer] for layer in selector.layers)
    generator = torch.Generator().manual_seed(0)
    random_sets = [torch.randperm(30, generator=generator)[:5].tolist() for _ in range(200)]
    random_means = [statistics.mean(value[layer] for layer in layers) for layers in random_sets]
    assert chosen > sorted(random_means)[int(0.9 * len(random_means))]
