"""A frozen behavioural selector is reused for a bank of the same recipe (even when its tensors
differ in the last bits, as they do across thread counts) and never for another recipe."""

from __future__ import annotations

import dataclasses

import pytest

from eval_harness.dialogue_shift.task import DialogueShiftConfig
from eval_harness.directions import bank_sources, behavioural_selector
from hf_memory import BankSet, MemoryBank, Selector, model_fingerprint
from tests.tiny_models import tiny_model

PAIRS = [("How are you?", "I am so worried.", "I am fine."),
         ("Any plans?", "I fear it will go wrong.", "A calm walk.")]
DRIFT = {"other": [("Tea?", "Yes please.", "No thanks.")]}


def _banks(model, tokenizer, text, nudge=0.0):
    bank = MemoryBank.from_text(model, tokenizer, text, role="target", name="persona",
                                template="{text}", context="system")
    if nudge:
        bank = dataclasses.replace(bank, keys=bank.keys + nudge)
    return BankSet([bank], model=model)


def test_same_recipe_reuses_the_saved_selector_other_recipes_recalibrate(default_model,
                                                                         tmp_path, monkeypatch):
    tokenizer = default_model[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    config = DialogueShiftConfig(top_layers=2, gains=[1.0], selectors_dir=str(tmp_path))
    first = behavioural_selector(model, tokenizer, _banks(model, tokenizer, "I worry."), PAIRS,
                                 DRIFT, config, "x")
    assert first.config["bank_sources"] == bank_sources(_banks(model, tokenizer, "I worry."))

    def refuse(*args, **kwargs):
        raise AssertionError("recalibrated")

    monkeypatch.setattr(Selector, "calibrate_behavioural", refuse)
    nudged = _banks(model, tokenizer, "I worry.", nudge=1e-12)
    assert nudged.audit() != _banks(model, tokenizer, "I worry.").audit()
    again = behavioural_selector(model, tokenizer, nudged, PAIRS, DRIFT, config, "x")
    assert again.layers == first.layers and again.layer_gains == first.layer_gains
    with pytest.raises(AssertionError, match="recalibrated"):
        behavioural_selector(model, tokenizer, _banks(model, tokenizer, "I never worry."),
                             PAIRS, DRIFT, config, "x")
    with pytest.raises(AssertionError, match="recalibrated"):
        behavioural_selector(model, tokenizer, nudged, PAIRS[:1], DRIFT, config, "x")


def test_a_selector_made_on_another_model_is_not_reused(default_model, tmp_path):
    tokenizer = default_model[1]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    config = DialogueShiftConfig(top_layers=2, gains=[1.0], selectors_dir=str(tmp_path))
    # N+ names a selector shipped with the package, made on the default model
    selector = behavioural_selector(model, tokenizer, _banks(model, tokenizer, "I worry."), PAIRS,
                                    DRIFT, config, "N+")
    assert selector.fingerprint == model_fingerprint(model)
    assert Selector.from_pretrained(tmp_path / "N+", model=model).layers == selector.layers


@pytest.mark.slow
def test_the_shipped_selectors_are_reused_whatever_the_thread_count(default_model, monkeypatch):
    from eval_harness.directions import TraitSteeringConfig, direction_bank
    from hf_memory.recipes.calibration_data import calibration_pairs, direction_parts

    model, tokenizer = default_model
    monkeypatch.setattr(Selector, "calibrate_behavioural", lambda *a, **k: None)
    config = TraitSteeringConfig(directions=["N+", "A-"])
    for direction in config.directions:
        _, _, target, _ = direction_parts(direction)
        pairs, drift = calibration_pairs(direction, 24, 2)
        banks = BankSet([direction_bank(model, tokenizer, target, "target", "persona", config)],
                        model=model)
        selector = behavioural_selector(model, tokenizer, banks, pairs, drift, config,
                                        direction)
        assert selector is not None and selector.config["bank_recipe"]["text"] == target
