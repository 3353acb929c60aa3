"""Steering methods behind one interface, so every evaluation can swap them (paper section 4).

A method says how a prompt is presented (``messages``) and what is attached to the model while
it generates (``attach``): plain (nothing), prompt (the guidance text in the visible context, as a
system message or prepended to the user turn), CAA (activation addition from the end of the
instruction on) and memory inception (banks at the selected sites).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

from hf_memory.banks.bank_set import BankSet
from hf_memory.baselines.caa import CAAVectors, apply_caa
from hf_memory.chat.generation import (
    chat_messages,
    default_system_prompt,
    encode_chats,
    generate_conversations,
)
from hf_memory.metrics.kv_accounting import prompt_kv_bytes
from hf_memory.steering.handle import SteeringHandle, steer

__all__ = ["CAAMethod", "MemoryMethod", "Method", "PlainMethod", "PromptMethod",
           "generate_with", "generate_with_each"]


class Method:
    """Plain generation; the base of every method."""

    name = "plain"
    shares_batches = True  # its rows can sit in one batch with other methods' (row_steering)

    def messages(self, prompt: str) -> list[dict[str, str]]:
        return chat_messages(prompt)

    def row_steering(self, model: nn.Module) -> SteeringHandle | None:
        """What steers this method's rows in a batch shared with other methods (an inactive
        handle, closed by the caller; None: nothing, the method lives in its messages)."""
        return None

    def attach(self, model: nn.Module, instruction_end: int) -> AbstractContextManager:
        """What to hold around generation; ``instruction_end``: where the user turn ends."""
        return nullcontext()

    def describe(self) -> dict[str, Any]:
        """What identifies this method in a results file."""
        return {"method": self.name}

    def guidance_kv_bytes(self, model: nn.Module, tokenizer, prompt: str) -> int:
        """Extra KV-cache bytes the method's guidance occupies for ``prompt`` (visible tokens)."""
        return 0


PlainMethod = Method


class PromptMethod(Method):
    """The guidance text in the visible context.

    Placements: ``"system"`` appends it to the system prompt the chat template would use anyway
    (SmolLM2's "You are a helpful AI assistant named SmolLM…"), so the only change against plain
    is the guidance; ``"replace_system"`` makes it the whole system message (the template's
    default is dropped: two changes at once); ``"prepend"`` puts it before the user's turn.
    """

    name = "prompt"
    PLACEMENTS = ("system", "replace_system", "prepend")

    def __init__(self, text: str, placement: str = "system", tokenizer=None) -> None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the prompt baseline needs a non-empty guidance text")
        if placement not in self.PLACEMENTS:
            raise ValueError(f"placement must be one of {self.PLACEMENTS}, got {placement!r}")
        if placement == "system" and tokenizer is None:
            raise ValueError("placement='system' needs the tokenizer (to read its default "
                             "system prompt)")
        self.text, self.placement = text, placement
        self.default_system = default_system_prompt(tokenizer) if tokenizer is not None else ""

    def messages(self, prompt: str) -> list[dict[str, str]]:
        if self.placement == "system":
            system = f"{self.default_system}\n{self.text}" if self.default_system else self.text
            return chat_messages(prompt, system=system)
        if self.placement == "replace_system":
            return chat_messages(prompt, system=self.text)
        return chat_messages(f"{self.text}\n\n{prompt}")

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "placement": self.placement, "text": self.text}

    def guidance_kv_bytes(self, model: nn.Module, tokenizer, prompt: str) -> int:
        with_text = encode_chats(tokenizer, [self.messages(prompt)]).input_ids
        without = encode_chats(tokenizer, [chat_messages(prompt)]).input_ids
        return prompt_kv_bytes(model, with_text) - prompt_kv_bytes(model, without)


class CAAMethod(Method):
    """Contrastive activation addition at every position after the user's instruction: the
    assistant's generation prompt and every generated token."""

    name = "caa"
    shares_batches = False  # the vector is added to the whole batch

    def __init__(self, vectors: CAAVectors, scale: float | None = None) -> None:
        self.vectors = vectors
        self.scale = vectors.scale if scale is None else float(scale)

    def attach(self, model: nn.Module, instruction_end: int) -> AbstractContextManager:
        return apply_caa(model, self.vectors, scale=self.scale, start_position=instruction_end)

    def describe(self) -> dict[str, Any]:
        return {"method": self.name, "layers": self.vectors.layers, "scale": self.scale,
                "site": self.vectors.site, "pairs_sha256": self.vectors.provenance.get(
                    "pairs_sha256")}


class MemoryMethod(Method):
    """Memory inception: banks at the selector's sites (or the sites given as ``steering``)."""

    name = "memory"

    def __init__(self, banks: BankSet, selector: Any = None, **steering: Any) -> None:
        self.banks, self.selector, self.steering = banks, selector, steering

    def attach(self, model: nn.Module, instruction_end: int) -> AbstractContextManager:
        return steer(model, self.banks, selector=self.selector, **self.steering)

    def row_steering(self, model: nn.Module) -> SteeringHandle:
        return steer(model, self.banks, selector=self.selector, active=False, **self.steering)

    def describe(self) -> dict[str, Any]:
        sites = ({str(k): v for k, v in self.selector.units.items()} if self.selector
                 else self.steering)
        return {"method": self.name, "banks": self.banks.audit(), "sites": sites,
                "unit_type": self.selector.unit_type if self.selector else None}


def generate_with(method: Method, model: nn.Module, tokenizer, prompts: Sequence[str],
                  **generate_kwargs: Any) -> list[str]:
    """Answer ``prompts`` (one left-padded batch) with ``method`` applied."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty sequence of strings")
    return generate_conversations(
        model, tokenizer, [method.messages(p) for p in prompts],
        attach=lambda end: method.attach(model, end), **generate_kwargs)


def generate_with_each(methods: Sequence[Method], model: nn.Module, tokenizer,
                       prompts: Sequence[str], *, batch_size: int | None = None,
                       **generate_kwargs: Any) -> list[list[str]]:
    """Answer ``prompts`` under every method: one list of replies per method, as
    :func:`generate_with` gives them. Plain, prompt and memory methods share left-padded batches
    of ``batch_size`` rows (all in one by default), each memory row under its own banks and
    sites (per-row steering); a method that cannot share (CAA) runs alone."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty sequence of strings")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    shared = [m for m in methods if m.shares_batches]
    replies: dict[int, list[str]] = {}
    handles = [m.row_steering(model) for m in shared]
    try:
        conversations = [m.messages(p) for m in shared for p in prompts]
        rows = [handle for handle in handles for _ in prompts]
        size = batch_size or len(conversations) or 1
        flat: list[str] = []
        for start in range(0, len(conversations), size):
            chunk = rows[start:start + size]
            steered = any(handle is not None for handle in chunk)
            flat += generate_conversations(
                model, tokenizer, conversations[start:start + size],
                attach=lambda _end, chunk=chunk, steered=steered: (
                    steer(model, chunk) if steered else nullcontext()), **generate_kwargs)
    finally:
        for handle in handles:
            if handle is not None:
                handle.remove()
    for k, method in enumerate(shared):
        replies[id(method)] = flat[k * len(prompts):(k + 1) * len(prompts)]
    for method in methods:
        if not method.shares_batches:
            size = batch_size or len(prompts)
            replies[id(method)] = [reply for start in range(0, len(prompts), size)
                                   for reply in generate_with(method, model, tokenizer,
                                                              prompts[start:start + size],
                                                              **generate_kwargs)]
    return [replies[id(method)] for method in methods]
