"""Steered passes from the kept plain stream (``hf_memory.metrics.plain_states``): bit for bit the
full passes' scores on every family, the check that keeps a model's full passes where a pass from
a layer would differ, the searches' objective and cost, bad input."""

from __future__ import annotations

import pytest
import torch

from hf_memory import BankSet, CAAMethod, MemoryMethod
from hf_memory.baselines.caa import CAAVectors
from hf_memory.chat.generation import chat_messages
from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.metrics.plain_states import PlainStates
from hf_memory.metrics.steering_cost import NeutralCost
from hf_memory.selection.behavioural_search import ShiftObjective
from tests.test_memory_inception import random_bank
from tests.tiny_models import FAMILIES, tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

REQUESTS = ["Hi", "What is the capital of France?", "Name a colour.",
            "Tell me something about the sea and the ships on it.", "Why?"]
REPLIES = ["Hello there.", "Paris.", "Blue, like the sky on a clear day.", "It is wide.",
           "Because it rains a lot in that part of the country."]
# families whose forward runs a view of the upper layers exactly as the full model runs them;
# granite scales the input embeddings in its forward (inputs_embeds included), so a pass from a
# kept layer differs and the check keeps its full passes
FROM_A_LAYER = set(FAMILIES) - {"granite"}


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


def banks(contrast=False):
    if contrast:
        return BankSet([random_bank("t", "target", 4, seed=1),
                        random_bank("r", "reference", 3, seed=2)], contrast=True)
    return BankSet([random_bank("t", "target", 4, seed=1)])


def same(a, b):
    """Bit for bit, NaN where NaN (a stock model's padded batch may score a row NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def scores(model, tokenizer, **kwargs):
    return reply_logprobs(model, tokenizer, [chat_messages(r) for r in REQUESTS], REPLIES,
                          batch_size=2, **kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_steered_passes_from_a_kept_layer_are_the_full_passes(family, tokenizer):
    model = tiny_model(family, vocab_size=len(tokenizer))
    states = PlainStates(model)
    plain = scores(model, tokenizer, plain_states=states)
    assert same(plain, scores(model, tokenizer))  # recording changes no score
    assert states.recorded and states.layers == (1, 2)
    # the higher start first: its check runs plain, though the caller's steering is live
    for layers, contrast in (([2], False), ([1, 2], True), ([0, 2], False)):
        method = MemoryMethod(banks(contrast), layers=layers)
        full = scores(model, tokenizer, method=method)
        assert not same(full, plain)  # the banks move the replies
        assert same(scores(model, tokenizer, method=method, plain_states=states), full)
    expected = family in FROM_A_LAYER
    assert states.checked == {2: expected, 1: expected}
    # three batches of two rows, two methods whose lowest site is above layer 0
    assert states.reused == (6 if expected else 0)


def test_what_does_not_steer_by_sites_runs_the_whole_model(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    states = PlainStates(model)
    scores(model, tokenizer, plain_states=states)
    vectors = CAAVectors({2: torch.randn(model.config.hidden_size, dtype=torch.float64)},
                         scale=1.0)
    caa = CAAMethod(vectors)
    assert torch.equal(scores(model, tokenizer, method=caa, plain_states=states),
                       scores(model, tokenizer, method=caa))
    # rows that were not recorded (another reply) run whole as well
    method = MemoryMethod(banks(), layers=[2])
    other = reply_logprobs(model, tokenizer, [chat_messages("Hi")], ["Goodbye."],
                           method=method, plain_states=states)
    assert torch.equal(other, reply_logprobs(model, tokenizer, [chat_messages("Hi")],
                                             ["Goodbye."], method=method))
    assert states.reused == 0


def test_the_kept_layers_fit_max_bytes_and_bad_sizes_are_refused(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))
    rows = [[5] * 7, [6] * 3]
    one_layer = 10 * model.config.hidden_size * 8  # float64 stream of 10 positions
    assert PlainStates(model, max_bytes=2 * one_layer).plan(rows) == (1, 2)
    assert PlainStates(model, max_bytes=one_layer).plan(rows) == (2,)  # every second layer
    assert PlainStates(model, max_bytes=one_layer - 1).plan(rows) == ()
    states = PlainStates(model, max_bytes=0)
    scores(model, tokenizer, plain_states=states)
    assert states.recorded and states.layers == ()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            PlainStates(model, max_bytes=bad)


def test_the_searches_objective_and_cost_score_the_same_with_and_without(tokenizer):
    model = tiny_model("qwen2", vocab_size=len(tokenizer))
    pairs = [(q, a, b) for q, a, b in zip(REQUESTS, REPLIES, REPLIES[1:] + REPLIES[:1],
                                          strict=True)]
    cost = NeutralCost(model, tokenizer, passages=REPLIES[:3], batch_size=2)
    objective = ShiftObjective(model, tokenizer, pairs[:3], drift_pairs={"other": pairs[3:]},
                               batch_size=2, cost=cost)
    method, control = MemoryMethod(banks(), layers=[1, 2]), MemoryMethod(banks(True), layers=[1])
    kept = objective.measure(method, control=control)
    assert cost.plain_states.reused > 0 and objective.plain_states.reused > 0
    for holder in (cost, objective):  # the same measurement from full passes
        holder.plain_states = PlainStates(model, max_bytes=0)
    assert objective.measure(method, control=control) == kept
