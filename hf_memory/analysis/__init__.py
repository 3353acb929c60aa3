"""Feed-forward layers as key-value memories (Geva et al., 2021) for stock and our own models.

Key / value definitions per MLP kind: ``mlp_adapter``; sign conventions and the prefix
convention: ``corpus_pass`` and ``corpus``; the maths: README.md beside this file. Names are
imported lazily so that ``hf-memory --help`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FFNAdapter",
    "TokenizedCorpus",
    "analyze_ffn_memories",
    "capture_ffn",
    "ffn_adapter",
    "kjv_sentences",
    "logit_lens",
    "plot_all",
    "project_values",
    "run_corpus_pass",
    "tokenize_corpus",
    "top_tokens",
]

_HOME = {
    "FFNAdapter": "mlp_adapter",
    "ffn_adapter": "mlp_adapter",
    "TokenizedCorpus": "corpus",
    "kjv_sentences": "corpus",
    "tokenize_corpus": "corpus",
    "analyze_ffn_memories": "report",
    "capture_ffn": "capture",
    "logit_lens": "logit_lens",
    "top_tokens": "logit_lens",
    "plot_all": "plots",
    "project_values": "values",
    "run_corpus_pass": "corpus_pass",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
