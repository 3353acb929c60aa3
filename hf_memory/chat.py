"""Batched chat-style generation with a stock tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["chat_messages", "generate_chat"]


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn (with an optional system message) in the chat-template message format."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"a chat prompt must be a non-empty string, got {prompt!r}")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return messages


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
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if tokenizer.pad_token is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token before batching")
    texts = [
        tokenizer.apply_chat_template(
            chat_messages(p, system), add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    previous_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = previous_side
    batch = batch.to(model.device)
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    output = model.generate(**batch, max_new_tokens=max_new_tokens, **generate_kwargs)
    new_tokens = output[:, batch["input_ids"].shape[1]:]
    return [t.strip() for t in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
