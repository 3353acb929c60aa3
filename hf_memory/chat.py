"""Batched chat-style generation with a stock tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["chat_messages", "encode_chats", "generate_chat", "generate_conversations"]


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn (with an optional system message) in the chat-template message format."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"a chat prompt must be a non-empty string, got {prompt!r}")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return messages


def encode_chats(tokenizer: PreTrainedTokenizerBase,
                 conversations: Sequence[list[dict[str, str]]]):
    """Chat-template each conversation (with the generation prompt) into one left-padded batch."""
    if not conversations:
        raise ValueError("prompts is empty")
    if tokenizer.pad_token is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token before batching")
    texts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
             for messages in conversations]
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = previous_side


def generate_conversations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[list[dict[str, str]]],
    *,
    max_new_tokens: int = 64,
    attach: Callable[[int], AbstractContextManager] | None = None,
    **generate_kwargs: Any,
) -> list[str]:
    """Continue each conversation as the assistant; all run as one left-padded batch.

    ``attach(prompt_length)``, if given, returns a context manager held around ``generate()``
    (a steering method); ``prompt_length`` is the padded prompt length. Greedy by default.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    batch = encode_chats(tokenizer, conversations).to(model.device)
    prompt_length = batch["input_ids"].shape[1]
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    with attach(prompt_length) if attach is not None else nullcontext():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, **generate_kwargs)
    new_tokens = output[:, prompt_length:]
    return [t.strip() for t in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def generate_chat(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    *,
    system: str | None = None,
    max_new_tokens: int = 64,
    **generate_kwargs: Any,
) -> list[str]:
    """Answer each prompt as a single user turn; all prompts run as one left-padded batch.

    Greedy by default (pass ``do_sample=True`` etc. through ``generate_kwargs``). Returns the
    decoded continuations without special tokens, in the order of ``prompts``.
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of strings, not a single string")
    if not prompts:
        raise ValueError("prompts is empty")
    return generate_conversations(model, tokenizer, [chat_messages(p, system) for p in prompts],
                                  max_new_tokens=max_new_tokens, **generate_kwargs)
