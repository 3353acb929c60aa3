"""The trait-steering harness's memory calibrated by a user's one-line persona call
(``TraitSteeringConfig.persona_recipes``, ``hf-memory eval trait-steering --persona-recipes``)."""

from __future__ import annotations

import dataclasses

import pytest

import hf_memory_cli as cli
from eval_harness.directions import TraitSteeringConfig, direction_memory, site_mass
from hf_memory import MemoryMethod
from hf_memory.recipes.calibration_data import calibration_prompts
from hf_memory.recipes.persona import PersonaSteering
from tests.end_to_end import small_steering


def test_persona_recipes_are_checked_by_name():
    assert TraitSteeringConfig().persona_recipes is None
    assert TraitSteeringConfig(persona_recipes=("contrast",)).persona_recipes == ["contrast"]
    for bad in (["telepathy"], [], ["contrast", "telepathy"]):
        with pytest.raises(ValueError, match="persona_recipes must be among"):
            TraitSteeringConfig(persona_recipes=bad)
    with pytest.raises(ValueError, match="calibrate within a cost budget"):
        TraitSteeringConfig(persona_recipes=["contrast"], cost_budget=None)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "8"])
def test_judge_prompts_must_be_a_non_negative_integer(bad):
    assert TraitSteeringConfig().judge_prompts == 8 and TraitSteeringConfig(
        judge_prompts=0).judge_prompts == 0
    with pytest.raises(ValueError, match="judge_prompts must be a non-negative integer"):
        TraitSteeringConfig(judge_prompts=bad)


def test_the_flag_is_parsed_and_refused_where_it_means_nothing(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "trait-steering", "--persona-recipes", "contrast,telepathy"])
    assert exit_info.value.code == 2
    assert "recipes must be among" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # the task's parser refuses the flag
        cli.main(["eval", "layer-ablation", "--persona-recipes", "contrast"])
    assert exit_info.value.code == 2
    assert ("--persona-recipes is a dialogue-shift / guidance / trait-steering option, not "
            "layer-ablation's"
            in capsys.readouterr().err)


@pytest.mark.slow
def test_a_direction_calibrated_by_the_persona_call_keeps_its_recipe(tmp_path,
                                                                     default_model):
    model, tokenizer = default_model
    config = dataclasses.replace(small_steering(tmp_path, "E+"), calibration_pairs=3,
                                 persona_recipes=["contrast"])
    target_bank, banks, selector = direction_memory(model, tokenizer, "E+", config)
    assert banks.contrast and [b.role for b in banks] == ["target", "reference"]
    assert target_bank is banks.banks[0]
    assert selector.config["bank_recipe"]["recipe"] == "contrast"
    assert set(selector.layers) <= {19, 20}
    # one of the three pairs became the banks' exemplar: its two replies, one in each bank
    recipe = selector.config["bank_recipe"]
    assert len(recipe["exemplars"]) == len(recipe["counter_exemplars"]) == 1
    saved = PersonaSteering.from_pretrained(tmp_path / "E+-persona", model=model)
    assert saved.recipe == "contrast" and saved.selector.layers == selector.layers
    assert [t["recipe"] for t in saved.trials] == ["contrast"]
    # the routing of a contrast set is its target side's: prompt + the target bank, summing to 1
    masses = site_mass(model, tokenizer, MemoryMethod(banks, selector), calibration_prompts()[:2])
    assert masses and all(set(m) == {"prompt", "persona"} for m in masses.values())
    for m in masses.values():
        assert sum(m.values()) == pytest.approx(1.0, abs=1e-3)
