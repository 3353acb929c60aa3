"""A user's own persona: slots placed before the conversation, the neutral control built by the
banks' own recipe, the budgeted call as the default, the validation split, and the one-call
persona calibration (a tiny model reading the embedded model's tokenizer; bad input)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hf_memory import BankSet, MemoryBank, MemoryMethod, PromptMethod, Selector
from hf_memory.banks.neutral_control import neutral_control, neutral_like
from hf_memory.metrics.likelihood import pair_margins
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.persona import (
    PersonaSteering,
    calibrate_persona,
    exemplar_text,
    persona_banks,
)
from hf_memory.recipes.voice_band import BAND_PROMPTS, band_prompts
from hf_memory.selection.behavioural_calibration import split_pairs
from hf_memory.selection.behavioural_search import ShiftObjective
from hf_memory.selection.budget_search import PROMPT_LIKE_GAINS
from tests.test_memory_inception import random_bank
from tests.tiny_models import tiny_model

PASSAGES = ["The sky is blue today.", "Seven plus five is twelve."]
TEXT = "I am always cheerful and I see the bright side of everything."
PAIRS = [(f"Question {i}: how is your day?", f"Wonderful, truly great {i}!",
          f"Awful, as usual {i}.") for i in range(9)]


@pytest.fixture(scope="module")
def chat_tiny(default_model):
    _, tokenizer = default_model
    return tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float32), tokenizer


def test_slots_before_the_conversation_sit_at_negative_positions(chat_tiny):
    model, tokenizer = chat_tiny
    free = MemoryBank.from_text(model, tokenizer, TEXT, template="{text}")
    before = MemoryBank.from_text(model, tokenizer, TEXT, template="{text}", placement="before")
    assert free.positions is None and free.provenance["placement"] == "free"
    variant = before.provenance["variants"][0]
    expected = torch.tensor(variant["kept_positions"]) - len(variant["token_ids"])
    assert torch.equal(before.positions, expected) and int(before.positions.max()) < 0
    assert torch.equal(before.keys, free.keys) and torch.equal(before.values, free.values)
    with pytest.raises(ValueError, match="placement must be one of"):
        MemoryBank.from_text(model, tokenizer, TEXT, placement="after")


def test_a_rows_score_under_placed_slots_does_not_depend_on_its_padding(chat_tiny):
    """Slots placed before the conversation sit at negative positions; a left-padded row's
    positions count from its first real token (as in ``generate()``), so its margin is the same
    scored alone or beside a longer row. (Counted from the padding, as before, a row was
    scored with its slots further away by its padding: 0.05 to 9 nats apart on the embedded
    model.)"""
    model, tokenizer = chat_tiny
    method = MemoryMethod(persona_banks(model, tokenizer, TEXT, recipe="prompt_like"),
                          layers=[0, 1], layer_gains={0: 1.0, 1: 1.0})
    pairs = [PAIRS[0], ("A much longer question, " * 6 + "how is it going?", "Fine!", "Bad.")]
    together = pair_margins(model, tokenizer, pairs, method=method)
    alone = torch.cat([pair_margins(model, tokenizer, [p], method=method, batch_size=1)
                       for p in pairs])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-4)
    assert (together - pair_margins(model, tokenizer, pairs)).abs().max() > 1e-3  # it steers


def test_neutral_control_follows_the_banks_recipe(chat_tiny):
    model, tokenizer = chat_tiny
    banks = persona_banks(model, tokenizer, TEXT, recipe="exemplars",
                          exemplars=["Great!", "What a lovely day."])
    control = neutral_control(model, tokenizer, banks)
    (bank,), (neutral,) = banks.banks, control.banks
    assert control.size_normalize is False and control.gamma == banks.gamma
    assert neutral.positions is not None and int(neutral.positions.max()) < 0
    assert neutral.layers == bank.layers and neutral.role == bank.role
    assert neutral.num_slots >= bank.num_slots  # neutral text at least as long
    assert neutral.provenance["text"] == neutral_like(tokenizer, bank.provenance["text"])
    with pytest.raises(ValueError, match="not built from text"):
        neutral_control(model, tokenizer, BankSet([random_bank("t", "target", 3)]))


def test_a_contrast_persona_holds_both_replies_and_its_control_is_a_contrast(chat_tiny):
    model, tokenizer = chat_tiny
    banks = persona_banks(model, tokenizer, TEXT, recipe="contrast",
                          exemplars=["Great!", "Lovely."], counter_exemplars=["Bad.", "Dull."])
    target, reference = banks.banks
    assert banks.contrast and banks.size_normalize is False
    assert (target.role, reference.role) == ("target", "reference")
    assert target.provenance["text"] == exemplar_text(TEXT, ["Great!", "Lovely."])
    assert reference.provenance["text"] == exemplar_text(TEXT, ["Bad.", "Dull."])
    control = neutral_control(model, tokenizer, banks)
    assert control.contrast and [b.role for b in control.banks] == ["target", "reference"]
    with pytest.raises(ValueError, match=r"needs replies without the persona \(counter_exemplars"):
        persona_banks(model, tokenizer, TEXT, recipe="contrast", exemplars=["Great!"])


def test_split_pairs_is_disjoint_deterministic_and_spread():
    items = [(str(i), "a", "b") for i in range(10)]
    search, held = split_pairs(items, 3)
    assert len(search) == 7 and len(held) == 3 and not set(search) & set(held)
    assert sorted(search + held) == sorted(items) and split_pairs(items, 3) == (search, held)
    assert [p[0] for p in held] == ["1", "4", "8"]
    assert split_pairs(items, 0) == (items, [])
    with pytest.raises(ValueError, match="cannot hold out"):
        split_pairs(items, 10)


def test_the_default_call_is_budgeted_with_a_recipe_control_and_none_opts_out(chat_tiny):
    model, tokenizer = chat_tiny
    banks = persona_banks(model, tokenizer, TEXT, recipe="prompt_like")
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    selector = Selector.calibrate_behavioural(model, tokenizer, banks, PAIRS, cost=cost,
                                              top_layers=1, unit_search=False,
                                              progress=False)
    config = selector.config
    assert config["objective"] == "behavioural_budgeted" and config["cost_budget"] == 0.1
    assert config["control"][0]["name"] == "neutral-persona"
    # concatenated attention: the dial runs at rho 0 (the prompt's own attention), then rho up
    assert config["dial"][0][1] == 0.0 and config["dial"][-1] == [1.0, PROMPT_LIKE_GAINS[-1]]
    assert config["num_pairs"] == 9 and config["search_pairs"] == 6
    assert config["validation"]["pairs"] == 3
    assert all(h["cost"] <= 0.1 for h in config["history"] if h["strength"] > 0)
    if selector.strength > 0:  # the frozen selector costs what the search measured
        assert cost.measure(MemoryMethod(banks, selector)) == pytest.approx(
            config["best"]["cost"], abs=1e-9)
    unbudgeted = Selector.calibrate_behavioural(model, tokenizer, banks, PAIRS, top_layers=1,
                                                gains=[1.0], cost_budget=None, progress=False)
    assert unbudgeted.config["objective"] == "behavioural"
    with pytest.raises(ValueError, match="control_banks must be"):
        Selector.calibrate_behavioural(model, tokenizer, banks, PAIRS, cost=cost,
                                       control_banks="neutral", progress=False)
    with pytest.raises(ValueError, match="validation must be a fraction"):
        Selector.calibrate_behavioural(model, tokenizer, banks, PAIRS, cost=cost,
                                       validation=1.5, progress=False)


def test_the_budgeted_search_tries_the_prompts_own_configuration(chat_tiny):
    """``prompt_like`` banks: every layer whose bank alone stays within the budget, scored
    together (the visible prompt less what breaks the budget), kept where it moves the
    validation pairs further than the greedy sites; size-normalised banks get no such trial."""
    model, tokenizer = chat_tiny
    banks = persona_banks(model, tokenizer, TEXT, recipe="prompt_like")
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    selector = Selector.calibrate_behavioural(
        model, tokenizer, banks, PAIRS, cost=cost, cost_budget=10.0, top_layers=1,
        layer_stride=1, unit_search=False, progress=False, workers=2)
    trial, check = selector.config["every_layer_trial"], selector.config["validation"]
    every = list(range(model.config.num_hidden_layers))
    assert trial["layers"] == every  # within a budget of 10 nats every layer qualifies
    greedy = trial["greedy_validation_target"]
    assert trial["kept"] == (greedy is None or trial["validation_target"] > greedy)
    assert selector.layers == (every if trial["kept"] else selector.layers[:1])
    assert check["kept_validation_target"] == max(trial["validation_target"], greedy)
    _, held = split_pairs(PAIRS, 3)
    units = {layer: list(range(model.config.num_key_value_heads)) for layer in every}
    steering = dict(layers=every, units=units, unit_type="kv_group",
                    strength=trial["strength"], layer_gains=dict.fromkeys(every, trial["gain"]))
    measured = ShiftObjective(model, tokenizer, held, uncertainty_weight=1.0).measure(
        MemoryMethod(banks, **steering),
        control=MemoryMethod(neutral_control(model, tokenizer, banks), **steering))
    assert measured["target"] == pytest.approx(trial["validation_target"], abs=1e-5)
    one_thread = Selector.calibrate_behavioural(  # the probes one after the other
        model, tokenizer, banks, PAIRS, cost=cost, cost_budget=10.0, top_layers=1,
        layer_stride=1, unit_search=False, progress=False, workers=1)
    assert one_thread.config == selector.config
    greedy_only = Selector.calibrate_behavioural(  # what the recipe screen runs
        model, tokenizer, banks, PAIRS, cost=cost, cost_budget=10.0, top_layers=1,
        layer_stride=1, unit_search=False, progress=False, every_layer=False)
    assert greedy_only.config["every_layer_trial"] is None
    assert all(len(h["layers"]) == 1 for h in greedy_only.config["history"])
    free = persona_banks(model, tokenizer, TEXT, recipe="descriptor")
    assert Selector.calibrate_behavioural(
        model, tokenizer, free, PAIRS, cost=cost, cost_budget=10.0, top_layers=1,
        unit_search=False, progress=False).config["every_layer_trial"] is None


def test_dropped_layers_do_not_lower_the_validation_movement(chat_tiny):
    model, tokenizer = chat_tiny
    banks = persona_banks(model, tokenizer, TEXT, recipe="prompt_like")
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    selector = Selector.calibrate_behavioural(
        model, tokenizer, banks, PAIRS, cost=cost, cost_budget=10.0, top_layers=2,
        layer_stride=1, unit_search=False, uncertainty_weight=0.0, progress=False)
    check = selector.config["validation"]
    assert check["kept_validation_target"] >= check["validation_target"]
    assert not set(check["dropped_layers"]) & set(selector.layers)
    _, held = split_pairs(PAIRS, 3)
    objective = ShiftObjective(model, tokenizer, held, uncertainty_weight=0.0)
    control = neutral_control(model, tokenizer, banks)
    measured = objective.measure(MemoryMethod(banks, selector),
                                 control=MemoryMethod(control, selector))
    assert measured["target"] == pytest.approx(check["kept_validation_target"], abs=1e-5)


def test_calibrate_persona_keeps_the_recipe_that_holds_and_round_trips(chat_tiny, tmp_path):
    model, tokenizer = chat_tiny
    found = calibrate_persona(model, tokenizer, TEXT, PAIRS,
                              recipes=("prompt_like", "exemplars"), top_layers=1,
                              unit_search=False, cost=NeutralCost(model, tokenizer,
                                                                  passages=PASSAGES),
                              kv_ceiling=None, capability_ceiling=None, screen=False,
                              progress=False)
    trials = {t["recipe"]: t for t in found.trials}
    assert set(trials) == {"prompt_like", "exemplars"}
    assert trials["exemplars"]["exemplars"] == 3 and trials["prompt_like"]["exemplars"] == 0
    best = max(trials.values(), key=lambda t: t["validation_target"])
    assert found.recipe == best["recipe"]
    text = found.banks.banks[0].provenance["text"]
    if found.recipe == "exemplars":  # the examples are the held-back pairs' target replies
        _, examples = split_pairs(PAIRS, 3)
        assert text == exemplar_text(TEXT, [t for _, t, _ in examples])
    loaded = PersonaSteering.from_pretrained(found.save_pretrained(tmp_path / "p"),
                                             model=model)
    assert loaded.recipe == found.recipe and loaded.selector.layers == found.selector.layers
    assert torch.equal(loaded.banks.banks[0].positions, found.banks.banks[0].positions)
    assert loaded.banks.size_normalize is False


@pytest.mark.slow
def test_the_default_call_measures_every_recipe_on_one_neutral_text(chat_tiny, monkeypatch):
    """Without a ``cost``, the recipes share one NeutralCost (its plain pass and greedy replies
    computed once), and each recipe's search measures its cost on it."""
    import hf_memory.recipes.persona as persona_module

    made = []

    class Counted(NeutralCost):
        def __post_init__(self):
            made.append(self)
            super().__post_init__()

    monkeypatch.setattr(persona_module, "NeutralCost", Counted)
    model, tokenizer = chat_tiny
    found = calibrate_persona(model, tokenizer, TEXT, PAIRS, top_layers=1, unit_search=False,
                              progress=False)
    assert sorted(t["recipe"] for t in found.trials) == ["contrast", "exemplars",
                                                         "prompt_like"]
    assert len(made) == 1 and made[0].evaluations >= 3


def test_the_screen_scores_the_full_searchs_single_layers_from_two_fifths_of_the_depth():
    from types import SimpleNamespace

    from hf_memory.recipes.persona import _screen_layers
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=30))
    assert _screen_layers(model, {}) == [12, 15, 18, 21, 24, 27]
    assert _screen_layers(model, {"layer_stride": 2}) == list(range(12, 30, 2))
    assert _screen_layers(model, {"candidate_layers": [20, 3, 25], "layer_stride": 1}) == [20,
                                                                                         25]
    assert _screen_layers(model, {"candidate_layers": [20, 3, 25]}) == [3]  # its only single
    # candidates all below two fifths: the screen scores them all
    assert _screen_layers(model, {"candidate_layers": [1, 2], "layer_stride": 1}) == [1, 2]


def test_the_screen_searches_only_the_recipe_whose_best_single_layer_scores_highest(chat_tiny):
    """Every recipe's best single layer on a coarse grid, on its own calibration pairs within
    the same ceilings; the best is searched fully and kept, the others recorded as screened
    out with their scores."""
    model, tokenizer = chat_tiny
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    found = calibrate_persona(model, tokenizer, TEXT, PAIRS, recipes=("prompt_like", "contrast"),
                              top_layers=1, unit_search=False, cost=cost, kv_ceiling=None,
                              capability_ceiling=None, judge=False, progress=False)
    kept, other = found.trials
    assert kept["recipe"] == found.recipe and "validation_target" in kept
    assert other["recipe"] != found.recipe and "screened out" in other["skipped"]
    assert kept["screened"] >= other["screened"]
    alone = calibrate_persona(model, tokenizer, TEXT, PAIRS, recipes=(found.recipe,),
                              top_layers=1, unit_search=False, cost=cost, kv_ceiling=None,
                              capability_ceiling=None, judge=False, progress=False)
    assert alone.selector.layers == found.selector.layers
    assert alone.selector.strength == found.selector.strength
    # the screen scored the kept recipe on its full search's pairs: that search read the
    # screen's single layers instead of scoring them again, to the bit
    assert found.selector.config["history"] == alone.selector.config["history"]
    assert found.selector.config["evaluations"] < alone.selector.config["evaluations"]
    assert found.banks.sink_reads_banks is False  # the default: the first token keeps off them
    reading = calibrate_persona(model, tokenizer, TEXT, PAIRS, recipes=(found.recipe,),
                                top_layers=1, unit_search=False, cost=cost, kv_ceiling=None,
                                capability_ceiling=None, judge=False, progress=False,
                                sink_reads_banks=True)
    assert reading.banks.sink_reads_banks is True
    assert reading.selector.config["bank_recipe"]["sink_reads_banks"] is True


def test_calibrate_persona_contrast_recipe_uses_the_held_back_pairs_and_round_trips(
        chat_tiny, tmp_path):
    model, tokenizer = chat_tiny
    found = calibrate_persona(model, tokenizer, TEXT, PAIRS, recipes=("contrast",),
                              top_layers=1, unit_search=False,
                              cost=NeutralCost(model, tokenizer, passages=PASSAGES),
                              kv_ceiling=None, capability_ceiling=None, progress=False)
    _, examples = split_pairs(PAIRS, 3)
    target, reference = found.banks.banks
    assert found.recipe == "contrast" and found.banks.contrast
    assert target.provenance["text"] == exemplar_text(TEXT, [t for _, t, _ in examples])
    assert reference.provenance["text"] == exemplar_text(TEXT, [r for _, _, r in examples])
    assert found.selector.config["bank_recipe"]["counter_exemplars"] == [
        r for _, _, r in examples]
    assert found.selector.config["search_pairs"] + 3 + found.trials[0]["validation_pairs"] == (
        len(PAIRS))
    loaded = PersonaSteering.from_pretrained(found.save_pretrained(tmp_path / "c"), model=model)
    assert loaded.banks.contrast and loaded.selector.layers == found.selector.layers


def test_persona_bad_input_is_one_clear_error(chat_tiny):
    model, tokenizer = chat_tiny
    with pytest.raises(ValueError, match="recipe must be one of"):
        persona_banks(model, tokenizer, TEXT, recipe="voice")
    with pytest.raises(ValueError, match="needs example replies"):
        persona_banks(model, tokenizer, TEXT, recipe="exemplars")
    with pytest.raises(ValueError, match="recipes must be among"):
        calibrate_persona(model, tokenizer, TEXT, PAIRS, recipes=["voice"])
    with pytest.raises(ValueError, match="always runs within a cost budget"):
        calibrate_persona(model, tokenizer, TEXT, PAIRS, cost_budget=None)
    with pytest.raises(ValueError, match="non-empty sequence"):
        calibrate_persona(model, tokenizer, TEXT, [])
    with pytest.raises(ValueError, match="at least 3 pairs"):
        calibrate_persona(model, tokenizer, TEXT, PAIRS[:2], recipes=["exemplars"])


@pytest.mark.slow
def test_build_persona_writes_what_the_demo_loads(chat_tiny, tmp_path, monkeypatch):
    from hf_memory.recipes import demo, shipped

    model, tokenizer = chat_tiny
    spec = shipped.persona_spec("pirate")
    assert len(spec["pairs"]) >= 20 and spec["lexicon"]
    # a 3-layer model's prompt holds too little KV for a quarter of it to hold a contrast bank
    found = shipped.build_persona(model, tokenizer, "pirate", out=tmp_path, progress=False,
                                  kv_ceiling=None)
    written = json.loads((tmp_path / "persona.json").read_text())
    assert written["recipe"] == found.recipe and written["text"] == spec["text"]
    assert set(written["caa"]) == {"layer", "scale"} and "pairs" not in written
    # the pirate is calibrated at the visible prompt's own cost, by the contrast recipe
    assert written["cost_budget"] == "prompt" and written["recipes"] == ["contrast"]
    prompt_cost = NeutralCost(model, tokenizer).measure(
        PromptMethod(spec["text"], tokenizer=tokenizer))
    assert written["budget"] == pytest.approx(prompt_cost, rel=1e-9, abs=1e-12)
    assert found.recipe == "contrast" and written["counter_exemplars"]
    # the voice band: the descriptor at the upper layers, judged on questions that are neither
    # the pairs' nor the demo's, within the prompt's budget and KV (its choice: test_voice_band)
    band = written["band"]
    asked = band_prompts(spec["pairs"])
    assert len(asked) == BAND_PROMPTS
    assert not set(asked) & ({p for p, _, _ in spec["pairs"]} | set(demo.DEFAULT_PROMPTS))
    if band is not None:
        assert band["layers"] == [1, 2] and band["cost"] <= written["budget"]
        assert band["kv_fraction"] <= 1.0 and band["prompts"] == len(asked)
    assert written["counter_exemplars"] == found.selector.config["bank_recipe"][
        "counter_exemplars"]
    monkeypatch.setattr(shipped, "_persona_dir", lambda name: tmp_path)
    banks, selector, caa, loaded = shipped.shipped_persona(model, tokenizer, "pirate")
    assert selector.layers == found.selector.layers
    # new calibrations keep the first token off the banks; a persona written before that
    # (no key) is rebuilt as it was calibrated
    assert written["sink_reads_banks"] is False and banks.sink_reads_banks is False
    (tmp_path / "persona.json").write_text(json.dumps(
        {k: v for k, v in written.items() if k != "sink_reads_banks"}))
    assert shipped.shipped_persona(model, tokenizer, "pirate")[0].sink_reads_banks is True
    (tmp_path / "persona.json").write_text(json.dumps(written))
    assert banks.banks[0].provenance["text"] == found.banks.banks[0].provenance["text"]
    assert (caa is None) == (written["caa"]["layer"] is None)
    result = demo.run_demo(model, tokenizer, prompts=["Hi?"], max_new_tokens=3)
    assert set(result.answers) == ({"plain", "prompt", "memory"} | ({"caa"} if caa else set())
                                   | ({"band"} if band else set()))
    assert all("persona_words" in q for q in result.quality.values())
    assert "persona words" in demo.format_demo(result)
    assert f"within {written['budget']:.3f}, the visible prompt's own cost" in \
        demo.format_demo(result)
    with pytest.raises(ValueError, match="non-negative number or 'prompt', got 'half'"):
        shipped.build_persona(model, tokenizer, "pirate", out=tmp_path, cost_budget="half")


def test_a_selector_folder_without_its_diagnostics_is_named(chat_tiny, tmp_path):
    from hf_memory.selection.selector import SelectorFormatError

    model, tokenizer = chat_tiny
    banks = persona_banks(model, tokenizer, TEXT, recipe="prompt_like")
    selector = Selector.calibrate_behavioural(model, tokenizer, banks, PAIRS, top_layers=1,
                                              gains=[1.0], cost_budget=None, progress=False)
    folder = selector.save_pretrained(tmp_path / "s")
    (folder / "diagnostics.safetensors").unlink()
    with pytest.raises(SelectorFormatError, match="lacks diagnostics.safetensors"):
        Selector.from_pretrained(folder)


def test_the_kv_ceiling_holds_every_trial_and_none_lifts_it(chat_tiny):
    """Every recipe's sites carry at most the ceiling's share of the text's KV as a prompt;
    the exemplar count shrinks to fit; a recipe that cannot fit at all is skipped by name."""
    model, tokenizer = chat_tiny
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    kwargs = dict(top_layers=2, unit_search=False, cost=cost, capability_ceiling=None,
                  progress=False, recipes=("prompt_like", "exemplars"), screen=False)
    capped = calibrate_persona(model, tokenizer, TEXT, PAIRS, kv_ceiling=1.0, **kwargs)
    prompt = capped.limits["prompt_kv_bytes"]
    assert capped.limits["kv_ceiling"] == int(prompt)
    tokens = len(tokenizer(TEXT, add_special_tokens=False).input_ids)
    config = model.config
    assert prompt == (tokens * config.num_hidden_layers * config.num_key_value_heads
                      * (config.hidden_size // config.num_attention_heads) * 2 * 4)
    for trial in capped.trials:
        if "skipped" in trial:
            assert "over the KV ceiling" in trial["skipped"]
            continue
        assert trial["kv_bytes"] <= capped.limits["kv_ceiling"]
        assert trial["kv_fraction"] == pytest.approx(trial["kv_bytes"] / prompt)
    assert capped.selector.config["kv_bytes"] <= capped.limits["kv_ceiling"]
    lifted = calibrate_persona(model, tokenizer, TEXT, PAIRS, kv_ceiling=None, **kwargs)
    assert lifted.limits["kv_ceiling"] is None
    assert max(t["kv_bytes"] for t in lifted.trials) > capped.limits["kv_ceiling"]
    with pytest.raises(ValueError, match="no recipe fits the KV ceiling.*raise kv_ceiling"):
        calibrate_persona(model, tokenizer, TEXT, PAIRS, kv_ceiling=0.01, **kwargs)


def test_the_capability_ceiling_is_the_prompts_own_cost_and_binds(chat_tiny):
    """``"prompt"``: the visible prompt's own cost on the factual answers plus the slack; a
    ceiling no setting can meet leaves the plain model (strength 0), a loose one changes
    nothing against no ceiling."""
    from hf_memory.metrics.factual import AnswerCost
    from hf_memory.recipes.persona import CAPABILITY_SLACK

    model, tokenizer = chat_tiny
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    kwargs = dict(top_layers=1, unit_search=False, cost=cost, kv_ceiling=None,
                  progress=False, recipes=("prompt_like",))
    found = calibrate_persona(model, tokenizer, TEXT, PAIRS, **kwargs)
    prompt_cost = AnswerCost(model, tokenizer).measure(PromptMethod(TEXT, tokenizer=tokenizer))
    assert found.limits["prompt_capability"] == pytest.approx(prompt_cost, abs=1e-9)
    assert found.limits["capability_ceiling"] == pytest.approx(
        max(prompt_cost, 0.0) + CAPABILITY_SLACK, abs=1e-9)
    assert found.trials[0]["capability"] <= found.limits["capability_ceiling"] or (
        found.selector.strength == 0)
    impossible = calibrate_persona(model, tokenizer, TEXT, PAIRS, capability_ceiling=-1e9,
                                   **kwargs)
    assert impossible.selector.strength == 0 and not impossible.selector.config["within_budget"]
    loose = calibrate_persona(model, tokenizer, TEXT, PAIRS, capability_ceiling=1e9, **kwargs)
    free = calibrate_persona(model, tokenizer, TEXT, PAIRS, capability_ceiling=None, **kwargs)
    assert loose.selector.layers == free.selector.layers
    assert loose.selector.strength == free.selector.strength


def test_ceilings_of_the_wrong_type_are_one_clear_error_each(chat_tiny):
    model, tokenizer = chat_tiny
    for bad in ("a quarter", True, float("nan"), [0.25]):
        with pytest.raises(ValueError, match="kv_ceiling must be a finite number"):
            calibrate_persona(model, tokenizer, TEXT, PAIRS, kv_ceiling=bad)
    with pytest.raises(ValueError, match="kv_ceiling is a fraction of the prompt's KV above 0"):
        calibrate_persona(model, tokenizer, TEXT, PAIRS, kv_ceiling=0)
    for bad in ("high", [1.0]):
        with pytest.raises(ValueError, match="capability_ceiling must be 'prompt'"):
            calibrate_persona(model, tokenizer, TEXT, PAIRS, capability_ceiling=bad)
    with pytest.raises(ValueError, match="capability_ceiling must be a finite number"):
        calibrate_persona(model, tokenizer, TEXT, PAIRS, capability_ceiling=float("inf"))


def test_one_progress_bar_over_the_whole_call_and_judged_replies(chat_tiny, capsys, tmp_path):
    """One bar from start to end (its total an upper bound, set to what ran at the end), no
    search bar of its own; the kept steering's replies judged beside plain and the prompt, by a
    judge fitted on the pairs, kept through save and load."""
    model, tokenizer = chat_tiny
    found = calibrate_persona(model, tokenizer, TEXT, PAIRS, recipes=("prompt_like",),
                              top_layers=1, unit_search=False, kv_ceiling=None,
                              capability_ceiling=None,
                              cost=NeutralCost(model, tokenizer, passages=PASSAGES))
    err = capsys.readouterr().err
    assert "persona calibration: prompt_like" in err and "budgeted site search" not in err
    last = [line for line in err.replace("\r", "\n").splitlines()
            if line.startswith("persona calibration")][-1]
    done = re.search(r"\| (\d+)/(\d+) \[", last)
    assert done and done[1] == done[2] and int(done[1]) >= len(found.selector.config["history"])
    judged = found.judged
    assert judged["judge"]["held_out_accuracy"] >= 0.8 and judged["prompts"] == 8
    assert set(judged["methods"]) == {"plain", "prompt", "memory"}
    for row in judged["methods"].values():
        assert 0 <= row["judge_score"] <= 1 and len(row["replies"]) == 8
    loaded = PersonaSteering.from_pretrained(found.save_pretrained(tmp_path / "j"), model=model)
    assert loaded.judged == json.loads(json.dumps(judged))


def test_pairs_a_judge_cannot_tell_apart_are_reported_not_judged(chat_tiny):
    from hf_memory.recipes.persona import judge_replies

    model, tokenizer = chat_tiny
    mixed = [(p, t, r) if i % 2 else (p, r, t) for i, (p, t, r) in enumerate(PAIRS)]
    judged = judge_replies(model, tokenizer, TEXT, mixed, PromptMethod(TEXT,
                                                                       tokenizer=tokenizer))
    assert "held-out accuracy" in judged["refused"] and "methods" not in judged
    assert judged["judge"]["held_out_accuracy"] < 0.8


def test_the_voice_band_is_kept_when_judged_higher_within_the_ceilings_and_round_trips(
        chat_tiny, tmp_path):
    """``voice=True``: the voice band's replies and the recipe's sites' are judged on the same
    questions; the higher replaces or keeps the sites, the band within the KV ceiling (fewer
    slots) and the budget, and a saved folder steers as the band was judged."""
    from hf_memory.chat.generation import chat_messages, encode_chats
    from hf_memory.metrics.kv_accounting import kv_footprint
    from hf_memory.recipes.voice_band import band_banks

    model, tokenizer = chat_tiny
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    kwargs = dict(recipes=("prompt_like",), top_layers=1, unit_search=False,
                  capability_ceiling=None, cost=cost, progress=False, judge=False)
    found = calibrate_persona(model, tokenizer, TEXT, PAIRS, kv_ceiling=0.25, voice=True,
                              voice_budget=10.0, **kwargs)
    band = found.voice
    assert band["budget"] == 10.0 and band["cost"] <= 10.0
    assert band["kept"] == (band["judged"] > band["sites_judged"])
    full = persona_banks(model, tokenizer, TEXT, recipe="prompt_like", sink_reads_banks=False)
    kept = band_banks(full, band["slots"])
    ids = tokenizer(TEXT, return_tensors="pt", add_special_tokens=False).input_ids
    footprint = kv_footprint(model, kept, ids, layers=band["layers"])
    assert band["slots"] is not None and band["kv_bytes"] == footprint.bank_bytes
    assert footprint.bank_bytes <= 0.25 * footprint.prompt_kv_bytes
    if band["kept"]:
        assert found.selector.config["objective"] == "voice_band"
        assert found.selector.layers == band["layers"] and found.recipe == "prompt_like"
        assert found.selector.config["kv_bytes"] == band["kv_bytes"]
        assert torch.equal(found.banks.banks[0].keys, kept.banks[0].keys)
    else:
        assert found.selector.config["objective"] == "behavioural_budgeted"
    loaded = PersonaSteering.from_pretrained(found.save_pretrained(tmp_path / "v"), model=model)
    assert loaded.voice == json.loads(json.dumps(band))
    question = encode_chats(tokenizer, [chat_messages("How was your day?")]).input_ids
    judged_as = (MemoryMethod(kept, layers=band["layers"],
                              layer_gains=dict.fromkeys(band["layers"], band["rho"]))
                 if band["kept"] else found.method())
    with judged_as.attach(model, question.shape[1]):
        expected = model(question).logits
    with loaded.method().attach(model, question.shape[1]):
        assert torch.equal(model(question).logits, expected)

    none_fits = calibrate_persona(model, tokenizer, TEXT, PAIRS, kv_ceiling=0.25, voice=True,
                                  voice_budget=-1.0, **kwargs)
    assert none_fits.voice["kept"] is False and "no band fits" in none_fits.voice["skipped"]
    assert none_fits.selector.config["objective"] == "behavioural_budgeted"
    mixed = [(p, t, r) if i % 2 else (p, r, t) for i, (p, t, r) in enumerate(PAIRS)]
    refused = calibrate_persona(model, tokenizer, TEXT, mixed, kv_ceiling=0.25, voice=True,
                                **kwargs)
    assert "held-out accuracy" in refused.voice["refused"]
    with pytest.raises(ValueError, match="voice_budget must be a finite number"):
        calibrate_persona(model, tokenizer, TEXT, PAIRS, voice=True, voice_budget="half",
                          **kwargs)


def test_a_kept_voice_band_saves_as_a_selector_that_steers_as_the_band(chat_tiny, tmp_path):
    """What ``calibrate_persona(voice=True)`` returns when the band wins: its pruned bank and a
    selector of every head at the band's ρ steer bit for bit as the band did when judged, and
    through a saved folder (its card names the band)."""
    from hf_memory.chat.generation import chat_messages, encode_chats
    from hf_memory.recipes.voice_band import band_banks, band_selector

    model, tokenizer = chat_tiny
    full = persona_banks(model, tokenizer, TEXT, recipe="prompt_like", sink_reads_banks=False)
    band = {"layers": [1, 2], "rho": 0.75, "cost": 0.01, "capability": None, "judged": 0.6,
            "kv_fraction": 0.2, "kv_bytes": 1024, "slots": [0, 2, 5], "kept": True}
    banks = band_banks(full, band["slots"])
    steering = PersonaSteering(banks, band_selector(model, TEXT, band), "prompt_like",
                               voice=band)
    loaded = PersonaSteering.from_pretrained(steering.save_pretrained(tmp_path / "b"),
                                             model=model)
    assert "a voice band" in (tmp_path / "b" / "selector" / "README.md").read_text()
    question = encode_chats(tokenizer, [chat_messages("How was your day?")]).input_ids
    outputs = []
    for method in (MemoryMethod(banks, layers=[1, 2], layer_gains={1: 0.75, 2: 0.75}),
                   steering.method(), loaded.method()):
        with method.attach(model, question.shape[1]):
            outputs.append(model(question).logits)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])
    assert not torch.equal(outputs[0], model(question).logits)
    assert loaded.banks.banks[0].provenance["slots_kept"] == [0, 2, 5]
