"""Multi-turn chat that keeps one KV cache across turns and can change banks at any turn.

The transcript's tokens and their cache stay as they were; a bank change (the paper's dialogue
shift) only affects what is computed after it. Each turn feeds only the tokens the cache does not
hold yet: the chat template is rendered for the whole conversation, the longest prefix it shares
with the cached tokens is kept, and the cache is cropped to it if the template re-tokenised
anything (so the cache always matches the transcript exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from .bank_set import BankSet
from .banks import MemoryBank
from .steering import SteeringHandle, steer

__all__ = ["Conversation"]


class Conversation:
    """A chat with one model, one cache and optional memory banks.

    Args:
        banks: banks to steer with from the first turn (None: plain until :meth:`set_banks`).
        system: an optional system message.
        steering: keyword arguments for :func:`steer` (layers, units, selector, ...).
    """

    def __init__(self, model: nn.Module, tokenizer, *,
                 banks: BankSet | Sequence[MemoryBank] | None = None, system: str | None = None,
                 **steering: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.messages: list[dict[str, str]] = (
            [{"role": "system", "content": system}] if system else [])
        self.cache = DynamicCache(config=model.config)
        self.token_ids = torch.zeros(1, 0, dtype=torch.long)
        self._steering = steering
        self.handle: SteeringHandle | None = None
        if banks is not None:
            self.set_banks(banks)

    def set_banks(self, banks: BankSet | Sequence[MemoryBank] | None) -> None:
        """Use ``banks`` from the next token on (None: no steering); the cache is kept."""
        if banks is None:
            if self.handle is not None:
                self.handle.remove()
                self.handle = None
        elif self.handle is None:
            self.handle = steer(self.model, banks, **self._steering)
        else:
            self.handle.update(banks)

    def close(self) -> None:
        """Detach any steering from the model."""
        self.set_banks(None)

    @torch.no_grad()
    def say(self, text: str, *, max_new_tokens: int = 64, **generate_kwargs: Any) -> str:
        """Add a user turn, generate the assistant's reply (greedy by default), return it."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a turn needs a non-empty text")
        self.messages.append({"role": "user", "content": text})
        rendered = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True,
                                                      tokenize=False)
        ids = self.tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids
        shared = self._shared_prefix(ids)
        if shared < self.cache.get_seq_length():
            self.cache.crop(shared)
        device = next(self.model.parameters()).device
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        output = self.model.generate(
            input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device),
            past_key_values=self.cache, max_new_tokens=max_new_tokens, **generate_kwargs)
        self.token_ids = output.cpu()
        reply = self.tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).strip()
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    def _shared_prefix(self, ids: torch.Tensor) -> int:
        cached = self.token_ids[0, : self.cache.get_seq_length()]
        length = min(len(cached), ids.shape[1] - 1)
        same = (cached[:length] == ids[0, :length]).long()
        return int(same.cumprod(0).sum())
