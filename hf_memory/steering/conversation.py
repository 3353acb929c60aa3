"""Multi-turn chat that keeps one KV cache across turns and can change banks at any turn.

The transcript's tokens and their cache stay as they were; a bank change (the paper's dialogue
shift) only affects what is computed after it. Each turn feeds only the tokens the cache does not
hold yet: the chat template is rendered for the whole conversation, the longest prefix it shares
with the cached tokens is kept, and the cache is cropped to it if the template re-tokenised
anything (so the cache always matches the transcript exactly).

Besides generating (:meth:`Conversation.say`), a conversation can be teacher-forced
(:meth:`Conversation.add` a turn with a given reply) and can score candidate replies
(:meth:`Conversation.reply_logprobs`) without changing its transcript: what an evaluation of a
mid-conversation shift needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from hf_memory.banks.bank import MemoryBank
from hf_memory.banks.bank_set import BankSet
from hf_memory.metrics.likelihood import log_probabilities
from hf_memory.models.transformers_compat import cache_kwargs
from hf_memory.steering.handle import SteeringHandle, check_strength, steer

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
        # a full cache, also at sliding-window layers: candidates are scored and cropped off,
        # and a sliding layer's own cache cannot roll back past its window
        self.cache = DynamicCache()
        self.token_ids = torch.zeros(1, 0, dtype=torch.long)
        self._steering = steering
        self.handle: SteeringHandle | None = None
        self.computed_tokens = 0  # tokens run through the model (prefill, re-prefill, scoring)
        if banks is not None:
            self.set_banks(banks)

    def set_banks(self, banks: BankSet | Sequence[MemoryBank] | None, **steering: Any) -> None:
        """Use ``banks`` from the next token on (None: no steering); the cache is kept.
        ``steering``: new keyword arguments for :func:`steer` (e.g. the new banks' own
        ``selector``), replacing the ones given before; none: keep them."""
        if steering:
            self.set_banks(None)
            self._steering = steering
        if banks is None:
            if self.handle is not None:
                self.handle.remove()
                self.handle = None
        elif self.handle is None:
            self.handle = steer(self.model, banks, active=False, **self._steering)
        else:
            self.handle.update(banks)

    def set_strength(self, strength: float) -> None:
        """Turn the strength dial (:meth:`SteeringHandle.set_strength`) from the next token on,
        and for banks set later."""
        self._steering["strength"] = check_strength(strength)
        if self.handle is not None:
            self.handle.set_strength(strength)

    def set_system(self, system: str | None) -> None:
        """Replace (or remove) the system message; the cache is recomputed from the first token
        that changes on the next turn."""
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ValueError("a system message needs a non-empty text (None removes it)")
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if system is not None:
            self.messages.insert(0, {"role": "system", "content": system})

    def add(self, role: str, content: str) -> None:
        """Append a turn without generating (e.g. a given assistant reply)."""
        if role not in ("user", "assistant"):
            raise ValueError(f"role must be 'user' or 'assistant', got {role!r}")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"a {role} turn needs a non-empty text")
        self.messages.append({"role": role, "content": content})

    def close(self) -> None:
        """Detach any steering from the model."""
        self.set_banks(None)

    @torch.no_grad()
    def say(self, text: str, *, max_new_tokens: int = 64, **generate_kwargs: Any) -> str:
        """Add a user turn, generate the assistant's reply (greedy by default), return it."""
        self.add("user", text)
        ids = self._ids()
        shared = self._shared_prefix(ids)
        self._crop_to(shared)
        device = next(self.model.parameters()).device
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        with self._steered():
            output = self.model.generate(
                input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device),
                **cache_kwargs(self.cache), max_new_tokens=max_new_tokens, **generate_kwargs)
        self.computed_tokens += output.shape[1] - shared
        self.token_ids = output.cpu()
        reply = self.tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True).strip()
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    @torch.no_grad()
    def reply_logprobs(self, replies: Sequence[str]) -> list[float]:
        """Summed log-probability of each candidate as the assistant's answer to the last user
        turn, under whatever steering is attached now. The transcript is unchanged: the cache
        is extended over the conversation so far and each candidate is scored on top of it,
        then cropped away."""
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError("scoring replies needs a conversation that ends with a user turn")
        if isinstance(replies, str) or not replies:
            raise ValueError("give a non-empty list of candidate replies")
        encoded = [self.tokenizer(r, add_special_tokens=False).input_ids for r in replies]
        if any(not ids for ids in encoded):
            raise ValueError("a candidate reply encodes to no tokens")
        ids = self._ids()
        last = log_probabilities(self._extend(ids)[0, -1])
        head = ids.shape[1]
        scores = []
        for reply in encoded:
            total = float(last[reply[0]])
            if len(reply) > 1:
                logits = self._forward(torch.tensor([reply[:-1]]))
                picked = log_probabilities(logits[0]).gather(
                    -1, torch.tensor(reply[1:], device=logits.device)[:, None])
                total += float(picked.double().sum())
                self._crop_to(head)
            scores.append(total)
        return scores

    @torch.no_grad()
    def prefill(self) -> None:
        """Run the model over the transcript tokens the cache does not hold yet, under the
        steering attached now (e.g. before a bank swap, so that the turns so far are computed
        under the guidance they were given with)."""
        if not self.messages:
            return
        self._extend(self._ids(generation_prompt=False))

    def _ids(self, generation_prompt: bool = True) -> torch.Tensor:
        """The transcript's tokens ``[1, T]`` (with the assistant's generation prompt)."""
        rendered = self.tokenizer.apply_chat_template(
            self.messages, add_generation_prompt=generation_prompt, tokenize=False)
        return self.tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids

    def _forward(self, new: torch.Tensor) -> torch.Tensor:
        """Run ``new`` [1, T] on top of the cache; the logits of its positions."""
        device = next(self.model.parameters()).device
        total = self.cache.get_seq_length() + new.shape[1]
        self.computed_tokens += new.shape[1]
        with self._steered():
            return self.model(input_ids=new.to(device), **cache_kwargs(self.cache),
                              use_cache=True, attention_mask=torch.ones(
                                  1, total, dtype=torch.long, device=device)).logits

    def _steered(self) -> AbstractContextManager:
        """This conversation's steering, applied to its own calls only (in whatever thread
        runs them): the model stays plain for everyone else."""
        return self.handle.applied() if self.handle is not None else nullcontext()

    def _extend(self, ids: torch.Tensor) -> torch.Tensor:
        """Make the cache hold exactly ``ids`` (crop to the shared prefix, run the rest: at
        least the last token); the logits of the tokens run."""
        shared = self._shared_prefix(ids)
        self._crop_to(shared)
        logits = self._forward(ids[:, shared:])
        self.token_ids = ids
        return logits

    def _crop_to(self, length: int) -> None:
        """Keep the cache's first ``length`` tokens (transformers 5 crops by a negative count
        of tokens to remove)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)

    def _shared_prefix(self, ids: torch.Tensor) -> int:
        cached = self.token_ids[0, : self.cache.get_seq_length()]
        length = min(len(cached), ids.shape[1] - 1)
        same = (cached[:length] == ids[0, :length]).long()
        return int(same.cumprod(0).sum())
