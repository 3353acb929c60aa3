"""CAA vectors as llama.cpp control vectors: a GGUF file both ways.

llama.cpp (``--control-vector FILE``, ``--control-vector-scaled FILE S``) reads a GGUF file whose
``general.architecture`` is ``controlvector`` and whose tensors are ``direction.<n>``: one float32
vector of the model's width per layer, ``n >= 1``. It adds ``strength · direction.<n>`` to the
residual stream at the output of decoder layer ``n`` (0-based, after the feed-forward block) at
every position, prompt included; no file holds a direction for layer 0's output, and tensors that
name the same layer add up. That is :class:`~hf_memory.CAAVectors` at
``site="block_output"`` with ``start_position=0``, so:

- :func:`write_control_vector` writes such a file; :func:`~hf_memory.export_control_vector`
  writes ``scale · v`` per layer of block-output vectors (the scale baked in, so
  ``--control-vector`` at strength 1 steers as our handle at the vectors' scale), plus our
  fingerprint and provenance as extra metadata llama.cpp ignores;
- :func:`read_control_vector` reads any such file (llama.cpp's ``cvector-generator``, repeng's
  ``export_gguf``, ours) with the checks llama.cpp makes, stricter where llama.cpp is lenient (a
  layer index with trailing characters), each failure a :class:`ControlVectorFormatError`;
  :func:`~hf_memory.load_control_vector` makes ``CAAVectors`` of it, checked against the model
  (layers past the model's, which llama.cpp ignores, are refused).

What does not carry over to llama.cpp: post-attention vectors (the site differs: export refuses
them by name), a start position (llama.cpp steers the prompt too), per-request isolation (one
control vector per llama.cpp context) and memory banks (llama.cpp has no hook for them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_memory.artifacts.atomic_files import write_file

__all__ = ["ControlVectorFile", "ControlVectorFormatError", "read_control_vector",
           "write_control_vector"]

ARCHITECTURE = "controlvector"
_DIRECTION = re.compile(r"direction\.([0-9]+)")
_FINGERPRINT_KEY = "hf_memory.fingerprint"
_PROVENANCE_KEY = "hf_memory.provenance"
_DIGEST_KEY = "hf_memory.directions_sha256"  # ours only: other writers' files carry none


def _digest(arrays: dict[int, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for layer, array in sorted(arrays.items()):
        digest.update(f"{layer}:".encode())
        digest.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return digest.hexdigest()


class ControlVectorFormatError(ValueError):
    """A file is not a llama.cpp control vector this model can use, or vectors cannot be one."""


@dataclass(frozen=True)
class ControlVectorFile:
    """What a control-vector file holds: float32 directions per layer (repeated layers summed),
    and our fingerprint and provenance where we wrote it."""

    directions: dict[int, torch.Tensor]
    fingerprint: dict[str, Any] | None
    provenance: dict[str, Any]


def write_control_vector(path: str | os.PathLike, directions: dict[int, torch.Tensor], *,
                         model_hint: str = "", fingerprint: dict[str, Any] | None = None,
                         provenance: dict[str, Any] | None = None) -> Path:
    """Write ``directions`` (``{layer: [hidden]}``, stored as float32) as a llama.cpp
    control-vector GGUF at ``path`` (atomically), with our fingerprint and provenance as
    metadata llama.cpp ignores."""
    import gguf

    path = Path(path)
    if path.suffix != ".gguf":
        raise ControlVectorFormatError(f"a control vector is a .gguf file, not {path.name}")
    if 0 in directions:
        raise ControlVectorFormatError(
            "llama.cpp has no control vector for layer 0's output (its files start at "
            "direction.1); drop layer 0")
    arrays = {layer: direction.to(torch.float32).numpy() for layer, direction in
              sorted(directions.items())}
    digest = _digest(arrays)

    def fill(tmp: Path) -> None:
        writer = gguf.GGUFWriter(tmp, ARCHITECTURE)
        writer.add_string(f"{ARCHITECTURE}.model_hint", model_hint)
        writer.add_uint32(f"{ARCHITECTURE}.layer_count", len(arrays))
        if fingerprint is not None:
            writer.add_string(_FINGERPRINT_KEY, json.dumps(fingerprint, sort_keys=True))
        writer.add_string(_PROVENANCE_KEY, json.dumps(provenance or {}, sort_keys=True))
        writer.add_string(_DIGEST_KEY, digest)
        for layer, array in arrays.items():
            writer.add_tensor(f"direction.{layer}", array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return write_file(path, fill)


def _string(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    if not isinstance(value, str):
        raise ControlVectorFormatError(f"metadata {key} is not a string")
    return value


def _json(reader, key: str, path: Path) -> Any:
    text = _string(reader, key)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        raise ControlVectorFormatError(f"{path}: metadata {key} is not JSON") from None


def _directions(reader, path: Path) -> dict[int, np.ndarray]:
    """The file's directions summed per layer, each tensor checked before its data is read."""
    import gguf

    if not reader.tensors:
        raise ControlVectorFormatError(f"{path} holds no direction tensors")
    sums: dict[int, np.ndarray] = {}
    width = None
    for tensor in reader.tensors:
        name, shape = tensor.name, [int(d) for d in tensor.shape]
        match = _DIRECTION.fullmatch(name)
        if match is None:
            raise ControlVectorFormatError(f"{path}: tensor {name!r} is not direction.<layer>")
        layer = int(match.group(1))
        if layer == 0:
            raise ControlVectorFormatError(f"{path}: direction.0 is invalid (llama.cpp has no "
                                           "control vector for layer 0's output)")
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ControlVectorFormatError(f"{path}: {name} is {tensor.tensor_type.name}, "
                                           "not F32")
        if len(shape) != 1 or int(tensor.n_elements) != shape[0]:
            raise ControlVectorFormatError(f"{path}: {name} is not one vector (shape {shape})")
        if width is None:
            width = shape[0]
        elif shape[0] != width:
            raise ControlVectorFormatError(f"{path}: {name} has {shape[0]} entries, the others "
                                           f"{width}")
        values = np.array(tensor.data, dtype=np.float32).reshape(-1)
        if values.size != width or not np.isfinite(values).all():
            raise ControlVectorFormatError(f"{path}: {name} holds NaN or infinity" if
                                           values.size == width else f"{path}: {name} is cut")
        sums[layer] = sums[layer] + values if layer in sums else values
    return sums


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_control_vector(path: str | os.PathLike) -> ControlVectorFile:
    """Read a llama.cpp control-vector GGUF; the provenance gains the file's name, model hint
    and sha256 under ``control_vector``."""
    import gguf

    path = Path(path)
    try:
        sha256 = _sha256(path)
    except OSError as error:
        raise ControlVectorFormatError(f"cannot read {path}: {error.strerror}") from None
    try:
        reader = gguf.GGUFReader(path)
        architecture = _string(reader, "general.architecture")
        if architecture not in (None, ARCHITECTURE):
            raise ControlVectorFormatError(f"{path} is a GGUF {architecture!r} file, not a "
                                           "control vector")
        fingerprint = _json(reader, _FINGERPRINT_KEY, path)
        provenance = _json(reader, _PROVENANCE_KEY, path)
        hint = _string(reader, f"{ARCHITECTURE}.model_hint")
        stored_digest = _string(reader, _DIGEST_KEY)
        sums = _directions(reader, path)
    except ControlVectorFormatError:
        raise
    except Exception as error:  # the gguf reader's parse errors have no class of their own
        raise ControlVectorFormatError(f"{path} is not a readable GGUF file: "
                                       f"{type(error).__name__}: {error}") from None
    if stored_digest is not None and stored_digest != _digest(sums):
        raise ControlVectorFormatError(f"{path}: the directions differ from what was written "
                                       "(content hash mismatch): the file was edited or "
                                       "corrupted")
    if fingerprint is not None and not isinstance(fingerprint, dict):
        raise ControlVectorFormatError(f"{path}: metadata {_FINGERPRINT_KEY} is not a mapping")
    if provenance is not None and not isinstance(provenance, dict):
        raise ControlVectorFormatError(f"{path}: metadata {_PROVENANCE_KEY} is not a mapping")
    provenance = dict(provenance or {})
    provenance["control_vector"] = {"file": path.name, "model_hint": hint, "sha256": sha256}
    return ControlVectorFile({layer: torch.from_numpy(v) for layer, v in sums.items()},
                             fingerprint, provenance)
