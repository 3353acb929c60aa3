"""Greedy decoding through transformers (with or without ``steer()``): what vLLM must reproduce."""

from __future__ import annotations

import contextlib

import torch

from hf_memory import steer

NEW_TOKENS = 12
TOLERANCE = 2e-4  # nats, per token: served log-probabilities against transformers'


def hf_greedy(model, prompt: list[int], steering: dict | None = None) -> tuple[list, list]:
    """Greedy tokens and their log-probs from transformers, steered with ``steer()`` or not."""
    ids = torch.tensor([prompt])
    with steer(model, **steering) if steering else contextlib.nullcontext():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == NEW_TOKENS  # no end of sequence inside the window
    logprobs = [torch.log_softmax(s[0].double(), -1)[t].item()
                for s, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


