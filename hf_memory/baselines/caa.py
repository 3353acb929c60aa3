"""Contrastive activation addition (CAA), the residual-steering baseline of the paper (section 4).

Extraction: run each (positive, negative) text pair through the frozen model and record the
residual stream right after attention at layer ℓ — h + Attn(h), the input of
``post_attention_layernorm`` (h + Norm(Attn(h)) in the post-norm OLMo-2 and Gemma, the input of
the next module: see the adapters) — averaged over the text's tokens (or its last token). The
vector is the mean of positive minus negative over pairs.

Application: ``scale · v`` is added to what joins the residual stream after attention at layer ℓ
(the attention output, or the norm on it in a post-norm layer — so the stream read at extraction
moves by exactly ``scale · v``) at every position from
``start_position`` on (one for the batch, or one per row), generated tokens included. Positions
count from the start of the cached sequence, so a prompt of length P with ``start_position=P``
steers the generated tokens only.

A second site, ``site="block_output"``, reads and writes the residual stream at the output of
decoder layer ℓ (after its feed-forward block): the site llama.cpp's control vectors and repeng
use, so vectors at that site travel to llama.cpp (:mod:`hf_memory.baselines.caa_gguf`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import warnings
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hf_memory.artifacts.atomic_files import write_json, write_safetensors, write_text
from hf_memory.baselines.caa_gguf import (
    ControlVectorFormatError,
    read_control_vector,
    write_control_vector,
)
from hf_memory.models.adapters import get_adapter
from hf_memory.models.fingerprint import (
    FingerprintMismatchError,
    check_fingerprint,
    model_fingerprint,
)
from hf_memory.models.transformers_compat import cache_from_kwargs
from hf_memory.steering.call_scope import CallScope, InUse

__all__ = ["CAAHandle", "CAAVectors", "SITES", "apply_caa", "export_control_vector",
           "load_control_vector", "write_site"]

# Version 1: post-attention vectors (no site recorded); version 2 records the site, written only
# for block-output vectors, so a version-1 reader refuses them rather than steer at the wrong site.
FORMAT_VERSION = 1
SITE_FORMAT_VERSION = 2
DIGEST_KEY = "hf_memory.steering_sha256"  # in the weights file's metadata
CONFIG_KEY = "hf_memory.config"  # config.json's record, also in the weights file's metadata
_VECTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Where a vector is read and added: right after attention (the paper's baseline), or at the
# output of the decoder layer (llama.cpp's and repeng's control vectors).
SITES = ("post_attention", "block_output")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "caa_vectors.safetensors"


class _ResidualsRead(Exception):
    """Ends an extraction's forward pass at the deepest layer it reads."""



def write_site(model: nn.Module, site: str, layer: int) -> tuple[nn.Module, float]:
    """The module whose output a vector at ``site`` of ``layer`` is added to, and the gain that
    output joins the residual stream with (adding ``scale · v / gain`` moves the stream by
    exactly ``scale · v``; a decoder layer's output is the stream itself)."""
    adapter = get_adapter(model)
    if site == "post_attention":
        return adapter.residual_write(model, layer), adapter.residual_gain(model)
    return adapter.layers(model)[layer], 1.0

class CAAVectors:
    """Steering vectors per layer, ``{layer: [hidden]}``, with their provenance."""

    def __init__(self, vectors: dict[int, torch.Tensor], *, scale: float = 1.0,
                 site: str = "post_attention", fingerprint: dict[str, Any] | None = None,
                 provenance: dict[str, Any] | None = None) -> None:
        if not vectors:
            raise ValueError("CAA needs at least one layer's vector")
        if site not in SITES:
            raise ValueError(f"site must be one of {SITES}, got {site!r}")
        for layer, vector in vectors.items():
            if vector.dim() != 1 or not torch.isfinite(vector).all():
                raise ValueError(f"the CAA vector of layer {layer} must be a finite 1-D tensor")
        self.vectors = {int(k): v for k, v in sorted(vectors.items())}
        self.scale = float(scale)
        self.site = site
        self.fingerprint = fingerprint
        self.provenance = dict(provenance or {})

    @property
    def layers(self) -> list[int]:
        return list(self.vectors)

    @classmethod
    @torch.no_grad()
    def extract(cls, model: nn.Module, tokenizer, pairs: Sequence[tuple[str, str]], *,
                layers: Sequence[int], position: str = "mean", scale: float = 1.0,
                site: str = "post_attention") -> CAAVectors:
        """Mean (positive − negative) residual at ``site`` over ``pairs`` at ``layers``."""
        adapter = get_adapter(model)
        if not pairs:
            raise ValueError("CAA extraction needs at least one (positive, negative) pair")
        if position not in ("mean", "last"):
            raise ValueError(f"position must be 'mean' or 'last', got {position!r}")
        if site not in SITES:
            raise ValueError(f"site must be one of {SITES}, got {site!r}")
        num_layers = model.config.num_hidden_layers
        layers = sorted({int(i) for i in layers})
        if not layers or not all(0 <= i < num_layers for i in layers):
            raise ValueError(f"layers must be indices in [0, {num_layers}), got {layers}")
        device = next(model.parameters()).device
        deepest = str(layers[-1])
        store: dict[str, torch.Tensor] = {}

        def keep(key: str, stream: torch.Tensor) -> None:
            store[key] = stream.detach()
            if key == deepest:  # the later layers cannot change what was read
                raise _ResidualsRead

        if site == "post_attention":
            def reader(key: str):
                return lambda _module, args: keep(key, args[0])
            modules = {str(i): adapter.residual_read(model, i) for i in layers}
            register = "register_forward_pre_hook"
        else:
            def reader(key: str):
                return lambda _module, _args, output: keep(
                    key, output if isinstance(output, torch.Tensor) else output[0])
            modules = {str(i): adapter.layers(model)[i] for i in layers}
            register = "register_forward_hook"

        def residuals(text: str) -> dict[int, torch.Tensor]:
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"CAA texts must be non-empty strings, got {text!r}")
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            store.clear()
            hooks = [getattr(module, register)(reader(key)) for key, module in modules.items()]
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _ResidualsRead:
                pass
            finally:
                for hook in hooks:
                    hook.remove()
            pick = (lambda x: x[0].mean(0)) if position == "mean" else (lambda x: x[0, -1])
            return {i: pick(store[str(i)]).double() for i in layers}

        totals = {i: torch.zeros(model.config.hidden_size, dtype=torch.float64) for i in layers}
        for positive, negative in pairs:
            pos, neg = residuals(positive), residuals(negative)
            for i in layers:
                totals[i] += (pos[i] - neg[i]).cpu()
        dtype = next(model.parameters()).dtype
        vectors = {i: (total / len(pairs)).to(dtype) for i, total in totals.items()}
        digest = hashlib.sha256(json.dumps(list(pairs)).encode()).hexdigest()
        return cls(vectors, scale=scale, site=site, fingerprint=model_fingerprint(model),
                   provenance={"pairs": [list(p) for p in pairs], "pairs_sha256": digest,
                               "position": position, "site": site})

    def steering_digest(self) -> str:
        """sha256 of what steers: the site, the scale, and each layer's vector (dtype, bytes)."""
        digest = hashlib.sha256(json.dumps([self.site, self.scale]).encode())
        for layer, vector in self.vectors.items():
            digest.update(f"{layer}:{vector.dtype}:{vector.numel()}".encode())
            digest.update(vector.detach().cpu().contiguous().view(torch.uint8).numpy())
        return digest.hexdigest()

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write ``config.json`` (layers, scale, fingerprint, provenance) and the vectors."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        record = {"format_version": FORMAT_VERSION, "kind": "caa_vectors",
                  "layers": self.layers, "scale": self.scale, "fingerprint": self.fingerprint,
                  "provenance": self.provenance}
        if self.site != "post_attention":
            record.update(format_version=SITE_FORMAT_VERSION, site=self.site)
        # the weights carry their config too: a save killed before config.json was replaced
        # still loads as the new vectors (see from_pretrained)
        write_safetensors(directory / WEIGHTS_NAME,
                          {str(k): v.contiguous().cpu() for k, v in self.vectors.items()},
                          metadata={DIGEST_KEY: self.steering_digest(),
                                    CONFIG_KEY: json.dumps(record, sort_keys=True)})
        where = ("post-attention" if self.site == "post_attention"
                 else "at each decoder layer's output")
        write_json(directory / CONFIG_NAME, record)
        pairs = self.provenance.get("pairs", [])
        card = ["---", "library_name: hf-memory", "tags:", "- caa", "- steering", "---", "",
                "# Contrastive activation addition vectors", "",
                f"Layers {self.layers}, scale {self.scale}, added {where}. Extracted "
                f"from {len(pairs)} contrastive pairs:", ""]
        card += [f"- + `{p}` / − `{n}`" for p, n in pairs]
        write_text(directory / "README.md", "\n".join(card) + "\n")
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *,
                        model: nn.Module | None = None) -> CAAVectors:
        """Load a folder :meth:`save_pretrained` wrote, or a llama.cpp control-vector
        ``.gguf`` file (:func:`load_control_vector`). A missing, corrupt or edited folder raises
        ``ValueError`` (the vectors, scale and site are checked against the content hash the
        weights file records); vectors made on another model than ``model``
        :class:`~hf_memory.FingerprintMismatchError`."""
        directory = Path(directory)
        if directory.suffix == ".gguf":
            return load_control_vector(directory, model=model)
        try:
            record = json.loads((directory / CONFIG_NAME).read_text())
            with safe_open(directory / WEIGHTS_NAME, framework="pt") as weights:
                metadata = weights.metadata() or {}
                tensors = {name: weights.get_tensor(name) for name in weights.keys()}
        except FileNotFoundError:
            missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (directory / n).exists()]
            raise ValueError(f"{directory} lacks {' and '.join(missing) or 'a file'}") from None
        except (ValueError, SafetensorError, OSError, RecursionError) as error:
            raise ValueError(f"{directory} holds corrupt CAA vectors: "
                             f"{type(error).__name__}: {error}") from None
        stored_digest = metadata.get(DIGEST_KEY)  # folders saved before the digest carry none
        try:
            vectors = cls._from_record(record, tensors, directory)
            if stored_digest is not None and stored_digest != vectors.steering_digest():
                raise ValueError(f"{directory}: the vectors, scale or site differ from what was "
                                 "saved (content hash mismatch): the folder was edited or "
                                 "corrupted")
        except ValueError as error:
            if stored_digest is None or CONFIG_KEY not in metadata:
                raise
            vectors = cls._from_weights_config(metadata, tensors, directory, stored_digest,
                                               error)
        if model is not None:
            vectors.check_model(model)
        return vectors

    @classmethod
    def _from_weights_config(cls, metadata: dict[str, str], tensors: dict[str, torch.Tensor],
                             directory: Path, stored_digest: str,
                             refused: ValueError) -> CAAVectors:
        """The vectors as the config the weights carry describes them, where ``config.json``
        does not fit the weights (``refused`` says how): a save killed between its two files
        left new weights beside the old config. Weights their own config does not vouch for are
        refused with ``refused``."""
        try:
            vectors = cls._from_record(json.loads(metadata[CONFIG_KEY]), tensors, directory)
        except (ValueError, RecursionError):
            raise refused from None
        if vectors.steering_digest() != stored_digest:
            raise refused
        warnings.warn(f"{directory / CONFIG_NAME} is older than the vectors beside it (a save "
                      "was interrupted): loading the configuration the weights carry",
                      stacklevel=3)
        return vectors

    @classmethod
    def _from_record(cls, record: Any, tensors: dict[str, torch.Tensor],
                     directory: Path) -> CAAVectors:
        """Vectors from a parsed ``config.json`` and the weights, every field checked."""
        versions = (FORMAT_VERSION, SITE_FORMAT_VERSION)
        if (not isinstance(record, dict) or record.get("kind") != "caa_vectors"
                or record.get("format_version") not in versions):
            raise ValueError(f"{directory / CONFIG_NAME} is not version {versions} CAA "
                             "vectors")
        layers, scale = record.get("layers"), record.get("scale")
        if not isinstance(layers, list) or not all(type(i) is int for i in layers):
            raise ValueError(f"{directory / CONFIG_NAME}: layers must be a list of integers")
        if not all(name.isdigit() and name.isascii() for name in tensors):
            raise ValueError(f"{directory / WEIGHTS_NAME}: tensor names must be layer numbers")
        if sorted(int(k) for k in tensors) != layers:
            raise ValueError(f"{directory}: vectors and config disagree on layers")
        if (type(scale) not in (int, float)) or not math.isfinite(scale):
            raise ValueError(f"{directory / CONFIG_NAME}: scale must be a finite number")
        for name in ("fingerprint", "provenance"):
            if not isinstance(record.get(name), dict | None):
                raise ValueError(f"{directory / CONFIG_NAME}: {name} must be a mapping")
        if not all(t.dtype in _VECTOR_DTYPES for t in tensors.values()):
            raise ValueError(f"{directory / WEIGHTS_NAME}: vectors must be float16, bfloat16, "
                             "float32 or float64")
        site = (record.get("site") if record["format_version"] == SITE_FORMAT_VERSION
                else "post_attention")
        return cls({int(k): v for k, v in tensors.items()}, scale=scale, site=site,
                   fingerprint=record.get("fingerprint"), provenance=record.get("provenance"))

    def check_model(self, model: nn.Module) -> None:
        if self.fingerprint is not None:
            check_fingerprint(self.fingerprint, model, "these CAA vectors")
        hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
        for layer, vector in self.vectors.items():
            if vector.shape[0] != hidden or layer >= layers:
                raise ValueError(f"CAA vector for layer {layer} ({vector.shape[0]} wide) does "
                                 f"not fit a model with {layers} layers of width {hidden}")



def export_control_vector(vectors: CAAVectors, path: str | os.PathLike, *,
                          model_hint: str | None = None) -> Path:
    """Write block-output ``vectors`` as a llama.cpp control-vector GGUF at ``path``: ``scale ·
    v`` per layer, so llama.cpp's ``--control-vector FILE`` steers as :func:`apply_caa` does
    with ``start_position=0``. ``model_hint`` (``controlvector.model_hint``, as repeng writes
    it) defaults to the fingerprint's ``model_type``."""
    if vectors.site != "block_output":
        raise ControlVectorFormatError(
            f"llama.cpp adds control vectors at each decoder layer's output; these vectors are "
            f"{vectors.site} — extract them with CAAVectors.extract(..., site='block_output')")
    if model_hint is None:
        model_hint = str((vectors.fingerprint or {}).get("model_type", ""))
    return write_control_vector(
        path, {layer: vectors.scale * vector for layer, vector in vectors.vectors.items()},
        model_hint=model_hint, fingerprint=vectors.fingerprint, provenance=vectors.provenance)

def load_control_vector(path: str | os.PathLike, *, model: nn.Module | None = None,
                        strength: float = 1.0) -> CAAVectors:
    """A llama.cpp control-vector GGUF (:mod:`hf_memory.baselines.caa_gguf`) as block-output
    vectors at scale ``strength`` (llama.cpp's ``--control-vector-scaled``), checked against
    ``model`` when given: its width and layer count (a
    :class:`~hf_memory.ControlVectorFormatError`) and our fingerprint if the file carries one (a
    :class:`~hf_memory.FingerprintMismatchError`)."""
    read = read_control_vector(path)
    vectors = CAAVectors(read.directions, scale=strength, site="block_output",
                         fingerprint=read.fingerprint, provenance=read.provenance)
    if model is not None:
        try:
            vectors.check_model(model)
        except FingerprintMismatchError:
            raise
        except ValueError as error:
            raise ControlVectorFormatError(f"{path}: {error}") from None
    return vectors

# The CAA handles active in the running call. Like memory steering, CAA is a property of a call:
# the hooks on the shared model add a vector only for the context (thread / asyncio task) that
# activated their handle.
_ACTIVE_CAA: ContextVar[tuple[CAAHandle, ...]] = ContextVar("hf_memory_caa", default=())
_CAA_IN_USE = InUse()


class CAAHandle(CallScope):
    """Adds the vectors to the calls of the context that created it (or runs a block under
    :meth:`applied`) until removed; a context manager and a removable handle. Other threads
    using the same model stay plain."""

    variable = _ACTIVE_CAA
    in_use = _CAA_IN_USE
    what = "CAA handle"

    def __init__(self, model: nn.Module, vectors: CAAVectors, *, scale: float | None = None,
                 start_position: int | torch.Tensor = 0, active: bool = True) -> None:
        vectors.check_model(model)
        start = torch.as_tensor(start_position)
        if start.dim() > 1 or start.is_floating_point() or bool((start < 0).any()):
            raise ValueError("start_position must be a non-negative int or a [batch] tensor of "
                             f"them, got {start_position!r}")
        self.scale = vectors.scale if scale is None else float(scale)
        self.start_position = start_position
        self._start = start.reshape(-1, 1)
        self._offset = threading.local()  # cache length at this thread's forward pass
        parameter = next(model.parameters())
        self._hooks = [model.register_forward_pre_hook(self._track_position, with_kwargs=True)]
        for layer, vector in vectors.vectors.items():
            module, gain = write_site(model, vectors.site, layer)
            delta = (self.scale * vector / gain).to(device=parameter.device,
                                                    dtype=parameter.dtype)
            self._hooks.append(module.register_forward_hook(
                lambda _m, _args, output, delta=delta: self._add(output, delta)))
        self._begin(active)

    def _activated(self, current: tuple[CAAHandle, ...]) -> tuple[CAAHandle, ...]:
        return (*current, self)  # CAA handles stack: each adds its vectors

    def _applies(self) -> bool:
        """Whether the running call is under this handle (no context lookup while no CAA
        handle is live anywhere, so plain calls stay traceable by ``torch.compile``)."""
        return self.in_use.any and self.live and self in self.variable.get()

    def _track_position(self, _module, _args, kwargs) -> None:
        if self._applies():
            cache = cache_from_kwargs(kwargs)
            self._offset.value = 0 if cache is None else cache.get_seq_length()

    def _add(self, output, delta: torch.Tensor):
        if not self._applies():
            return None  # another call's model: unchanged
        hidden = output if isinstance(output, torch.Tensor) else output[0]
        offset = getattr(self._offset, "value", 0)
        positions = offset + torch.arange(hidden.shape[1], device=hidden.device)
        start = self._start.to(hidden.device)
        if start.shape[0] not in (1, hidden.shape[0]):
            raise ValueError(f"CAA has {start.shape[0]} start positions for a batch of "
                             f"{hidden.shape[0]}")
        keep = (positions[None, :] >= start).to(hidden.dtype)[..., None]
        if isinstance(output, torch.Tensor):
            return hidden + keep * delta
        return (hidden + keep * delta, *output[1:])

    def remove(self) -> None:
        """Detach the hooks (from any thread); a second call does nothing."""
        self._end()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def apply_caa(model: nn.Module, vectors: CAAVectors, **kwargs: Any) -> CAAHandle:
    """``with apply_caa(model, vectors, scale=4.0): model.generate(...)``."""
    return CAAHandle(model, vectors, **kwargs)
