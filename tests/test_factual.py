"""Capability on answers a steering should not touch: the shipped factual set (each answer the
embedded model gives when plain, both halves), the answer matcher, the per-answer cost against
a hand computation, and bad items."""

from __future__ import annotations

import pytest
import torch

from hf_memory.baselines.methods import PlainMethod, PromptMethod
from hf_memory.chat.generation import chat_messages
from hf_memory.metrics.factual import AnswerCost, answer_found, exact_match, factual_items
from hf_memory.metrics.likelihood import reply_logprobs
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def chat_tiny(default_model):
    _, tokenizer = default_model
    return tiny_model("llama", vocab_size=len(tokenizer), dtype=torch.float32), tokenizer


def test_the_halves_are_disjoint_and_cover_the_set():
    search, report, every = (factual_items(s) for s in ("search", "report", "all"))
    assert search + report == every and len(search) >= 12 and len(report) >= 12
    assert not {i["question"] for i in search} & {i["question"] for i in report}
    for item in every:  # each reply states its answer
        assert answer_found(item["answer"], item["reply"]), item
    with pytest.raises(ValueError, match="split must be one of"):
        factual_items("train")


@pytest.mark.parametrize(("answer", "reply", "found"), [
    ("7", "There are 7 days in a week.", True),
    ("7", "There are 17 days.", False),
    ("7", "It is 70.", False),
    ("0", "The freezing point is -10.", False),
    ("Leonardo da Vinci", "It was painted by leonardo  da vinci, of course.", True),
    ("Leonardo da Vinci", "Leonardo painted it.", False),
    ("H2O", "The symbol is H2O.", True),
])
def test_an_answer_is_found_as_whole_words(answer, reply, found):
    assert answer_found(answer, reply) is found


def test_the_cost_is_the_mean_answer_nll_change(chat_tiny):
    model, tokenizer = chat_tiny
    items = factual_items("search")[:4]
    cost = AnswerCost(model, tokenizer, items=items, batch_size=3)
    method = PromptMethod("Talk like a pirate.", tokenizer=tokenizer)
    by_hand = [float(reply_logprobs(model, tokenizer, [chat_messages(i["question"])],
                                    [i["reply"]])[0])
               - float(reply_logprobs(model, tokenizer, [method.messages(i["question"])],
                                      [i["reply"]])[0]) for i in items]
    assert cost.measure(method) == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-4)
    assert cost.measure(PlainMethod()) == pytest.approx(0.0, abs=1e-5)
    assert cost.evaluations == 2


def test_bad_items_are_one_clear_error(chat_tiny):
    model, tokenizer = chat_tiny
    for bad in ([], "Paris", [{"question": "Capital of France?", "answer": "Paris"}],
                [{"question": "Q?", "answer": " ", "reply": "R."}], [("Q?", "A", "R.")]):
        with pytest.raises(ValueError, match="factual item"):
            AnswerCost(model, tokenizer, items=bad)
    with pytest.raises(ValueError, match="has no words"):
        answer_found("?!", "anything")


@pytest.mark.slow
def test_the_plain_embedded_model_answers_every_shipped_item(default_model):
    """The set's promise: the plain model knows each answer, so a steering's exact match below 1
    is what the steering took away."""
    model, tokenizer = default_model
    items = factual_items("all")
    result = exact_match(model, tokenizer, PlainMethod(), items)
    missed = [(i["answer"], r) for i, r in zip(items, result["replies"], strict=True)
              if not answer_found(i["answer"], r)]
    assert result["exact_match"] == 1.0 and result["items"] == len(items), missed
