"""A logits processor that lets only given tokens be generated (e.g. Likert digits 1–5 for
questionnaires)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import LogitsProcessor

__all__ = ["AllowedTokensProcessor"]


class AllowedTokensProcessor(LogitsProcessor):
    """Only the given token ids can be generated (all other logits set to −inf)."""

    def __init__(self, token_ids: Iterable[int]) -> None:
        self.token_ids = sorted({int(t) for t in token_ids})
        if not self.token_ids:
            raise ValueError("no allowed tokens")

    @classmethod
    def from_strings(cls, tokenizer, strings: Sequence[str]) -> AllowedTokensProcessor:
        """Allow exactly these strings, each of which must be a single token."""
        ids = []
        for text in strings:
            encoded = tokenizer(text, add_special_tokens=False).input_ids
            if len(encoded) != 1:
                raise ValueError(f"{text!r} is {len(encoded)} tokens for this tokenizer; "
                                 "allowed answers must be single tokens")
            ids.append(encoded[0])
        return cls(ids)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        allowed = torch.full_like(scores, float("-inf"))
        allowed[:, self.token_ids] = 0
        return scores + allowed
