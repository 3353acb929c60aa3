"""Memory inception on stock Llama / Qwen models, and memory analysis tools.

Heavy dependencies (torch, transformers) are imported on first use, so ``hf-memory --help``
stays fast.
"""

from __future__ import annotations

import importlib.metadata as _metadata

from .chat import chat_messages, generate_chat
from .default_model import (
    DEFAULT_MODEL_ID,
    DefaultModelUnavailableError,
    ensure_default_model_cached,
    load_default_model,
)

try:
    __version__ = _metadata.version("hf-memory")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "DEFAULT_MODEL_ID",
    "DefaultModelUnavailableError",
    "__version__",
    "chat_messages",
    "ensure_default_model_cached",
    "generate_chat",
    "load_default_model",
]
