"""The typed configuration and result of the two selection searches
(``hf_memory.selection.search_types``): the flat keywords and ``config=`` are the same search, the
two behavioural algorithms are named, and the result still reads as the dict it was."""

from __future__ import annotations

import json

import pytest
import torch

from hf_memory import BankSet, Selector
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.selection.attention_search import calibrate_by_attention
from hf_memory.selection.behavioural_calibration import calibrate_by_behaviour
from hf_memory.selection.defaults import DEFAULT_COST_BUDGET
from hf_memory.selection.search_types import (
    BUDGETED,
    UNBUDGETED,
    AttentionConfig,
    AttentionScoring,
    BehaviouralConfig,
    BudgetedSettings,
    SelectionResult,
    UnbudgetedSettings,
    keyword_defaults,
)
from tests.test_cost_budget import PAIRS, PASSAGES, chat_tiny  # noqa: F401 (a fixture)
from tests.test_memory_inception import random_bank
from tests.test_selector import CharTokenizer
from tests.tiny_models import tiny_model


def test_the_keyword_defaults_are_the_config_defaults():
    assert BehaviouralConfig.from_keywords(
        **keyword_defaults(calibrate_by_behaviour)) == BehaviouralConfig()
    assert AttentionConfig.from_keywords(
        **keyword_defaults(calibrate_by_attention)) == AttentionConfig()


def test_cost_budget_none_names_the_unbudgeted_algorithm():
    assert BehaviouralConfig().algorithm == BUDGETED
    assert BehaviouralConfig().cost_budget == DEFAULT_COST_BUDGET
    unbudgeted = BehaviouralConfig.from_keywords(cost_budget=None, gains=(1.0,),
                                                 max_evaluations=3)
    assert unbudgeted.algorithm == UNBUDGETED and unbudgeted.cost_budget is None
    assert unbudgeted.unbudgeted == UnbudgetedSettings((1.0,), 3)
    budgeted = BehaviouralConfig.from_keywords(cost_budget=0.2, layer_stride=1,
                                               drift_weight=0.5)
    assert budgeted.budgeted == BudgetedSettings(cost_budget=0.2, layer_stride=1)
    assert budgeted.weights.drift_weight == 0.5 and budgeted.cost_budget == 0.2
    with pytest.raises(ValueError, match="algorithm must be one of"):
        BehaviouralConfig(algorithm="greedy")


def test_config_and_keywords_are_not_both_given():
    model = tiny_model("llama")
    banks = BankSet([random_bank("t", "target", 5, seed=1),
                     random_bank("r", "reference", 4, seed=2)])
    with pytest.raises(ValueError, match="not both .*top_layers"):
        calibrate_by_attention(model, CharTokenizer(), banks, ["x"], top_layers=2,
                               config=AttentionConfig())
    with pytest.raises(TypeError, match="config must be a AttentionConfig"):
        calibrate_by_attention(model, CharTokenizer(), banks, ["x"], config=BehaviouralConfig())


def test_the_result_reads_as_the_dict_it_was():
    fields = dict(layers=[1], units={1: [0]}, unit_type="head", layer_gains={1: 1.0},
                  candidate_layers=[0, 1], diagnostics={"score": torch.zeros(2, 1)},
                  config={"best": {"score": 1.0}}, fingerprint=None)
    unbudgeted = SelectionResult(**fields)
    assert list(unbudgeted) == list(fields) and len(unbudgeted) == len(fields)
    assert "strength" not in unbudgeted and unbudgeted.get("strength") is None
    assert unbudgeted["config"]["best"] == {"score": 1.0} and unbudgeted == fields
    with pytest.raises(KeyError):
        unbudgeted["strength"]  # noqa: B018
    budgeted = SelectionResult(**fields, strength=0.5)
    assert list(budgeted) == [*list(fields)[:6], "strength", "config", "fingerprint"]
    assert budgeted["strength"] == 0.5 and dict(budgeted) == {**fields, "strength": 0.5}
    assert Selector(**budgeted) == Selector(**dict(budgeted))
    assert Selector(**unbudgeted).strength == 1.0


def same_result(a, b):
    assert type(a) is type(b) is SelectionResult
    assert list(a) == list(b)
    for key in a:
        if key == "diagnostics":
            assert a[key].keys() == b[key].keys()
            for name in a[key]:  # (NaN: layers the budgeted search did not screen)
                torch.testing.assert_close(a[key][name], b[key][name], rtol=0, atol=0,
                                           equal_nan=True)
        else:
            assert json.dumps(a[key], default=str) == json.dumps(b[key], default=str)


def test_attention_search_by_config_is_the_keyword_search():
    model = tiny_model("qwen2")
    banks = BankSet([random_bank("t", "target", 5, seed=1),
                     random_bank("r", "reference", 4, seed=2)])
    prompts = ["hello there", "abc", "worry"]
    by_keywords = calibrate_by_attention(model, CharTokenizer(), banks, prompts, top_layers=2,
                                         xi=0.5, order="score", chat_template=False,
                                         progress=False)
    config = AttentionConfig(top_layers=2, scoring=AttentionScoring(xi=0.5, order="score"),
                             chat_template=False, progress=False)
    same_result(by_keywords, calibrate_by_attention(model, CharTokenizer(), banks, prompts,
                                                    config=config))


def test_both_behavioural_algorithms_by_config_are_the_keyword_searches(chat_tiny):  # noqa: F811
    model, tokenizer = chat_tiny
    target = BankSet([random_bank("t", "target", 4, seed=1)])
    neutral = BankSet([random_bank("n", "target", 4, seed=2)])
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    budgeted = dict(cost_budget=1.0, cost=cost, control_banks=neutral, top_layers=1,
                    strengths=[0.5, 1.0], unit_search=False, progress=False)
    unbudgeted = dict(cost_budget=None, top_layers=1, gains=(1.0,), max_evaluations=4,
                      progress=False)
    for keywords in (budgeted, unbudgeted):
        config = BehaviouralConfig.from_keywords(**keywords)
        same_result(calibrate_by_behaviour(model, tokenizer, target, PAIRS, **keywords),
                    calibrate_by_behaviour(model, tokenizer, target, PAIRS, config=config))
