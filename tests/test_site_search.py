"""The behavioural site search, the alignment-first diagnostic ordering, banks built in context,
the likelihood probe and the steering-shift metric: rules checked by hand on tiny inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eval_harness.metrics import load_metric
from hf_memory import BankSet, CAAVectors, MemoryBank, apply_caa
from hf_memory.banks.bank import render_in_context
from hf_memory.selection.attention_search import select_sites
from hf_memory.selection.behavioural_search import (
    SiteScore,
    best_strength,
    search_sites,
    summarize_shifts,
)
from tests.test_memory_inception import random_bank
from tests.tiny_models import tiny_model


class TableObjective:
    """A stand-in objective whose (target, drift) per configuration is a hand-written table:
    target adds per layer, drift is 0.1 per layer, and gain g scales target by g/2."""

    def __init__(self, per_layer):
        self.per_layer, self.calls = per_layer, []

    def measure(self, method):
        layers = method.steering["layers"]
        gain = next(iter(method.steering["layer_gains"].values()))
        self.calls.append((tuple(layers), gain))
        target = sum(self.per_layer[layer] for layer in layers) * gain / 2
        drift = 0.1 * len(layers)
        return {"target": target, "target_se": 0.0, "drift": drift, "score": target - drift}


def test_search_is_singles_then_greedy_then_gains():
    banks = BankSet([random_bank("t", "target", 3, layers=(0, 1, 2, 3))])
    objective = TableObjective({0: 1.0, 1: -2.0, 2: 3.0, 3: 0.05})
    best, history = search_sites(objective, banks, [0, 1, 2, 3], top_layers=3,
                                 gains=[1.0, 2.0], max_evaluations=20, progress=False)
    # singles at the largest gain (2): scores 0.9, -2.1, 2.9, -0.05 -> order 2, 0, 3, 1
    assert objective.calls[:4] == [((0,), 2.0), ((1,), 2.0), ((2,), 2.0), ((3,), 2.0)]
    # greedy from {2}: + 0 -> 3.8 (kept); + 3 -> 3.85 - 0.3 = 3.75 (rejected); + 1 -> rejected
    assert objective.calls[4:7] == [((0, 2), 2.0), ((0, 2, 3), 2.0), ((0, 1, 2), 2.0)]
    # then the chosen layers at the other gain: (1 + 3) * 0.5 - 0.2 = 1.8 < 3.8
    assert objective.calls[7:] == [((0, 2), 1.0)]
    assert best == SiteScore((0, 2), 2.0, 4.0, pytest.approx(0.2), pytest.approx(3.8))
    assert len(history) == len(objective.calls) == 8


def test_search_respects_the_layer_budget_and_rejects_bad_budgets():
    banks = BankSet([random_bank("t", "target", 3, layers=(0, 1, 2))])
    objective = TableObjective({0: 1.0, 1: 1.0, 2: 1.0})
    best, _ = search_sites(objective, banks, [0, 1, 2], top_layers=2, gains=[2.0],
                           max_evaluations=10, progress=False)
    assert best.layers == (0, 1)
    with pytest.raises(ValueError, match="max_evaluations must be at least 4"):
        search_sites(objective, banks, [0, 1, 2], top_layers=2, gains=[2.0],
                     max_evaluations=3, progress=False)
    with pytest.raises(ValueError, match="gains must be positive"):
        search_sites(objective, banks, [0, 1, 2], top_layers=2, gains=[0.0],
                     max_evaluations=10, progress=False)


def test_best_strength_picks_the_highest_score_and_the_smaller_strength_on_ties():
    class Objective:
        def measure(self, strength):
            return {"target": strength, "target_se": 0.0, "drift": abs(strength - 4),
                    "score": strength - abs(strength - 4)}

    strength, rows = best_strength(Objective(), lambda s: s, [1.0, 4.0, 8.0], cost_budget=None)
    assert strength == 4.0 and [r["score"] for r in rows] == [-2.0, 4.0, 4.0]


def test_shift_summary_is_mean_standard_error_and_mean_absolute_group_drift():
    # target pairs 1, 2, 6: mean 3, sample std sqrt(7), se sqrt(7/3); groups (-2, 0) and (4,)
    shift = torch.tensor([1.0, 2.0, 6.0, -2.0, 0.0, 4.0])
    target, se, drift = summarize_shifts(shift, [0, 3, 5, 6])
    assert target == pytest.approx(3.0)
    assert se == pytest.approx((7 / 3) ** 0.5)
    assert drift == pytest.approx((1.0 + 4.0) / 2)
    assert summarize_shifts(torch.tensor([2.5]), [0, 1]) == (2.5, 0.0, 0.0)


def test_alignment_first_ordering_uses_mass_only_to_break_ties():
    alignment = torch.tensor([[0.10, 0.00], [0.10, 0.00], [0.05, 0.30]])
    score = torch.tensor([[0.0, 9.0], [1.0, 0.0], [0.0, 0.0]])  # eq. 11 U, used for ties
    rows, units, _ = select_sites(alignment, top_units=1, top_layers=2, tie_break=score)
    # unit ranking by alignment: row 0 -> unit 0 (0.10 beats 0.00 despite U 9.0); row 2 -> 1
    # layer ranking: row 2 (0.30) first, then rows 0 and 1 tie at 0.10: row 1 wins on U
    assert rows == [2, 1] and units == {2: [1], 1: [0]}


def test_banks_in_context_never_keep_position_zero():
    class Tokenizer:
        """Characters as tokens; a chat template that puts the system text after a header."""

        bos_token, chat_template = "^", "x"

        def apply_chat_template(self, messages, tokenize=False):
            return "".join(f"<{m['role']}>{m['content']}|" for m in messages)

        def __call__(self, text, return_offsets_mapping=False, add_special_tokens=False):
            return {"input_ids": [1 + ord(c) % 90 for c in text],
                    "offset_mapping": [(i, i + 1) for i in range(len(text))]}

    model = tiny_model("llama")
    tokenizer = Tokenizer()
    assert render_in_context(tokenizer, "ab", "system") == ("<system>ab|", 8)
    assert render_in_context(tokenizer, "ab", "bos") == ("^ab", 1)
    bank = MemoryBank.from_text(model, tokenizer, "hey", template="{text}!", context="system",
                                layers=[0, 2])
    (variant,) = bank.provenance["variants"]
    assert variant["kept_positions"] == [8, 9, 10] and variant["context"] == "system"
    bare = MemoryBank.from_text(model, tokenizer, "hey", template="{text}", context="none",
                                layers=[0])
    assert bare.provenance["variants"][0]["kept_positions"] == [1, 2]  # position 0 dropped
    whole = MemoryBank.from_text(model, tokenizer, "hey", template="[{text}]", keep="all",
                                 context="bos", layers=[0])
    assert whole.provenance["variants"][0]["kept_positions"] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="context must be one of"):
        MemoryBank.from_text(model, tokenizer, "hey", context="assistant")
    tokenizer.bos_token = None
    with pytest.raises(ValueError, match="BOS token"):
        MemoryBank.from_text(model, tokenizer, "hey", context="bos")


def test_caa_start_positions_per_row():
    model = tiny_model("llama")
    vectors = CAAVectors({1: torch.ones(64, dtype=torch.float64)}, scale=1.0)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    with apply_caa(model, vectors, start_position=torch.tensor([2, 4])):
        both = model(ids).logits
    for row, start in enumerate((2, 4)):
        with apply_caa(model, vectors, start_position=start):
            torch.testing.assert_close(model(ids[row:row + 1]).logits[0], both[row])
    with pytest.raises(ValueError, match="non-negative"):
        apply_caa(model, vectors, start_position=-1)


def test_steering_shift_metric_against_a_slow_loop():
    rng = np.random.default_rng(0)
    traits = ["O"] * 4 + ["N"] * 6
    keys = [1, 1, -1, 1, 1, -1, -1, -1, 1, -1]
    plain = rng.normal(3, 1, 10)
    steered = plain + rng.normal(0.5, 1, 10)

    def trait_score(values, trait):
        agree = [v for v, t, k in zip(values, traits, keys, strict=True) if t == trait and k == 1]
        reverse = [v for v, t, k in zip(values, traits, keys, strict=True)
                   if t == trait and k == -1]
        return (np.mean(agree) - np.mean(reverse)) / 2

    delta = {t: trait_score(steered, t) - trait_score(plain, t) for t in ("O", "N")}
    result = load_metric("steering_shift").compute(
        predictions=steered.tolist(), references=plain.tolist(), traits=traits, keys=keys,
        target="N", direction=-1, num_bootstrap=200, seed=3)
    assert result["target_shift"] == pytest.approx(-delta["N"])
    assert result["drift"] == pytest.approx(abs(delta["O"]))
    assert result["das"] == pytest.approx(-delta["N"] - abs(delta["O"]))
    for name in ("target_shift", "drift", "das"):
        low, high = result[f"{name}_ci"]
        assert low <= high
    with pytest.raises(ValueError, match="target"):
        load_metric("steering_shift").compute(predictions=[1.0, 2.0], references=[1.0, 2.0],
                                              traits=["O", "N"], target="X")
