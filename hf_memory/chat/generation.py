"""Batched chat-style generation with a stock tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["assistant_prefix_length", "chat_messages", "default_system_prompt", "encode_chats",
           "generate_chat", "generate_conversations"]


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn (with an optional system message) in the chat-template message format."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"a chat prompt must be a non-empty string, got {prompt!r}")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return messages


def default_system_prompt(tokenizer: PreTrainedTokenizerBase) -> str:
    """The system message the chat template inserts when a conversation gives none ("" if none).

    Read off the template: a conversation with a sentinel system message shows where system text
    goes; the same conversation without one shows what the template puts there by itself.
    """
    sentinel = "\x00system\x00"
    user = chat_messages("x")
    marked = tokenizer.apply_chat_template([{"role": "system", "content": sentinel}, *user],
                                           tokenize=False)
    plain = tokenizer.apply_chat_template(user, tokenize=False)
    before, _, after = marked.partition(sentinel)
    fits = plain.startswith(before) and plain.endswith(after)
    if not fits or len(plain) < len(before) + len(after):
        return ""
    return plain[len(before):len(plain) - len(after)]


def assistant_prefix_length(tokenizer: PreTrainedTokenizerBase) -> int:
    """Tokens the chat template's generation prompt adds after the last user turn.

    The instruction of a templated prompt of length P ends at P minus this.
    """
    messages = chat_messages("x")
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=False)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False,
                                            tokenize=False)
    count = len(tokenizer(with_prompt, add_special_tokens=False).input_ids)
    return count - len(tokenizer(without, add_special_tokens=False).input_ids)


def encode_chats(tokenizer: PreTrainedTokenizerBase,
                 conversations: Sequence[list[dict[str, str]]], *, answer_prefix: str = ""):
    """Chat-template each conversation (with the generation prompt, then ``answer_prefix`` as
    the start of the assistant's reply) into one left-padded batch."""
    if not conversations:
        raise ValueError("prompts is empty")
    if tokenizer.pad_token is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token before batching")
    texts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
             + answer_prefix for messages in conversations]
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

    ``attach(instruction_end)``, if given, returns a context manager held around ``generate()``
    (a steering method); ``instruction_end`` is the position where the (left-padded) user
    instruction ends and the assistant's generation prompt begins. Greedy by default.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    batch = encode_chats(tokenizer, conversations).to(model.device)
    prompt_length = batch["input_ids"].shape[1]
    generate_kwargs.setdefault("do_sample", False)
    generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    instruction_end = prompt_length - assistant_prefix_length(tokenizer)
    with attach(instruction_end) if attach is not None else nullcontext():
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
