"""What a steering costs on answers it should not touch: short factual questions.

The neutral-text cost (:mod:`~hf_memory.metrics.steering_cost`) charges what a steering does to
ordinary text, and a steering can stay inside it while it talks the model out of facts it knows
(the factual answers are a handful of tokens in a long neutral text). The shipped set
(``data/factual_answers.json``) holds short questions the embedded model answers correctly when
plain, each with a one-sentence reply and the answer's key words, in two halves: ``search``
charges a calibration (:class:`AnswerCost` as the search's capability ceiling), ``report`` is
held out for reporting (:func:`exact_match` beside :class:`AnswerCost`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_memory.chat.generation import chat_messages, generate_conversations
from hf_memory.data import load_json
from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.metrics.plain_states import PlainStates

__all__ = ["SPLITS", "AnswerCost", "answer_found", "exact_match", "factual_items"]

SPLITS = ("search", "report", "all")


def factual_items(split: str = "search") -> list[dict[str, str]]:
    """The shipped factual items (``question``, ``answer``, ``reply``) of ``split``: the first
    half (``search``), the second (``report``) or ``all``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    items = load_json("factual_answers.json")["items"]
    half = len(items) // 2
    return list(items[:half] if split == "search" else items[half:] if split == "report"
                else items)


def _checked(items: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    if isinstance(items, str | dict) or not items:
        raise ValueError("factual items must be a non-empty sequence of {question, answer, "
                         "reply} records")
    for item in items:
        if not isinstance(item, dict) or not all(
                isinstance(item.get(k), str) and item[k].strip()
                for k in ("question", "answer", "reply")):
            raise ValueError("a factual item is {'question': str, 'answer': str, 'reply': str}, "
                             f"each non-empty; got {item!r}")
    return list(items)


@dataclass
class AnswerCost:
    """Nats per answer that a method takes from the factual replies' log-probability against
    the plain model (> 0: the method makes the right answers less likely).

    ``items`` default to the shipped ``split``; the plain model's log-probabilities are taken
    once (and its residual stream kept, so memory steering's passes start at its lowest site).
    """

    model: nn.Module
    tokenizer: Any
    items: Sequence[dict[str, str]] | None = None
    split: str = "search"
    batch_size: int = 16
    evaluations: int = field(default=0, init=False)
    # measured from several threads at once (a search's probe threads)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def __post_init__(self) -> None:
        self.items = _checked(factual_items(self.split) if self.items is None else self.items)
        self.plain_states = PlainStates(self.model)
        self.plain = self._logprobs(None)

    def _logprobs(self, method) -> torch.Tensor:
        conversations = [method.messages(i["question"]) if method is not None
                         else chat_messages(i["question"]) for i in self.items]
        return reply_logprobs(self.model, self.tokenizer, conversations,
                              [i["reply"] for i in self.items], method=method,
                              batch_size=self.batch_size, plain_states=self.plain_states)

    def measure(self, method) -> float:
        """Mean over the items of log p_plain(reply) − log p_method(reply), nats."""
        with self._lock:
            self.evaluations += 1
        return float((self.plain - self._logprobs(method)).mean())


def answer_found(answer: str, reply: str) -> bool:
    """Whether ``answer``'s words occur in ``reply`` as whole words, in order, any case
    (``"7"`` is found in "There are 7 days" and not in "-17" or "70")."""
    words = re.findall(r"\w+", answer.lower())
    if not words:
        raise ValueError(f"the answer {answer!r} has no words")
    pattern = r"(?<![\w-])" + r"\W+".join(map(re.escape, words)) + r"(?!\w)"
    return re.search(pattern, reply.lower()) is not None


def exact_match(model: nn.Module, tokenizer, method, items: Sequence[dict[str, str]] | None = None,
                *, max_new_tokens: int = 16) -> dict[str, Any]:
    """Greedy replies of ``method`` (a :class:`~hf_memory.baselines.methods.Method`) to the
    factual questions (default: the ``report`` half) and the share that contain the answer
    (:func:`answer_found`); ``{"exact_match", "items", "replies"}``."""
    items = _checked(factual_items("report") if items is None else items)
    replies = generate_conversations(model, tokenizer,
                                     [method.messages(i["question"]) for i in items],
                                     attach=lambda end: method.attach(model, end),
                                     max_new_tokens=max_new_tokens)
    hits = [answer_found(i["answer"], r) for i, r in zip(items, replies, strict=True)]
    return {"exact_match": sum(hits) / len(hits), "items": len(items), "replies": replies}
