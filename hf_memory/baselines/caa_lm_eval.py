"""CAA vectors as the file of lm-eval's ``steered`` model (``--model steered``).

lm-eval's ``steered`` type reads a ``.pt`` mapping each hookpoint — a module's name under the
model's ``base_model`` — to ``{"steering_vector", "steering_coefficient", "action": "add",
"bias": None, "head_index": None}``, and adds ``coefficient · vector`` to that module's output at
every position. Our CAA adds ``scale · v / gain`` to the output of the module the adapter names
(the attention, or the norm on it in a post-norm layer; the decoder layer at
``site="block_output"``), so the file names that module, stores ``v / gain`` and the scale as the
coefficient: lm-eval then steers exactly as :func:`~hf_memory.apply_caa` at ``start_position=0``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from hf_memory.artifacts.atomic_files import write_file
from hf_memory.baselines.caa import CAAVectors, write_site

__all__ = ["export_lm_eval_steer", "lm_eval_steer_config"]


def _hookpoint(model: nn.Module, module: nn.Module) -> str:
    base = model.base_model
    for name, candidate in base.named_modules():
        if candidate is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a module of {type(base).__name__}")


def lm_eval_steer_config(vectors: CAAVectors, model: nn.Module) -> dict[str, dict]:
    """The ``{hookpoint: {...}}`` mapping lm-eval's ``steered`` model reads, for ``model``."""
    vectors.check_model(model)
    config = {}
    for layer, vector in vectors.vectors.items():
        module, gain = write_site(model, vectors.site, layer)
        config[_hookpoint(model, module)] = {
            "steering_vector": (vector / gain).contiguous().cpu(),
            "steering_coefficient": vectors.scale, "action": "add", "bias": None,
            "head_index": None}
    return config


def export_lm_eval_steer(vectors: CAAVectors, model: nn.Module,
                         path: str | os.PathLike) -> Path:
    """Write :func:`lm_eval_steer_config` to ``path`` (a ``.pt`` file, atomically)."""
    path = Path(path)
    if path.suffix not in (".pt", ".pth"):
        raise ValueError(f"lm-eval's steered model reads .pt or .pth files, not {path.name}")
    config = lm_eval_steer_config(vectors, model)
    return write_file(path, lambda tmp: torch.save(config, tmp))
