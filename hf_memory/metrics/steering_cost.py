"""What a steering method costs off-target: the change in per-token log-likelihood of neutral
text under the method against the plain model (> 0: the method makes ordinary text less likely).

Two kinds of neutral text, both scored as the assistant's turn (so a method that presents the
prompt differently, or attaches from the end of the instruction, is scored as it would run):

- **passages**: held-out neutral sentences as the reply to a fixed request;
- **the plain model's own replies** to neutral requests (greedy, computed once): what fluency
  means for a chat model, since a method that keeps the model fluent keeps these likely.

``cost = (Σ NLL_method − Σ NLL_plain) / tokens`` over both, in nats per token.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_memory.chat.generation import chat_messages, generate_chat
from hf_memory.data import load_json
from hf_memory.metrics.likelihood import reply_logprobs
from hf_memory.metrics.plain_states import PlainStates

__all__ = ["NeutralCost", "cost_texts", "neutral_sample"]


def cost_texts() -> dict[str, Any]:
    """The shipped calibration-side neutral text: ``request``, ``passages``, ``prompts``."""
    return load_json("cost_texts.json")


def neutral_sample(count: int | None) -> dict[str, list[str]]:
    """``NeutralCost`` keyword arguments for the first ``count`` shipped passages and prompts
    (None: every shipped one, the default): a cheaper, noisier cost for quick runs."""
    if count is None:
        return {}
    shipped = cost_texts()
    return {"passages": shipped["passages"][:count], "prompts": shipped["prompts"][:count]}


def _check_texts(name: str, texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise ValueError(f"{name} must be a sequence of non-empty strings")
    return list(texts)


@dataclass
class NeutralCost:
    """ΔNLL per token of neutral text under a method (module docstring).

    Args:
        passages: neutral sentences, each scored as the reply to ``request``.
        prompts: neutral requests; the plain model's greedy replies (``max_new_tokens``) to
            them are scored (empty replies are dropped). Default (both None): the shipped
            ``data/cost_texts.json``.

    Attributes:
        items: the scored ``(request, reply)`` pairs; ``replies``: the plain model's replies;
        tokens: the replies' token count; plain: their log-probabilities under plain;
        plain_states: the plain stream kept for them (memory steering's passes start at its
        lowest site, :mod:`~hf_memory.metrics.plain_states`).
    """

    model: nn.Module
    tokenizer: Any
    passages: Sequence[str] | None = None
    prompts: Sequence[str] | None = None
    request: str | None = None
    max_new_tokens: int = 32
    batch_size: int = 16
    evaluations: int = field(default=0, init=False)
    # measured from several threads at once (a search's probe threads)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def __post_init__(self) -> None:
        shipped = cost_texts()
        if self.passages is None and self.prompts is None:
            self.passages, self.prompts = shipped["passages"], shipped["prompts"]
        self.passages = _check_texts("passages", self.passages or [])
        self.prompts = _check_texts("prompts", self.prompts or [])
        self.request = self.request or shipped["request"]
        if not self.passages and not self.prompts:
            raise ValueError("the cost needs neutral text: give passages or prompts (or "
                             "neither, for the shipped ones)")
        replies = (generate_chat(self.model, self.tokenizer, self.prompts,
                                 max_new_tokens=self.max_new_tokens) if self.prompts else [])
        kept = [(p, r) for p, r in zip(self.prompts, replies, strict=True) if r.strip()]
        self.replies = [r for _, r in kept]
        self.items = ([(self.request, p) for p in self.passages]
                      + [(p, r) for p, r in kept])
        if not self.items:
            raise ValueError("the plain model's replies to the neutral prompts are all empty; "
                             "give neutral passages")
        self.tokens = sum(len(self.tokenizer(reply, add_special_tokens=False).input_ids)
                          for _, reply in self.items)
        # measured again and again at other sites: steered passes start at their lowest site
        self.plain_states = PlainStates(self.model)
        self.plain = self._logprobs(None)

    def _logprobs(self, method) -> torch.Tensor:
        conversations = [method.messages(prompt) if method is not None else chat_messages(prompt)
                         for prompt, _ in self.items]
        return reply_logprobs(self.model, self.tokenizer, conversations,
                              [reply for _, reply in self.items], method=method,
                              batch_size=self.batch_size, plain_states=self.plain_states)

    def measure(self, method) -> float:
        """Nats per token that ``method`` (anything with ``messages`` and ``attach``) adds to
        the neutral text's negative log-likelihood."""
        with self._lock:
            self.evaluations += 1
        return float((self.plain - self._logprobs(method)).sum()) / self.tokens
