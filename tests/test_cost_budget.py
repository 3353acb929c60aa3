"""Steering that keeps the model intact: the cost on neutral text, the budget rule, the budgeted
layer-and-unit search and a selector's calibrated strength (hand-computed cases, a tiny model
with the embedded model's tokenizer, bad input)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_memory import BankSet, MemoryMethod, PromptMethod, Selector, steer
from hf_memory.chat.generation import chat_messages
from hf_memory.metrics.likelihood import log_probabilities
from hf_memory.metrics.steering_cost import NeutralCost, cost_texts, neutral_sample
from hf_memory.selection.behavioural_search import ShiftObjective, best_strength
from hf_memory.selection.budget_search import BudgetSearch, DialProbes
from tests.test_memory_inception import random_bank
from tests.tiny_models import tiny_model

PASSAGES = ["The sky is blue today.", "Seven plus five is twelve."]
PAIRS = [("How are you?", "I worry a lot.", "I am calm."),
         ("Any plans?", "I fear the worst.", "I will relax.")]


@pytest.fixture(scope="module")
def chat_tiny(default_model):
    """A tiny random llama that reads the embedded model's tokenizer (its vocabulary)."""
    _, tokenizer = default_model
    return tiny_model("llama", vocab_size=len(tokenizer)), tokenizer


def banks(seed=1):
    return BankSet([random_bank("t", "target", 4, seed=seed)])


def reply_nll(model, tokenizer, request, reply):
    """Summed NLL of ``reply`` as the assistant's answer, from one unpadded full pass."""
    head = tokenizer.apply_chat_template(chat_messages(request), add_generation_prompt=True,
                                         tokenize=False)
    head_ids = tokenizer(head, add_special_tokens=False).input_ids
    reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
    ids = torch.tensor([head_ids + reply_ids])
    with torch.no_grad():
        logprobs = log_probabilities(model(input_ids=ids).logits)[0]
    n = len(reply_ids)
    picked = logprobs[len(head_ids) - 1:-1].gather(-1, ids[0, -n:, None])
    return -float(picked.sum()), n


def test_cost_is_the_per_token_nll_change_of_the_passages(chat_tiny):
    model, tokenizer = chat_tiny
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    request = cost_texts()["request"]
    assert cost.request == request and cost.replies == []
    plain = [reply_nll(model, tokenizer, request, p) for p in PASSAGES]
    with steer(model, banks(), layers=[0, 2]):
        steered = [reply_nll(model, tokenizer, request, p) for p in PASSAGES]
    tokens = sum(n for _, n in plain)
    expected = (sum(s for s, _ in steered) - sum(s for s, _ in plain)) / tokens
    assert cost.tokens == tokens
    assert cost.measure(MemoryMethod(banks(), layers=[0, 2])) == pytest.approx(expected,
                                                                               abs=1e-9)
    assert expected != 0.0
    # the dial's zero is the plain model bit for bit: no cost at all
    assert cost.measure(MemoryMethod(banks(), layers=[0, 2], strength=0.0)) == 0.0
    assert cost.evaluations == 2


def test_cost_scores_the_plain_models_own_replies_under_the_methods_messages(chat_tiny):
    model, tokenizer = chat_tiny
    cost = NeutralCost(model, tokenizer, prompts=["Name a fruit.", "Count to three."],
                       max_new_tokens=6)
    assert cost.passages == [] and 1 <= len(cost.replies) <= 2
    assert cost.measure(MemoryMethod(banks(), layers=[1], strength=0.0)) == 0.0
    # a visible prompt changes the conversation each reply is scored in
    prompt = PromptMethod("Be brief.", placement="prepend")
    items = cost.items
    assert [r for _, r in items] == cost.replies
    plain = sum(reply_nll(model, tokenizer, p, r)[0] for p, r in items)
    prompted = sum(reply_nll(model, tokenizer, f"Be brief.\n\n{p}", r)[0] for p, r in items)
    # left padding moves the rows' absolute positions, whose rotary angles the model computes
    # in float32: agreement to 1e-7 nats per token, not to float64 rounding
    assert cost.measure(prompt) == pytest.approx((prompted - plain) / cost.tokens, abs=1e-7)


def test_bad_neutral_text_is_one_clear_error(chat_tiny):
    model, tokenizer = chat_tiny
    with pytest.raises(ValueError, match="needs neutral text"):
        NeutralCost(model, tokenizer, passages=[], prompts=[])
    with pytest.raises(ValueError, match="non-empty strings"):
        NeutralCost(model, tokenizer, passages=["ok", "  "])
    with pytest.raises(ValueError, match="non-empty strings"):
        NeutralCost(model, tokenizer, passages="one string")


def test_cost_weight_enters_the_score_and_bad_weights_are_refused(chat_tiny):
    model, tokenizer = chat_tiny
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    objective = ShiftObjective(model, tokenizer, PAIRS, cost=cost, cost_weight=2.0)
    method = MemoryMethod(banks(), layers=[0, 2])
    row = objective.measure(method)
    assert row["cost"] == pytest.approx(cost.measure(method), abs=1e-12)
    assert row["score"] == pytest.approx(row["target"] - row["target_se"] - 2.0 * row["cost"])
    # a control at the same sites: the target is net of its movement, pair by pair
    control = MemoryMethod(banks(seed=5), layers=[0, 2])
    raw = objective.measure(method)["target"]
    presence = objective.measure(control)["target"]
    netted = objective.measure(method, control=control, cost=0.0)
    assert netted["presence"] == pytest.approx(presence, abs=1e-9)
    assert netted["target"] == pytest.approx(raw - presence, abs=1e-9)
    assert netted["cost"] == 0.0
    for name, value in (("cost_weight", -1.0), ("drift_weight", float("nan")),
                        ("uncertainty_weight", -0.5)):
        with pytest.raises(ValueError, match=f"{name} must be a finite number >= 0"):
            ShiftObjective(model, tokenizer, PAIRS, cost=cost, **{name: value})
    with pytest.raises(ValueError, match="needs a cost"):
        ShiftObjective(model, tokenizer, PAIRS, cost_weight=1.0)


class TableCost:
    """cost = strength² · Σ over steered layers of c[layer] · (steered units / all units)."""

    def __init__(self, per_layer, units=2):
        self.per_layer, self.units, self.calls = per_layer, units, 0

    def measure(self, method):
        self.calls += 1
        steering = method.steering
        return steering["strength"] ** 2 * sum(
            self.per_layer[layer] * len(units) / self.units
            for layer, units in steering["units"].items())


class TableObjective:
    """target = strength · Σ t[layer][unit] over steered units, minus the same sum of the
    control's table (presence); drift and se 0; score = target − cost."""

    def __init__(self, target, presence, cost):
        self.table, self.presence_table, self.cost = target, presence, cost
        self.calls = []

    def movement(self, table, method):
        steering = method.steering
        return steering["strength"] * sum(table[layer][u]
                                          for layer, units in steering["units"].items()
                                          for u in units)

    def measure(self, method, *, control=None, cost=None):
        assert control is not None and control.steering == method.steering
        self.calls.append((dict(method.steering["units"]), method.steering["strength"]))
        presence = self.movement(self.presence_table, control)
        target = self.movement(self.table, method) - presence
        return {"target": target, "target_se": 0.0, "drift": 0.0, "presence": presence,
                "cost": cost, "score": target - cost}


def test_budgeted_search_by_hand():
    # layer 0 breaks the model (any strength costs too much) and moves it most; layer 1 is
    # cheap; layer 2 moves the target but the neutral bank moves it as much (presence)
    cost = TableCost({0: 40.0, 1: 0.08, 2: 0.2})
    objective = TableObjective(target={0: [9.0, 9.0], 1: [1.0, -0.2], 2: [2.0, 2.0]},
                               presence={0: [0.0, 0.0], 1: [0.0, 0.0], 2: [2.0, 2.0]},
                               cost=cost)
    control = BankSet([random_bank("n", "target", 2, seed=9)])
    search = BudgetSearch(objective, banks(), 0.1, "kv_group", 2, control=control,
                          strengths=[0.25, 0.5, 1.0])
    best = search.run([0, 1, 2], top_layers=2, progress=False)
    singles = search.history[:3]
    # layer 0: even 0.25 costs 2.5 > 0.1 -> plain, score exactly 0, never measured
    assert (singles[0].strength, singles[0].score, singles[0].cost) == (0.0, 0.0, 0.0)
    # layer 1 fits at 1.0 (0.08): 0.8 − 0.08; layer 2 at 0.5 (0.05): net 0 − 0.05
    assert singles[1].strength == 1.0 and singles[1].score == pytest.approx(0.72)
    assert singles[2].strength == 0.5 and singles[2].score == pytest.approx(-0.05)
    assert singles[2].presence == pytest.approx(2.0)
    # greedy over the next best top_layers = 2 singles (1, 0): adding 0 prices it out (0.25
    # costs 2.5) -> 0; layer 2 is not tried. Units: dropping layer 1's first group leaves
    # −0.2; dropping its second (−0.2) moves +1.0 at 0.04 -> 0.96
    assert dict(best.units) == {1: (0,)} and best.strength == 1.0
    assert best.score == pytest.approx(1.0 - 0.04) and best.cost <= 0.1
    # no configuration of the history is over budget
    assert all(h.cost <= 0.1 for h in search.history)
    assert [h.layers for h in search.history] == [(0,), (1,), (2,), (0, 1), (1,), (1,)]
    # bisection over three grid points: two cost probes per single layer; none for (0, 1),
    # which contains layer 0 (nothing fits there); one for each unit removed from layer 1,
    # whose whole-layer setting (1.0) is checked and, the top of the dial, kept
    assert search.cost_probes == 2 + 2 + 2 + 0 + 1 + 1


def test_a_layer_stride_screens_every_kth_layer():
    cost = TableCost({layer: 0.01 for layer in range(5)})
    table = {layer: [float(layer), 0.0] for layer in range(5)}
    objective = TableObjective(table, {layer: [0.0, 0.0] for layer in range(5)}, cost)
    search = BudgetSearch(objective, banks(), 0.1, "kv_group", 2, control=banks(seed=3),
                          strengths=[1.0])
    best = search.run(range(5), top_layers=2, unit_search=False, layer_stride=2,
                      progress=False)
    singles = [h.layers for h in search.history[:3]]
    assert singles == [(0,), (2,), (4,)] and best.layers == (2, 4)
    assert all(1 not in h.layers and 3 not in h.layers for h in search.history)
    with pytest.raises(ValueError, match="layer_stride must be a positive integer"):
        search.run(range(5), top_layers=1, layer_stride=0, progress=False)


def test_budget_rule_and_bad_budgets():
    cost = TableCost({0: 1.0})
    objective = TableObjective({0: [1.0, 1.0]}, {0: [0.0, 0.0]}, cost)
    with pytest.raises(ValueError, match="cost_budget must be a finite number >= 0"):
        BudgetSearch(objective, banks(), -0.1, "head", 2)
    with pytest.raises(ValueError, match="strengths must be in"):
        BudgetSearch(objective, banks(), 0.1, "head", 2, strengths=[0.0, 0.5])
    objective.cost = None
    with pytest.raises(ValueError, match="needs an objective with a cost"):
        BudgetSearch(objective, banks(), 0.1, "head", 2)

    class ScaleObjective:
        cost = object()

        def measure(self, scale):
            return {"target": scale, "target_se": 0.0, "drift": 0.0, "score": scale,
                    "cost": scale / 10}

    # CAA's scale under the same rule: the best score among scales within budget
    scale, rows = best_strength(ScaleObjective(), lambda s: s, [1.0, 2.0, 4.0],
                                cost_budget=0.25)
    assert scale == 2.0 and len(rows) == 3
    assert best_strength(ScaleObjective(), lambda s: s, [4.0], cost_budget=0.25)[0] == 0.0
    # the default is budgeted (0.1): scale 4 costs 0.4 and is refused; None opts out
    assert best_strength(ScaleObjective(), lambda s: s, [0.5, 4.0])[0] == 0.5
    assert best_strength(ScaleObjective(), lambda s: s, [4.0], cost_budget=None)[0] == 4.0
    with pytest.raises(ValueError, match="cost_budget"):
        best_strength(ScaleObjective(), lambda s: s, [1.0], cost_budget=-1.0)


def test_budgeted_selector_on_a_tiny_model_is_within_budget_and_reproduces(chat_tiny, tmp_path):
    model, tokenizer = chat_tiny
    target = BankSet([random_bank("t", "target", 4, seed=1)])
    neutral = BankSet([random_bank("n", "target", 4, seed=2)])
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    # orient the pairs so that layer 0 at the weakest strength moves them (net of the neutral
    # bank), and set the budget just above its cost: a configuration worth steering fits
    weakest = dict(layers=[0], strength=0.25)
    objective = ShiftObjective(model, tokenizer, PAIRS, uncertainty_weight=0.0)
    net = objective.measure(MemoryMethod(target, **weakest),
                            control=MemoryMethod(neutral, **weakest))["target"]
    pairs = PAIRS if net > 0 else [(p, b, a) for p, a, b in PAIRS]
    budget = abs(cost.measure(MemoryMethod(target, **weakest))) + 1e-3
    selector = Selector.calibrate_behavioural(
        model, tokenizer, target, pairs, cost_budget=budget, cost=cost, control_banks=neutral,
        top_layers=2, strengths=[0.25, 0.5, 0.75, 1.0], uncertainty_weight=0.0, progress=False)
    best = selector.config["best"]
    assert selector.unit_type == "kv_group" and selector.config["within_budget"]
    assert 0 < selector.strength <= 1 and best["cost"] <= budget
    assert all(h["cost"] <= budget for h in selector.config["history"])
    # the frozen selector, applied by steer(), costs exactly what the search measured
    assert cost.measure(MemoryMethod(target, selector)) == pytest.approx(best["cost"],
                                                                         abs=1e-12)
    loaded = Selector.from_pretrained(selector.save_pretrained(tmp_path / "s"), model=model)
    assert loaded.strength == selector.strength and loaded.units == selector.units
    assert "cost-budgeted" in (tmp_path / "s" / "README.md").read_text()
    with pytest.raises(ValueError, match="cost_budget must be a finite number >= 0"):
        Selector.calibrate_behavioural(model, tokenizer, target, PAIRS, cost_budget=-1.0,
                                       cost=cost, progress=False)
    with pytest.raises(ValueError, match="cost_weight must be a finite number >= 0"):
        Selector.calibrate_behavioural(model, tokenizer, target, PAIRS, cost_weight=-2.0,
                                       cost=cost, progress=False)


def test_a_selectors_strength_is_the_dial_it_steers_at():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    selector = Selector(layers=[0, 2], units={0: [0], 2: [0, 1]}, unit_type="kv_group",
                        layer_gains={0: 1.0, 2: 1.0}, candidate_layers=[0, 1, 2], strength=0.5)
    sites = dict(layers=[0, 2], units={0: [0], 2: [0, 1]}, unit_type="kv_group")
    with steer(model, banks(), **sites, strength=0.5):
        half = model(ids).logits
    with steer(model, banks(), selector=selector):
        assert torch.equal(model(ids).logits, half)
    # the caller's dial scales the calibrated one
    with steer(model, banks(), **sites, strength=0.25):
        quarter = model(ids).logits
    with steer(model, banks(), selector=selector, strength=0.5):
        assert torch.equal(model(ids).logits, quarter)
    plain = model(ids).logits
    selector.strength = 0.0
    with steer(model, banks(), selector=selector):
        assert torch.equal(model(ids).logits, plain)


def test_a_saved_selector_with_a_bad_strength_is_refused(tmp_path):
    import json

    from hf_memory.selection.selector import SelectorFormatError

    selector = Selector(layers=[1], units={1: [0]}, unit_type="head", layer_gains={1: 1.0},
                        candidate_layers=[1], strength=0.5)
    path = selector.save_pretrained(tmp_path / "s")
    assert Selector.from_pretrained(path).strength == 0.5
    record = json.loads((path / "selector.json").read_text())
    for bad in (1.5, "strong"):
        record["strength"] = bad
        (path / "selector.json").write_text(json.dumps(record))
        with pytest.raises(SelectorFormatError, match="strength|malformed"):
            Selector.from_pretrained(path)
    del record["strength"]  # selectors saved before the dial existed run at full strength
    (path / "selector.json").write_text(json.dumps(record))
    assert Selector.from_pretrained(path).strength == 1.0


def test_content_slots_are_the_descriptor_slots_without_function_words(chat_tiny):
    from hf_memory import MemoryBank
    from hf_memory.banks.bank import FUNCTION_WORDS

    model, tokenizer = chat_tiny
    text = "I am extremely anxious, and I never feel calm."
    whole, content = (MemoryBank.from_text(model, tokenizer, text, template="{text}", keep=keep)
                      for keep in ("descriptor", "content"))
    (full,), (pruned,) = ([v["kept_positions"] for v in b.provenance["variants"]]
                          for b in (whole, content))
    assert set(pruned) < set(full)
    ids = whole.provenance["variants"][0]["token_ids"]
    dropped = [tokenizer.decode([ids[i]]).strip().lower() for i in full if i not in pruned]
    kept = [tokenizer.decode([ids[i]]).strip().lower() for i in pruned]
    assert dropped and all(w in FUNCTION_WORDS or not any(c.isalnum() for c in w)
                           for w in dropped)
    assert "never" in kept and "anxious" in "".join(kept)
    # the same forward pass: the content slots are the descriptor's slots at those positions
    rows = [full.index(i) for i in pruned]
    assert torch.equal(content.keys, whole.keys[:, :, rows])
    assert torch.equal(content.values, whole.values[:, :, rows])
    with pytest.raises(ValueError, match="keep must be one of"):
        MemoryBank.from_text(model, tokenizer, text, keep="nouns")


def test_a_neutral_sample_is_the_first_shipped_texts_and_its_size_is_checked():
    from eval_harness.directions import TraitSteeringConfig

    shipped = cost_texts()
    assert neutral_sample(None) == {}
    assert neutral_sample(2) == {"passages": shipped["passages"][:2],
                                 "prompts": shipped["prompts"][:2]}
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cost_texts must be a positive integer"):
            TraitSteeringConfig(cost_texts=bad)
    for bad in (1.0, -0.1, "0.3"):
        with pytest.raises(ValueError, match="validation must be a fraction"):
            TraitSteeringConfig(validation=bad)


def test_the_kv_ceiling_bounds_every_scored_configuration():
    """Bank bytes count every bank's slots at each steered KV head; the search scores nothing
    over the ceiling and reaches a layer whose whole bank would not fit through its first
    units."""
    cost = TableCost({layer: 0.01 for layer in range(3)})
    table = {0: [3.0, 1.0], 1: [2.0, 2.0], 2: [1.0, 1.0]}
    objective = TableObjective(table, {layer: [0.0, 0.0] for layer in range(3)}, cost)
    pair = BankSet([random_bank("t", "target", 4, seed=1), random_bank("r", "reference", 4,
                                                                        seed=2)])
    head = 2 * 4 * pair.banks[0].head_dim * 8 * 2  # two banks, 4 slots, float64 keys + values
    search = BudgetSearch(objective, pair, 0.1, "kv_group", 2, control=pair, strengths=[1.0],
                          kv_ceiling=3 * head)
    assert search.kv_bytes({0: (0, 1), 2: (1,)}) == 3 * head
    assert search.fitting(0) == (0, 1) and search.fitting(1, {0: (0, 1)}) == (0,)
    assert search.fitting(1, {0: (0, 1), 2: (0,)}) == ()
    with pytest.raises(ValueError, match="over the KV ceiling"):
        search.score({0: (0, 1), 1: (0, 1)})
    best = search.run(range(3), top_layers=3, unit_search=False, progress=False)
    assert all(search.kv_bytes(dict(h.units)) <= 3 * head for h in search.history)
    assert dict(best.units) == {0: (0, 1), 1: (0,)}
    lifted = BudgetSearch(objective, pair, 0.1, "kv_group", 2, control=pair, strengths=[1.0])
    assert dict(lifted.run(range(3), top_layers=3, unit_search=False,
                           progress=False).units) == {0: (0, 1), 1: (0, 1), 2: (0, 1)}
    with pytest.raises(ValueError, match="no candidate layer fits the KV ceiling"):
        BudgetSearch(objective, pair, 0.1, "kv_group", 2, control=pair, strengths=[1.0],
                     kv_ceiling=head - 1).run(range(3), top_layers=1, progress=False)
    with pytest.raises(ValueError, match="kv_ceiling must be a number of bytes"):
        BudgetSearch(objective, pair, 0.1, "kv_group", 2, kv_ceiling=0.25)


def test_a_capability_ceiling_narrows_the_dial_as_the_budget_does():
    cost = TableCost({0: 0.01})
    objective = TableObjective({0: [1.0, 1.0]}, {0: [0.0, 0.0]}, cost)
    capability = TableCost({0: 1.0})  # strength² nats per answer at layer 0, both units
    search = BudgetSearch(objective, banks(), 0.1, "kv_group", 2, control=banks(seed=3),
                          strengths=[0.25, 0.5, 1.0], capability=capability,
                          capability_ceiling=0.3)
    assert search.settings[search.strongest({0: (0, 1)})] == (0.5, 1.0)
    scored = search.score({0: (0, 1)})
    assert scored.strength == 0.5 and scored.capability == pytest.approx(0.25)
    calls = capability.calls  # a validation judge reuses the measured capability costs
    assert search.judged_by(objective).score({0: (0, 1)}).strength == 0.5
    assert capability.calls == calls
    with pytest.raises(ValueError, match="give both or neither"):
        BudgetSearch(objective, banks(), 0.1, "kv_group", 2, capability=capability)
    with pytest.raises(ValueError, match="capability_ceiling must be a finite number"):
        BudgetSearch(objective, banks(), 0.1, "kv_group", 2, capability=capability,
                     capability_ceiling=float("nan"))


def brute_strongest(search, units):
    """The largest dial index whose neutral cost and capability cost are both within the
    ceilings, every setting measured (the reference for the bounded, lazy bisection)."""
    fits = [i for i in range(len(search.settings))
            if search.objective.cost.measure(search._method(search.banks, units, i))
            <= search.cost_budget
            and (search.capability is None or search.capability.measure(
                search._method(search.banks, units, i)) <= search.capability_ceiling)]
    return max(fits, default=-1)


configurations = st.lists(st.dictionaries(st.integers(0, 2), st.sampled_from(
    [(0,), (1,), (0, 1)]), min_size=1, max_size=3), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3),
       capabilities=st.lists(st.floats(0.0, 2.0), min_size=3, max_size=3),
       ceiling=st.one_of(st.none(), st.floats(0.0, 1.0)), configs=configurations)
def test_the_bounded_lazy_bisection_finds_what_every_setting_measured_finds(
        costs, capabilities, ceiling, configs):
    """Costs that grow with the dial and with the sites (the search's assumption): whatever
    was searched before, each configuration's strongest setting is the reference's, and every
    setting it returns was measured within both ceilings."""
    cost = TableCost(dict(enumerate(costs)))
    capability = TableCost(dict(enumerate(capabilities))) if ceiling is not None else None
    objective = TableObjective({}, {}, cost)
    search = BudgetSearch(objective, banks(), 0.1, "kv_group", 2,
                          strengths=[0.25, 0.5, 0.75, 1.0], capability=capability,
                          capability_ceiling=ceiling)
    reference = BudgetSearch(objective, banks(), 0.1, "kv_group", 2,
                             strengths=[0.25, 0.5, 0.75, 1.0], capability=capability,
                             capability_ceiling=ceiling)
    for units in configs:
        found = search.strongest(units)
        assert found == brute_strongest(reference, units)
        if found >= 0:
            key = (tuple(sorted(units.items())), found)
            assert search._costs[key] <= 0.1
            assert capability is None or search._capability[key] <= ceiling


def test_the_neutral_cost_is_not_measured_where_the_capability_ceiling_refuses():
    cost = TableCost({0: 0.01})  # strength² · 0.01 nats per token: every setting fits 0.1
    capability = TableCost({0: 0.5})  # strength² · 0.5 per answer: 0.5 fits 0.2, 0.75 not
    search = BudgetSearch(TableObjective({}, {}, cost), banks(), 0.1, "kv_group", 2,
                          strengths=[0.25, 0.5, 0.75, 1.0], capability=capability,
                          capability_ceiling=0.2)
    assert search.settings[search.strongest({0: (0, 1)})] == (0.5, 1.0)
    # the bisection asks 0.5 (fits both), then 0.75 (refused by capability alone)
    assert capability.calls == 2 and cost.calls == 1


def test_a_bound_that_does_not_hold_is_not_trusted():
    """Where steering more sites costs less (against the search's assumption), the setting
    a larger configuration allowed is checked before it is used, and the search goes below it;
    what it returns is measured within budget."""

    class Shrinking(TableCost):
        def measure(self, method):
            self.calls += 1
            units = method.steering["units"]
            return method.steering["strength"] * (0.05 if len(units.get(0, ())) == 2 else 0.2)

    search = BudgetSearch(TableObjective({}, {}, Shrinking({})), banks(), 0.1, "kv_group", 2,
                          strengths=[0.25, 0.5, 1.0])
    assert search.settings[search.strongest({0: (0, 1)})] == (1.0, 1.0)
    assert search.settings[search.strongest({0: (0,)})] == (0.5, 1.0)
    assert search._costs[(((0, (0,)),), 1)] == pytest.approx(0.1)


def test_searches_that_share_dial_probes_measure_nothing_twice():
    """A screen (every 2nd layer alone) then the full search of the same banks: the full
    search measures no cost the screen measured, and finds what a search of its own finds."""
    cost = TableCost({layer: 0.02 * (layer + 1) for layer in range(5)})
    table = {layer: [float(layer), 1.0] for layer in range(5)}
    objective = TableObjective(table, {layer: [0.0, 0.0] for layer in range(5)}, cost)
    pair, control = banks(), banks(seed=3)

    def search(probes=None):
        return BudgetSearch(objective, pair, 0.1, "kv_group", 2, control=control,
                            strengths=[0.25, 0.5, 0.75, 1.0], probes=probes)

    probes = DialProbes()
    search(probes).run(range(5), top_layers=1, unit_search=False, layer_stride=2,
                       progress=False)
    screened = cost.calls

    def full(probes=None):
        before = cost.calls
        return search(probes).run(range(5), top_layers=2, progress=False), cost.calls - before

    (shared, shared_calls), (alone, alone_calls) = full(probes), full()
    assert (dict(shared.units), shared.strength) == (dict(alone.units), alone.strength)
    assert shared_calls == alone_calls - screened and screened > 0
    with pytest.raises(ValueError, match="measured for other banks"):
        BudgetSearch(objective, banks(seed=5), 0.1, "kv_group", 2, probes=probes)
    with pytest.raises(ValueError, match="measured for other banks"):
        BudgetSearch(objective, pair, 0.2, "kv_group", 2, probes=probes)


class KeyedObjective(TableObjective):
    """A table objective with a ``key``: searches sharing probes may share its scores."""

    def __init__(self, *args, key="pairs-a"):
        super().__init__(*args)
        self.key = key


def test_searches_with_one_objective_and_control_score_nothing_twice():
    """A screen (the upper layers alone) then the full search, sharing probes, the same
    objective key and the recipe control: the full search scores none of the screen's single
    layers again, and keeps what a search of its own keeps, every score equal. Another
    objective, or another control, shares costs but not scores."""
    cost = TableCost({layer: 0.02 * (layer + 1) for layer in range(5)})
    table = {layer: [float(layer % 3), 1.0] for layer in range(5)}
    presence = {layer: [0.1, 0.0] for layer in range(5)}
    pair, control = banks(), banks(seed=3)
    probes = DialProbes(recipe_control=control)

    def search(objective, probes=None, control=control):
        return BudgetSearch(objective, pair, 0.1, "kv_group", 2, control=control,
                            strengths=[0.25, 0.5, 0.75, 1.0], probes=probes)

    screen = KeyedObjective(table, presence, cost)
    search(screen, probes).run([2, 3, 4], top_layers=1, unit_search=False, progress=False)
    screened = {frozenset(units) for units, _ in screen.calls}
    shared, alone = KeyedObjective(table, presence, cost), KeyedObjective(table, presence, cost)
    found = search(shared, probes)
    best = found.run(range(5), top_layers=2, progress=False)
    fresh = search(alone)
    assert best == fresh.run(range(5), top_layers=2, progress=False)
    assert found.history == fresh.history  # every score, read or measured, the same
    scored = [frozenset(units) for units, _ in shared.calls]
    assert not screened & set(scored) and screened and len(scored) < len(alone.calls)
    other = KeyedObjective(table, presence, cost, key="pairs-b")
    search(other, probes).run([2, 3, 4], top_layers=1, unit_search=False, progress=False)
    unshared = KeyedObjective(table, presence, cost)
    search(unshared, probes, control=banks(seed=3)).run([2, 3, 4], top_layers=1,
                                                        unit_search=False, progress=False)
    assert len(other.calls) == len(unshared.calls) == len(screen.calls)


def test_a_search_measured_in_two_threads_is_the_search_one_at_a_time(chat_tiny):
    """Real passes of the tiny model (neutral text, factual answers, pairs with a control),
    single layers and greedy trials measured two at a time: the same history, to the bit,
    the same dial answers, and every probe of the one-thread search measured alike (a
    discarded greedy trial may add probes)."""
    from hf_memory.metrics.factual import AnswerCost

    model, tokenizer = chat_tiny
    target = BankSet([random_bank("t", "target", 4, seed=1)])
    neutral = BankSet([random_bank("n", "target", 4, seed=2)])
    cost = NeutralCost(model, tokenizer, passages=PASSAGES)
    capability = AnswerCost(model, tokenizer)
    runs = {}
    for workers in (1, 2):
        probes = DialProbes()
        selector = Selector.calibrate_behavioural(
            model, tokenizer, target, PAIRS, cost_budget=0.5, cost=cost, control_banks=neutral,
            top_layers=2, layer_stride=1, strengths=[0.25, 0.5, 0.75, 1.0], capability=capability,
            capability_ceiling=0.5, validation=0, probes=probes, workers=workers, progress=False)
        runs[workers] = (selector.config, probes)
    (serial, serial_probes), (threaded, threaded_probes) = runs[1], runs[2]
    assert len(serial["history"]) > 4  # single layers, then greedy trials
    assert threaded["history"] == serial["history"]
    assert threaded["best"] == serial["best"]
    assert threaded["evaluations"] >= serial["evaluations"]
    assert threaded["cost_probes"] >= serial["cost_probes"]
    assert serial_probes.costs.items() <= threaded_probes.costs.items()
    assert serial_probes.capability.items() <= threaded_probes.capability.items()
    assert threaded_probes.strongest == serial_probes.strongest
    with pytest.raises(ValueError, match="workers must be a thread count"):
        Selector.calibrate_behavioural(model, tokenizer, target, PAIRS, cost=cost, workers=0,
                                       progress=False)


def test_configurations_that_contain_one_another_are_scored_one_after_the_other():
    """A configuration's dial search starts from what the ones it contains found: score_each
    measures nested configurations in order, as score() one after another does."""
    def search():
        cost = TableCost({0: 0.04, 1: 0.04})
        return BudgetSearch(TableObjective({0: [1.0, 1.0], 1: [1.0, 1.0]},
                                           {0: [0.0, 0.0], 1: [0.0, 0.0]}, cost),
                            banks(), 0.1, "kv_group", 2, control=banks(seed=3),
                            strengths=[0.25, 0.5, 0.75, 1.0], workers=2)

    nested = [{0: (0,)}, {0: (0, 1)}, {0: (0, 1), 1: (0, 1)}]
    each, one_by_one = search(), search()
    assert each.score_each(nested) == [one_by_one.score(units) for units in nested]
    assert each.history == one_by_one.history
    assert each.objective.cost.calls == one_by_one.objective.cost.calls
    assert each.objective.calls == one_by_one.objective.calls  # in the same order


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.floats(-0.05, 0.2), min_size=4, max_size=4),
       targets=st.lists(st.lists(st.floats(-1.0, 2.0), min_size=2, max_size=2), min_size=4,
                        max_size=4),
       top_layers=st.integers(1, 4), unit_search=st.booleans())
def test_greedy_trials_two_at_a_time_are_the_search_one_at_a_time(costs, targets, top_layers,
                                                                    unit_search):
    """Any tables, costs that fall as sites are added included (where the dial's bounds
    from other configurations do not hold): the search at two threads, its greedy trials
    measured two at a time and discarded after a trial that wins, has the history, choice
    and dial answers of the search at one."""
    def search(workers):
        cost = TableCost(dict(enumerate(costs)))
        objective = TableObjective(dict(enumerate(targets)),
                                   {layer: [0.0, 0.0] for layer in range(4)}, cost)
        return BudgetSearch(objective, banks(), 0.1, "kv_group", 2, control=banks(seed=3),
                            strengths=[0.25, 0.5, 0.75, 1.0], workers=workers)

    one, two = search(1), search(2)
    chosen = one.run(range(4), top_layers=top_layers, unit_search=unit_search, progress=False)
    assert two.run(range(4), top_layers=top_layers, unit_search=unit_search,
                   progress=False) == chosen
    assert two.history == one.history
    assert two._strongest == one._strongest


def test_a_greedy_trial_after_one_that_wins_is_discarded_and_its_dial_answer_forgotten():
    """Removing KV group 0 wins; removing group 1, measured beside it against the same best,
    is discarded: the one-thread search never scores it, so its dial answer must not bound
    later searches (only its measured probes stay)."""
    def search(workers):
        cost = TableCost({0: 0.04, 1: 0.04})
        objective = TableObjective({0: [-0.5, 2.0], 1: [-1.0, -1.0]},
                                   {0: [0.0, 0.0], 1: [0.0, 0.0]}, cost)
        return BudgetSearch(objective, banks(), 0.1, "kv_group", 2, control=banks(seed=3),
                            strengths=[0.25, 0.5, 0.75, 1.0], workers=workers)

    one, two = search(1), search(2)
    assert one.run(range(2), top_layers=1, progress=False).units == ((0, (1,)),)
    assert two.run(range(2), top_layers=1, progress=False).units == ((0, (1,)),)
    assert two.history == one.history
    measured = {tuple(sorted((layer, tuple(u)) for layer, u in units.items()))
                for units, _ in two.objective.calls}
    assert ((0, (0,)),) in measured  # measured beside the winner ...
    assert ((0, (0,)),) not in one._strongest and two._strongest == one._strongest  # ... forgotten


def test_greedy_trials_that_contain_one_another_are_measured_one_at_a_time():
    """Moves whose trials nest (one's dial search would start from the other's answer) are
    not measured side by side, and no move is skipped for it."""
    moves = [{0: (0,)}, {0: (0, 1)}, {1: (0,)}, {0: (0, 1), 1: (1,)}]  # the first two nest

    def search(workers):
        cost = TableCost({0: 0.04, 1: 0.04})
        return BudgetSearch(TableObjective({0: [1.0, 0.5], 1: [-1.0, 3.0]},
                                           {0: [0.0, 0.0], 1: [0.0, 0.0]}, cost),
                            banks(), 0.1, "kv_group", 2, control=banks(seed=3),
                            strengths=[0.25, 0.5, 0.75, 1.0], workers=workers)

    one, two = search(1), search(2)
    start = one.score({1: (1,)})  # beaten by the last move only
    two.score({1: (1,)})
    chosen = one.greedy(start, moves, lambda best, units: units)
    assert chosen.units == ((0, (0, 1)), (1, (1,)))
    assert two.greedy(start, moves, lambda best, units: units) == chosen
    assert two.history == one.history and len(one.history) == 1 + len(moves)
    assert two._strongest == one._strongest
