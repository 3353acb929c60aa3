"""The bank-set registry a vLLM server steers with, and the per-request steering arguments.

A registry is a JSON file named by ``$HF_MEMORY_VLLM_REGISTRY``: the fingerprint of the model it
serves, and ids for saved bank sets (each with an optional default selector) and for extra
selectors. Every process of a vLLM server reads it: the API process validates requests against
it (a bad request gets HTTP 400, the others go on), each worker loads the bank sets once and
checks the served weights against the recorded fingerprint.

A request steers through ``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP)::

    {"memory_bank_set": "calm", "memory_selector": "n-minus", "memory_scale": 0.5}

``memory_bank_set`` names a registered bank set; ``memory_selector`` (optional) a registered
selector instead of the bank set's own; ``memory_scale`` (optional, > 0) multiplies every steered
layer's gain ρ. Without ``memory_bank_set`` the request runs the stock model.

A registry also bounds what a server loads: ``max_slot_layers``, the bank slots summed over the
layers each bank covers (its KV entries per head: a descriptor's length times its layers), for
every bank set. A bank set past it is refused when the registry is written, and again when a
request names it (its files may have been replaced since).

Nothing here imports vLLM: the registry is written and checked in any environment.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from hf_memory.artifacts.atomic_files import write_json
from hf_memory.banks.bank_set import BankSetFormatError
from hf_memory.models.fingerprint import FingerprintMismatchError, compare_fingerprints
from hf_memory.selection.selector import SelectorFormatError

__all__ = ["DEFAULT_MAX_SLOT_LAYERS", "REGISTRY_ENV", "Registry", "RegistryError",
           "SteeringRequest", "bank_set_size", "cache_salt", "parse_request", "steering_args",
           "write_registry"]

REGISTRY_ENV = "HF_MEMORY_VLLM_REGISTRY"
KIND = "hf_memory_vllm_registry"
FORMAT_VERSION = 1
ARG_PREFIX = "memory_"
BANK_SET_ARG, SELECTOR_ARG, SCALE_ARG = "memory_bank_set", "memory_selector", "memory_scale"
# A served model may be loaded from any path; the weights digest identifies the checkpoint.
FINGERPRINT_IGNORES = ("name_or_path",)
# 2,048 descriptor tokens at 32 layers; SmolLM2-135M's banks take 1.5 KiB per slot-layer (float32).
DEFAULT_MAX_SLOT_LAYERS = 65_536


def bank_set_size(bank_set) -> tuple[int, int]:
    """(slot-layers, bytes) of a bank set: slots summed over the layers each bank covers, and
    the bytes of its key and value tensors."""
    return (sum(bank.num_slots * len(bank.layers) for bank in bank_set),
            sum(bank.nbytes() for bank in bank_set))


def _check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise RegistryError(f"max_slot_layers must be a positive integer, got {limit!r}")
    return limit


class RegistryError(ValueError):
    """A registry, or a request's steering arguments, cannot be used."""


@dataclass(frozen=True)
class SteeringRequest:
    """What one request asked for: a bank set, an optional selector and a gain scale."""

    bank_set: str
    selector: str | None = None
    scale: float = 1.0

    @property
    def key(self) -> tuple[str, str | None, float]:
        return (self.bank_set, self.selector, self.scale)


def steering_args(bank_set: str, *, selector: str | None = None,
                  scale: float | None = None) -> dict[str, Any]:
    """``extra_args`` (or ``vllm_xargs``) that steer a request with a registered bank set."""
    args: dict[str, Any] = {BANK_SET_ARG: bank_set}
    if selector is not None:
        args[SELECTOR_ARG] = selector
    if scale is not None:
        args[SCALE_ARG] = scale
    return args


def cache_salt(extra_args: Mapping[str, Any] | None) -> str | None:
    """The prefix-cache salt a steered request must carry (None for a plain request).

    vLLM hashes prefix-cache blocks from the prompt and its ``cache_salt``; steered K/V differ
    from plain K/V after the first steered layer, so steered prompts are salted per bank set,
    selector and scale and never share blocks with plain prompts or with other steerings.
    """
    request = parse_request(extra_args)
    if request is None:
        return None
    return f"hf-memory:{request.bank_set}:{request.selector or ''}:{request.scale!r}"


def parse_request(extra_args: Mapping[str, Any] | None) -> SteeringRequest | None:
    """The steering a request's ``extra_args`` ask for (None: plain); a clear error otherwise."""
    if not extra_args:
        return None
    if not isinstance(extra_args, Mapping):
        raise RegistryError(f"extra_args must be a mapping, got {type(extra_args).__name__}")
    ours = {k: v for k, v in extra_args.items() if str(k).startswith(ARG_PREFIX)}
    if not ours:
        return None
    unknown = sorted(set(ours) - {BANK_SET_ARG, SELECTOR_ARG, SCALE_ARG})
    if unknown:
        raise RegistryError(f"unknown steering arguments {unknown}; expected {BANK_SET_ARG}, "
                            f"{SELECTOR_ARG}, {SCALE_ARG}")
    bank_set = ours.get(BANK_SET_ARG)
    if not isinstance(bank_set, str) or not bank_set:
        raise RegistryError(f"{BANK_SET_ARG} must name a registered bank set, got {bank_set!r}")
    selector = ours.get(SELECTOR_ARG)
    if selector is not None and (not isinstance(selector, str) or not selector):
        raise RegistryError(f"{SELECTOR_ARG} must name a registered selector, got {selector!r}")
    scale = ours.get(SCALE_ARG, 1.0)
    if isinstance(scale, str):
        try:
            scale = float(scale)
        except ValueError:
            raise RegistryError(f"{SCALE_ARG} must be a number, got {scale!r}") from None
    # (an int past a float's range: math.isfinite cannot convert it)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not (
            (isinstance(scale, float) or abs(scale) < 2**1023) and math.isfinite(scale)
            and scale > 0):
        raise RegistryError(f"{SCALE_ARG} must be a finite number > 0, got {scale!r:.40}")
    return SteeringRequest(bank_set, selector, float(scale))


class Registry:
    """A loaded registry: the served model's fingerprint and the artifacts' directories.

    A registry that is not JSON, or whose entries have the wrong type, raises
    :class:`RegistryError` here; one whose artifacts are missing, corrupt or made for another
    model raises it from :meth:`validate`.
    """

    def __init__(self, record: dict[str, Any], path: Path) -> None:
        self.path = path
        if not isinstance(record, dict) or record.get("kind") != KIND or (
                record.get("format_version") != FORMAT_VERSION):
            raise RegistryError(f"{path} is not a version {FORMAT_VERSION} hf-memory vLLM "
                                "registry (write one with hf_memory_vllm.write_registry)")
        try:
            self.model: dict[str, Any] = record["model"]
            self.bank_sets: dict[str, dict[str, str | None]] = record["bank_sets"]
            self.selectors: dict[str, str] = record.get("selectors", {})
        except KeyError as error:
            raise RegistryError(f"{path} lacks {error}") from None
        _check_record(record, path)
        self.max_slot_layers = _check_limit(
            record.get("limits", {}).get("max_slot_layers", DEFAULT_MAX_SLOT_LAYERS))

    def check_size(self, name: str, bank_set) -> None:
        """Raise :class:`RegistryError` if ``bank_set`` is past this registry's size limit."""
        _check_size(name, bank_set, self.max_slot_layers)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Registry:
        path = Path(path)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise RegistryError(f"no registry at {path} (${REGISTRY_ENV})") from None
        except OSError as error:
            raise RegistryError(f"cannot read the registry {path}: {error}") from None
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
            raise RegistryError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(record, dict):
            raise RegistryError(f"{path} does not hold a registry object")
        return cls(record, path)

    @classmethod
    def from_env(cls) -> Registry | None:
        """The registry named by ``$HF_MEMORY_VLLM_REGISTRY`` (None when unset)."""
        path = os.environ.get(REGISTRY_ENV)
        return _load_cached(path, _mtime(path)) if path else None

    def selector_dir(self, request: SteeringRequest) -> str | None:
        """The selector directory a request steers with (None: every layer its banks cover)."""
        if request.selector is not None:
            return self.selectors[request.selector]
        return self.bank_sets[request.bank_set].get("selector")

    def validate(self, request: SteeringRequest) -> None:
        """Raise :class:`RegistryError` unless this registry can serve ``request``."""
        if request.bank_set not in self.bank_sets:
            raise RegistryError(f"unknown bank set {request.bank_set!r}; registered: "
                                f"{sorted(self.bank_sets)}")
        if request.selector is not None and request.selector not in self.selectors:
            raise RegistryError(f"unknown selector {request.selector!r}; registered: "
                                f"{sorted(self.selectors)}")
        entry = self.bank_sets[request.bank_set]
        selector = self.selector_dir(request)
        for directory in (entry["banks"], selector):  # a local folder, never a Hub id
            if directory is not None and not os.path.isdir(directory):
                raise RegistryError(f"{request.bank_set!r}: {directory} is not a directory")
        try:
            bank_set = _bank_set(entry["banks"], _mtime(entry["banks"]))
            bank_set.check_fingerprint(self.model, ignore=FINGERPRINT_IGNORES)
            self.check_size(request.bank_set, bank_set)
            if selector is not None:
                fingerprint = _selector(selector, _mtime(selector)).fingerprint
                if fingerprint is not None:
                    compare_fingerprints(fingerprint, self.model, "this selector",
                                         ignore=FINGERPRINT_IGNORES)
        except (FingerprintMismatchError, BankSetFormatError, SelectorFormatError) as error:
            raise RegistryError(f"{request.bank_set!r}: {error} (the server runs "
                                f"{self.model.get('name_or_path')!r})") from None
        except ValueError as error:  # shapes that do not fit the served model
            raise RegistryError(f"{request.bank_set!r}: {error}") from None


def _is_path(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _check_record(record: dict[str, Any], path: Path) -> None:
    """Raise :class:`RegistryError` unless a registry's entries have the types
    :func:`write_registry` gives them."""
    model, bank_sets = record["model"], record["bank_sets"]
    selectors, limits = record.get("selectors", {}), record.get("limits", {})
    if not isinstance(model, dict):
        raise RegistryError(f"{path}: model must be a fingerprint object, got {model!r:.80}")
    if not isinstance(bank_sets, dict) or not all(
            isinstance(entry, dict) and _is_path(entry.get("banks"))
            and (entry.get("selector") is None or _is_path(entry["selector"]))
            for entry in bank_sets.values()):
        raise RegistryError(f"{path}: bank_sets must map ids to objects with a banks directory "
                            "and a selector directory or null")
    if not isinstance(selectors, dict) or not all(map(_is_path, selectors.values())):
        raise RegistryError(f"{path}: selectors must map ids to selector directories")
    if not isinstance(limits, dict):
        raise RegistryError(f"{path}: limits must be an object, got {limits!r:.80}")


def _check_size(name: str, bank_set, limit: int) -> None:
    if bank_set.contrast:
        raise RegistryError(f"bank set {name!r} is a contrast set (BankSet.contrast), which the "
                            "vLLM plugin does not serve yet; steer it with hf_memory.steer")
    slot_layers, nbytes = bank_set_size(bank_set)
    if slot_layers > limit:
        raise RegistryError(f"bank set {name!r} holds {slot_layers:,} slot-layers (bank slots x "
                            f"layers, {nbytes / 2**20:.1f} MiB), past the limit of {limit:,} "
                            "(max_slot_layers)")


@lru_cache(maxsize=64)
def _bank_set(path: str, _mtime: int):
    from hf_memory import BankSet

    return BankSet.from_pretrained(path)


@lru_cache(maxsize=64)
def _selector(path: str, _mtime: int):
    from hf_memory import Selector

    return Selector.from_pretrained(path)


def _mtime(path: str) -> int:
    """When ``path`` (a file, or a directory's newest entry) last changed; -1 if unreadable."""
    try:
        if os.path.isdir(path):
            return max([os.stat(path).st_mtime_ns]
                       + [entry.stat().st_mtime_ns for entry in os.scandir(path)])
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


@lru_cache(maxsize=8)
def _load_cached(path: str, _mtime: int) -> Registry:
    return Registry.load(path)


def write_registry(path: str | os.PathLike, model, bank_sets: Mapping[str, Any], *,
                   selectors: Mapping[str, str | os.PathLike] | None = None,
                   max_slot_layers: int = DEFAULT_MAX_SLOT_LAYERS) -> Path:
    """Write a registry for serving ``model`` (a transformers model: its fingerprint is recorded).

    ``bank_sets`` maps an id to a bank-set directory, or to ``(banks_dir, selector_dir)``;
    ``selectors`` maps ids to extra selector directories a request may choose. Every artifact is
    loaded and checked against ``model`` and against ``max_slot_layers`` first, so a registry
    never lists unusable files; each entry records its size (slot-layers and bytes).
    """
    _check_limit(max_slot_layers)
    from hf_memory import BankSet, Selector
    from hf_memory.models.fingerprint import model_fingerprint

    entries: dict[str, dict[str, str | None]] = {}
    for name, spec in bank_sets.items():
        banks, selector = (spec, None) if isinstance(spec, str | os.PathLike) else spec
        bank_set = BankSet.from_pretrained(banks, model=model)
        _check_size(str(name), bank_set, max_slot_layers)
        if selector is not None:
            Selector.from_pretrained(selector, model=model)
        slot_layers, nbytes = bank_set_size(bank_set)
        entries[str(name)] = {"banks": str(Path(banks).resolve()),
                              "selector": None if selector is None
                              else str(Path(selector).resolve()),
                              "slot_layers": slot_layers, "bytes": nbytes}
    extra = {}
    for name, selector in (selectors or {}).items():
        Selector.from_pretrained(selector, model=model)
        extra[str(name)] = str(Path(selector).resolve())
    record = {"kind": KIND, "format_version": FORMAT_VERSION,
              "model": model_fingerprint(model), "bank_sets": entries, "selectors": extra,
              "limits": {"max_slot_layers": max_slot_layers}}
    path = Path(path)
    write_json(path, record)
    return path
