"""The selector artifact: where to steer, frozen, saved, loaded and pushed like an adapter.

A :class:`Selector` holds the steered layers, the units (query heads or KV groups) at each, the
layer gains ρ_ℓ and the strength the sites run at, with the calibration's diagnostics and
configuration and the fingerprint of the model it was calibrated on. ``steer(model, banks,
selector=selector)`` applies it with no further search. Its two calibrations are the searches of
this folder: :meth:`Selector.calibrate` (the paper's diagnostic algorithm 1,
:mod:`hf_memory.selection.attention_search`) and :meth:`Selector.calibrate_behavioural` (by the
movement sites cause, :mod:`hf_memory.selection.behavioural_calibration`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from hf_memory.artifacts.atomic_files import write_json, write_safetensors, write_text
from hf_memory.artifacts.cards import render_selector_card
from hf_memory.models.fingerprint import check_fingerprint
from hf_memory.selection.attention_search import calibrate_by_attention
from hf_memory.selection.behavioural_calibration import calibrate_by_behaviour

__all__ = ["Selector", "SelectorFormatError"]

FORMAT_VERSION = 1
CONFIG_NAME = "selector.json"
DIAGNOSTICS_NAME = "diagnostics.safetensors"


class SelectorFormatError(ValueError):
    """A saved selector is missing, corrupt or inconsistent."""


def _frozen(search: Callable[..., Mapping[str, Any]], name: str) -> classmethod:
    """A classmethod that runs ``search`` and freezes its result into a selector; it shows the
    search's signature and documentation."""

    def method(cls, *args: Any, **kwargs: Any) -> Selector:
        return cls(**search(*args, **kwargs))

    functools.update_wrapper(method, search)
    method.__name__, method.__qualname__ = name, f"Selector.{name}"
    return classmethod(method)


@dataclass
class Selector:
    """A frozen selection: which layers and units to steer, with which layer gains.

    Attributes:
        layers: steered layers, ascending.
        units: per steered layer, the selected units (query heads or KV groups).
        unit_type: ``"head"`` or ``"kv_group"``.
        layer_gains: ρ_ℓ per steered layer.
        candidate_layers: the layers the calibration scored (rows of ``diagnostics``).
        diagnostics: ``[len(candidate_layers), units]`` tables: alignment, target_mass,
            reference_mass, prompt_mass, score.
        config: the calibration configuration (budgets, ξ, χ, aggregation, prompts' hash).
        fingerprint: the model the selector was calibrated on.
        strength: the steering strength dial the sites run at (``steer``'s ``strength``; 1: the
            full bank mixture); a cost-budgeted calibration sets it.
    """

    layers: list[int]
    units: dict[int, list[int]]
    unit_type: str
    layer_gains: dict[int, float]
    candidate_layers: list[int]
    diagnostics: dict[str, torch.Tensor] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] | None = None
    strength: float = 1.0

    def check_model(self, model: nn.Module) -> None:
        """Raise if the selector was calibrated on a different model."""
        if self.fingerprint is not None:
            check_fingerprint(self.fingerprint, model, "this selector")

    def summary(self) -> list[dict[str, Any]]:
        """One row per candidate layer: its diagnostics, averaged over units."""
        rows = []
        for i, layer in enumerate(self.candidate_layers):
            row = {"layer": layer, "selected": layer in self.layers}
            for name, table in self.diagnostics.items():
                row[name] = float(table[i].mean())
            rows.append(row)
        return rows

    calibrate = _frozen(calibrate_by_attention, "calibrate")
    calibrate_behavioural = _frozen(calibrate_by_behaviour, "calibrate_behavioural")

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write ``selector.json``, ``diagnostics.safetensors`` and a ``README.md`` card."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        record = {
            "format_version": FORMAT_VERSION, "kind": "memory_inception_selector",
            "layers": self.layers, "units": {str(k): v for k, v in self.units.items()},
            "unit_type": self.unit_type,
            "layer_gains": {str(k): v for k, v in self.layer_gains.items()},
            "candidate_layers": self.candidate_layers, "strength": self.strength,
            "config": self.config, "fingerprint": self.fingerprint,
        }
        # one atomic file each; the statistics first, the record that steers last
        write_safetensors(directory / DIAGNOSTICS_NAME,
                          {k: v.contiguous() for k, v in self.diagnostics.items()})
        write_json(directory / CONFIG_NAME, record)
        write_text(directory / "README.md", render_selector_card(self))
        return directory

    @classmethod
    def from_pretrained(cls, path_or_repo: str | os.PathLike, *,
                        model: nn.Module | None = None, revision: str | None = None,
                        token: str | None = None,
                        cache_dir: str | os.PathLike | None = None) -> Selector:
        """Load a saved selector (a local directory, or a Hub repo id at ``revision`` through
        the Hub cache); with ``model``, check it was calibrated on that model.

        Raises:
            SelectorFormatError: a file is missing, truncated or corrupt, or an entry has the
                wrong type or disagrees with the others (layers, units and gains; the
                diagnostics' rows and the candidate layers; layers or units beyond the recorded
                fingerprint's model). The record has no content hash: an edit that keeps every
                entry well-formed loads as written.
            FingerprintMismatchError: (with ``model``) it was calibrated on another model.
        """
        directory = Path(path_or_repo)
        if not directory.is_dir() and not directory.is_absolute() and (
                str(path_or_repo).count("/") == 1):
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(
                str(path_or_repo), revision=revision, token=token, cache_dir=cache_dir,
                allow_patterns=[CONFIG_NAME, DIAGNOSTICS_NAME, "README.md"]))
        for name in (CONFIG_NAME, DIAGNOSTICS_NAME):  # safetensors names no missing file
            if not (directory / name).is_file():
                raise SelectorFormatError(f"{directory} lacks {name}")
        try:
            record = json.loads((directory / CONFIG_NAME).read_text())
            diagnostics = load_file(directory / DIAGNOSTICS_NAME)
        except (ValueError, RecursionError, SafetensorError, OSError) as error:
            # (RecursionError: JSON nested too deep)
            raise SelectorFormatError(f"{directory} holds a corrupt selector: {error}") from None
        if not isinstance(record, dict) or record.get("kind") != "memory_inception_selector" or (
                record.get("format_version") != FORMAT_VERSION):
            raise SelectorFormatError(f"{directory / CONFIG_NAME} is not a version "
                                      f"{FORMAT_VERSION} memory-inception selector")
        try:
            _check_record(record, diagnostics)
            selector = cls(
                layers=list(record["layers"]),
                units={int(k): list(v) for k, v in record["units"].items()},
                unit_type=record["unit_type"],
                layer_gains={int(k): float(v) for k, v in record["layer_gains"].items()},
                candidate_layers=list(record["candidate_layers"]), diagnostics=diagnostics,
                config=record["config"], fingerprint=record["fingerprint"],
                strength=float(record.get("strength", 1.0)))
        except KeyError as error:
            raise SelectorFormatError(f"{directory / CONFIG_NAME} lacks {error}") from None
        except (TypeError, ValueError, OverflowError) as error:
            raise SelectorFormatError(f"{directory / CONFIG_NAME} holds a malformed entry: "
                                      f"{error}") from None
        if sorted(selector.units) != selector.layers or sorted(selector.layer_gains) != (
                selector.layers):
            raise SelectorFormatError(f"{directory / CONFIG_NAME}: layers, units and gains "
                                      "disagree")
        if not 0.0 <= selector.strength <= 1.0:
            raise SelectorFormatError(f"{directory / CONFIG_NAME}: strength must be in [0, 1], "
                                      f"got {selector.strength}")
        if model is not None:
            selector.check_model(model)
        return selector

    def push_to_hub(self, repo_id: str, *, private: bool | None = None,
                    token: str | None = None,
                    commit_message: str = "Upload memory-inception selector") -> str:
        """Create (if needed) a Hub model repo and upload the saved selector to it."""
        from hf_memory.artifacts.hub_upload import upload_saved

        return upload_saved(self.save_pretrained, repo_id, private=private, token=token,
                            commit_message=commit_message)


def _integers(value: Any, what: str, *, limit: Any = None) -> None:
    """Raise ``ValueError`` unless ``value`` is a list of distinct integers in [0, limit)."""
    if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value) or (
            len(set(value)) != len(value)):
        raise ValueError(f"{what} must be a list of distinct non-negative integers, got "
                         f"{value!r:.80}")
    if isinstance(limit, int) and value and max(value) >= limit:
        raise ValueError(f"{what} {value!r:.80} reach past the model's {limit}")


def _check_record(record: dict[str, Any], diagnostics: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` (``KeyError`` for a missing entry) where a selector record's entries
    have the wrong type, or reach past the model its fingerprint records."""
    fingerprint = record["fingerprint"]
    if fingerprint is not None and not isinstance(fingerprint, dict):
        raise ValueError(f"fingerprint must be an object or null, got {fingerprint!r:.80}")
    fingerprint = fingerprint or {}
    if record["unit_type"] not in ("head", "kv_group"):
        raise ValueError(f"unit_type must be 'head' or 'kv_group', got {record['unit_type']!r:.40}")
    _integers(record["layers"], "layers", limit=fingerprint.get("num_hidden_layers"))
    _integers(record["candidate_layers"], "candidate_layers",
              limit=fingerprint.get("num_hidden_layers"))
    if record["layers"] != sorted(record["layers"]):
        raise ValueError(f"layers must be ascending, got {record['layers']!r:.80}")
    units, gains = record["units"], record["layer_gains"]
    if not isinstance(units, dict) or not isinstance(gains, dict):
        raise ValueError("units and layer_gains must be objects keyed by layer")
    heads = fingerprint.get("num_attention_heads" if record["unit_type"] == "head"
                            else "num_key_value_heads")
    for layer, selected in units.items():
        _integers(selected, f"units of layer {layer}", limit=heads)
    for layer, gain in gains.items():
        if isinstance(gain, bool) or not isinstance(gain, int | float) or not math.isfinite(gain):
            raise ValueError(f"the gain of layer {layer} must be a finite number, got "
                             f"{gain!r:.40}")
    strength = record.get("strength", 1.0)
    if isinstance(strength, bool) or not isinstance(strength, int | float):
        raise ValueError(f"strength must be a number, got {strength!r:.40}")
    if not isinstance(record["config"], dict):
        raise ValueError(f"config must be an object, got {record['config']!r:.80}")
    for name, table in diagnostics.items():  # rows: the candidate layers (NaN: not scored)
        if table.dim() < 1 or len(table) != len(record["candidate_layers"]) or (
                table.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64)):
            raise ValueError(f"diagnostics {name!r} must be a float table with one row per "
                             f"candidate layer, got {table.dtype} {tuple(table.shape)}")
