"""A set of memory banks for one model: the unit that is saved, loaded and pushed like an adapter.

Directory layout (``save_pretrained``)::

    config.json        format version, library version, model fingerprint, mixture settings,
                       per-bank metadata (name, role, gain, layers, shapes, dtype, content hash,
                       provenance: source text, its hash, templates, token ids)
    banks.safetensors  ``{i}.keys`` / ``{i}.values`` ``[L_b, KVH, M, D]`` (+ ``{i}.phases`` or
                       ``{i}.positions`` ``[M]``)
    README.md          a bank card that discloses the steering content

A save is one atomic step: ``banks.safetensors`` is written beside itself and renamed over the
old one, and it carries the whole config in its safetensors metadata (``hf_memory.config``);
``config.json`` and ``README.md`` are then rewritten from the same config, each atomically. A
save killed after the weights' rename and before the config's leaves new weights beside the old
``config.json``, whose recorded content hashes are not those the weights carry:
:meth:`BankSet.from_pretrained` then loads the config the weights carry. So a killed save
leaves the old bank set or the new one, never neither (the card may lag until the next save).
The file names and ``config.json`` are those of every earlier version: folders saved before the
weights carried their config load as they did, and earlier readers read these folders. A save
adds no files, so repeated saves leave nothing behind. Naming files by content under a manifest
would have changed the layout that older readers and the Hub's ``allow_patterns`` rely on, and
replacing the folder whole would drop what else lives in it (a persona keeps its selector there).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hf_memory.artifacts.atomic_files import write_json, write_safetensors, write_text
from hf_memory.artifacts.cards import render_bank_card
from hf_memory.banks.bank import MemoryBank
from hf_memory.models.adapters import get_adapter
from hf_memory.models.fingerprint import compare_fingerprints, model_fingerprint

__all__ = ["FORMAT_VERSION", "BankSet", "BankSetFormatError"]

FORMAT_VERSION = 1
CONTRAST_FORMAT_VERSION = 2  # contrast sets: older readers refuse them rather than mix them
SINK_FORMAT_VERSION = 3  # sets the first token does not read: older readers would let it
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "banks.safetensors"
CARD_NAME = "README.md"
CARRIED_CONFIG = "hf_memory.config"  # the weights' metadata key holding config.json's record
_CONFIG_KEYS = {"format_version", "library", "library_version", "kind", "fingerprint", "gamma",
                "size_normalize", "contrast", "sink_reads_banks", "banks"}
_BANK_KEYS = {"name", "role", "gain", "layers", "num_slots", "num_kv_heads", "head_dim",
              "dtype", "content_hash", "provenance", "has_phases", "has_positions"}


class BankSetFormatError(ValueError):
    """A saved bank set is missing, corrupt or inconsistent."""


class BankSet:
    """Memory banks plus the model fingerprint they were made for and the mixture settings.

    Args:
        banks: the banks; at most one ``target`` and one ``reference`` (concatenate variants
            with :meth:`MemoryBank.concat`), any number of ``auxiliary``.
        model: if given, its fingerprint is recorded and the banks are checked against it.
        gamma: sharpness γ of the contrastive gates g± = σ(±γΔ).
        size_normalize: use size-normalised evidence (eq. 5, 9).
        contrast: steer by the difference of two mixtures, each one softmax over [history;
            one bank]: o_h + s·(o_{h,target} − o_{h,reference}) (s: the strength dial), where
            the paper's gate mixes both banks into one softmax. Needs one target and one
            reference bank over the same layers and no auxiliary bank. What the two banks have
            in common (the persona text, the reply form) cancels and their difference steers,
            as in CAA's mean difference, but read by attention at the selected sites.
        sink_reads_banks: whether a sequence's first token (the model's attention sink: a query
            that sees no key but its own) reads the banks like every later token (True, the
            paper's injection) or keeps the stock attention output (False: as it would beside a
            visible prompt, which comes after it). Banks placed before the conversation
            (``placement="before"``) change the sink's massive activation when it reads them,
            and with it every later token: measured in ``hf_memory/README.md``.
    """

    def __init__(
        self,
        banks: Sequence[MemoryBank],
        *,
        model: nn.Module | None = None,
        fingerprint: dict[str, Any] | None = None,
        gamma: float = 1.0,
        size_normalize: bool = True,
        contrast: bool = False,
        sink_reads_banks: bool = True,
    ) -> None:
        self.banks = list(banks)
        names = [bank.name for bank in self.banks]
        if len(set(names)) != len(names):
            raise ValueError(f"bank names must be unique, got {names}")
        for role in ("target", "reference"):
            if sum(bank.role == role for bank in self.banks) > 1:
                raise ValueError(f"a bank set holds at most one {role} bank; join variants with "
                                 "MemoryBank.concat")
        if not float(gamma) == float(gamma) or abs(float(gamma)) == float("inf"):
            raise ValueError(f"gamma must be finite, got {gamma}")
        self.gamma = float(gamma)
        self.size_normalize = bool(size_normalize)
        self.contrast = bool(contrast)
        if not isinstance(sink_reads_banks, bool):
            raise ValueError(f"sink_reads_banks must be True or False, got {sink_reads_banks!r}")
        self.sink_reads_banks = sink_reads_banks
        if self.contrast:
            _check_contrast(self.banks)
        self.fingerprint = model_fingerprint(model) if model is not None else fingerprint
        if model is not None:
            self.check_model(model)

    def __len__(self) -> int:
        return len(self.banks)

    def __iter__(self):
        return iter(self.banks)

    def __getitem__(self, name: str) -> MemoryBank:
        for bank in self.banks:
            if bank.name == name:
                return bank
        raise KeyError(f"no bank named {name!r}; banks: {[b.name for b in self.banks]}")

    def head_bytes(self) -> int:
        """Bytes of keys and values of one KV head at one layer, over every bank: what each
        steered KV head of each steered layer carries."""
        return sum(bank.nbytes([bank.layers[0]]) // bank.num_kv_heads for bank in self.banks)

    def check_model(self, model: nn.Module) -> None:
        """Raise if these banks cannot be applied to ``model``."""
        get_adapter(model)
        self.check_fingerprint(model_fingerprint(model))

    def check_fingerprint(self, actual: dict[str, Any], *, ignore: tuple[str, ...] = ()) -> None:
        """Raise if these banks cannot be applied to the model with fingerprint ``actual``
        (:func:`~hf_memory.models.fingerprint.fingerprint_of`; ``ignore``: keys not compared)."""
        if self.fingerprint is not None:
            compare_fingerprints(self.fingerprint, actual, "this bank set", ignore=ignore)
        for bank in self.banks:
            expected = (actual["num_key_value_heads"], actual["head_dim"])
            if (bank.num_kv_heads, bank.head_dim) != expected:
                raise ValueError(
                    f"bank {bank.name!r} has {bank.num_kv_heads} KV heads of width "
                    f"{bank.head_dim}; the model has {expected[0]} of width {expected[1]}")
            if max(bank.layers) >= actual["num_hidden_layers"]:
                raise ValueError(f"bank {bank.name!r} covers layer {max(bank.layers)}; the model "
                                 f"has {actual['num_hidden_layers']} layers")

    def audit(self) -> list[dict[str, Any]]:
        """Name, role, gain and content hash of every bank (what steering records)."""
        return [{"name": b.name, "role": b.role, "gain": b.gain, "content_hash": b.content_hash()}
                for b in self.banks]

    def _config(self) -> dict[str, Any]:
        from hf_memory import __version__

        return {
            "format_version": (SINK_FORMAT_VERSION if not self.sink_reads_banks
                               else CONTRAST_FORMAT_VERSION if self.contrast else FORMAT_VERSION),
            "kind": "memory_inception_bank_set",
            "library": "hf-memory",
            "library_version": __version__,
            "fingerprint": self.fingerprint,
            "gamma": self.gamma,
            "size_normalize": self.size_normalize,
            **({"contrast": True} if self.contrast else {}),
            **({"sink_reads_banks": False} if not self.sink_reads_banks else {}),
            "banks": [{
                "name": b.name, "role": b.role, "gain": b.gain, "layers": list(b.layers),
                "num_slots": b.num_slots, "num_kv_heads": b.num_kv_heads,
                "head_dim": b.head_dim, "dtype": str(b.keys.dtype).removeprefix("torch."),
                "content_hash": b.content_hash(), "provenance": b.provenance,
                "has_phases": b.phases is not None, "has_positions": b.positions is not None,
            } for b in self.banks],
        }

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write ``banks.safetensors``, ``config.json`` and a ``README.md`` bank card.

        Each file is written atomically, the tensors first: they carry the config, so the
        rename that puts them in place is the save (see the module docstring), and a killed
        save leaves the previous bank set or the new one."""
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, bank in enumerate(self.banks):
            tensors[f"{i}.keys"] = bank.keys.detach().contiguous().cpu()
            tensors[f"{i}.values"] = bank.values.detach().contiguous().cpu()
            for label in ("phases", "positions"):
                if getattr(bank, label) is not None:
                    tensors[f"{i}.{label}"] = getattr(bank, label).detach().contiguous().cpu()
        config = self._config()
        write_safetensors(directory / WEIGHTS_NAME, tensors, metadata={
            "format": "pt", CARRIED_CONFIG: json.dumps(config, sort_keys=True)})
        write_json(directory / CONFIG_NAME, config)
        write_text(directory / CARD_NAME, render_bank_card(config))
        return directory

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | os.PathLike,
        *,
        model: nn.Module | None = None,
        revision: str | None = None,
        token: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> BankSet:
        """Load a saved bank set (a local directory, or a Hub repo id through the Hub cache).

        With ``model``, the fingerprint and shapes are checked against it.

        Raises:
            BankSetFormatError: a file is missing, truncated, corrupt (tensor data that does
                not match its recorded content hash, NaN or inf, a dtype other than float16,
                bfloat16, float32 or float64) or inconsistent (entries of the wrong type,
                shapes that disagree).
            FingerprintMismatchError: (with ``model``) the set was made for another model.
            ValueError: (with ``model``, a set saved without a fingerprint) its banks' KV heads,
                head width or layers do not fit ``model``.
        """
        directory = Path(path_or_repo)
        if not directory.is_dir():
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(
                str(path_or_repo), revision=revision, token=token, cache_dir=cache_dir,
                allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, CARD_NAME]))
        config = _read_config(directory)
        try:
            with safe_open(directory / WEIGHTS_NAME, framework="pt") as weights:
                carried = (weights.metadata() or {}).get(CARRIED_CONFIG)
                tensors = {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as error:
            raise BankSetFormatError(f"{directory / WEIGHTS_NAME} is unreadable: {error}") from None
        if carried is not None:  # weights saved with their config: the save's one atomic step
            carried = _read_config(directory, carried)
            if _hashes(carried) != _hashes(config):  # a save killed before config.json's rename
                warnings.warn(f"{directory / CONFIG_NAME} does not describe the banks beside it "
                              "(a save was interrupted, or the file was edited); loading the "
                              f"config {WEIGHTS_NAME} carries", stacklevel=2)
                config = carried
        banks = []
        for i, meta in enumerate(config["banks"]):
            if not isinstance(meta, dict):
                raise BankSetFormatError(f"bank {i} in {directory} is not a JSON object")
            unknown = set(meta) - _BANK_KEYS
            if unknown:
                warnings.warn(f"bank {i}: ignoring unknown keys {sorted(unknown)}", stacklevel=2)
            try:
                _check_bank_entry(meta, i, tensors)
                bank = MemoryBank(
                    name=meta["name"], role=meta["role"], gain=meta["gain"],
                    layers=tuple(meta["layers"]), keys=tensors[f"{i}.keys"],
                    values=tensors[f"{i}.values"], phases=tensors.get(f"{i}.phases"),
                    positions=tensors.get(f"{i}.positions"), provenance=meta["provenance"])
                recorded = meta["content_hash"]
            except KeyError as error:
                raise BankSetFormatError(f"bank {i} in {directory} lacks {error}") from None
            except (ValueError, OverflowError) as error:  # MemoryBank's checks, a huge gain
                raise BankSetFormatError(f"bank {i} in {directory}: {error}") from None
            if bank.content_hash() != recorded:
                raise BankSetFormatError(
                    f"bank {meta['name']!r} in {directory} does not match its recorded content "
                    "hash: the file is corrupt or was edited")
            banks.append(bank)
        try:
            bank_set = cls(banks, fingerprint=config["fingerprint"], gamma=config["gamma"],
                           size_normalize=config["size_normalize"],
                           contrast=config.get("contrast", False),
                           sink_reads_banks=config.get("sink_reads_banks", True))
        except (ValueError, OverflowError) as error:  # duplicate names, a huge gamma, ...
            raise BankSetFormatError(f"{directory / CONFIG_NAME}: {error}") from None
        if model is not None:
            bank_set.check_model(model)
        return bank_set

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        commit_message: str = "Upload memory bank set",
    ) -> str:
        """Create (if needed) a Hub model repo and upload the saved bank set to it."""
        from hf_memory.artifacts.hub_upload import upload_saved

        return upload_saved(self.save_pretrained, repo_id, private=private, token=token,
                            commit_message=commit_message)


def _check_contrast(banks: Sequence[MemoryBank]) -> None:
    roles = sorted(bank.role for bank in banks)
    if roles != ["reference", "target"]:
        raise ValueError(f"a contrast bank set holds one target and one reference bank and no "
                         f"other; got roles {roles}")
    target, reference = sorted(banks, key=lambda bank: bank.role != "target")
    if tuple(target.layers) != tuple(reference.layers):
        raise ValueError(f"a contrast bank set's banks cover the same layers; the target covers "
                         f"{list(target.layers)}, the reference {list(reference.layers)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_bank_entry(meta: dict[str, Any], i: int, tensors: dict[str, Any]) -> None:
    """Raise ``ValueError`` (``KeyError`` for a missing entry) where bank ``i``'s entry or
    tensors have the wrong type: what ``MemoryBank`` would coerce or trip over."""
    if not _is_number(meta["gain"]):
        raise ValueError(f"gain must be a number, got {meta['gain']!r:.40}")
    layers = meta["layers"]
    if not isinstance(layers, list) or not layers or not all(
            isinstance(layer, int) and not isinstance(layer, bool) for layer in layers):
        raise ValueError(f"layers must be a non-empty list of integers, got {layers!r:.80}")
    # the content hash covers the tensors' bytes and the keys' dtype, not the dtype of phases
    # or positions: a positions tensor read as floats would hash the same
    for label, dtypes, kind in (("keys", _FLOATS, "float"), ("values", _FLOATS, "float"),
                                ("phases", _FLOATS, "float"), ("positions", _INTS, "integer")):
        tensor = tensors.get(f"{i}.{label}")
        if label in ("keys", "values") and tensor is None:
            raise KeyError(f"{i}.{label}")
        if tensor is not None and tensor.dtype not in dtypes:
            raise ValueError(f"{label} are {tensor.dtype}, not a {kind} type of "
                             f"{[str(d).removeprefix('torch.') for d in dtypes]}")


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = (torch.int16, torch.int32, torch.int64)


def _hashes(config: dict[str, Any]) -> list[Any] | None:
    banks = config["banks"]
    return [bank.get("content_hash") if isinstance(bank, dict) else None
            for bank in banks] if isinstance(banks, list) else None


def _read_config(directory: Path, carried: str | None = None) -> dict[str, Any]:
    """``config.json`` of ``directory``, checked; given ``carried`` (the config the weights
    carry), that text, checked the same way."""
    path = directory / (CONFIG_NAME if carried is None else WEIGHTS_NAME)
    try:
        config = json.loads(path.read_text() if carried is None else carried)
    except FileNotFoundError:
        raise BankSetFormatError(f"{directory} holds no {CONFIG_NAME}") from None
    except OSError as error:
        raise BankSetFormatError(f"{path} is unreadable: {error}") from None
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep
        raise BankSetFormatError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict) or config.get("kind") != "memory_inception_bank_set":
        raise BankSetFormatError(f"{path} does not describe a memory-inception bank set")
    version = config.get("format_version")
    versions = (FORMAT_VERSION, CONTRAST_FORMAT_VERSION, SINK_FORMAT_VERSION)
    if version not in versions:
        raise BankSetFormatError(f"{path} has format version {version!r}; this library reads "
                                 f"versions {', '.join(map(str, versions))}")
    sink = config.get("sink_reads_banks", True)
    if (version == SINK_FORMAT_VERSION) != (sink is False) or sink not in (True, False):
        raise BankSetFormatError(f"{path}: format version {version} with sink_reads_banks "
                                 f"{sink!r:.40} (version 3 is a set the first token does not "
                                 "read)")
    if version != SINK_FORMAT_VERSION and \
            (version == CONTRAST_FORMAT_VERSION) != (config.get("contrast") is True):
        raise BankSetFormatError(f"{path}: format version {version} with contrast "
                                 f"{config.get('contrast')!r} (version 2 is a contrast set)")
    missing = {"fingerprint", "gamma", "size_normalize", "banks"} - set(config)
    if missing:
        raise BankSetFormatError(f"{path} lacks {sorted(missing)}")
    unknown = set(config) - _CONFIG_KEYS
    if unknown:
        warnings.warn(f"{path}: ignoring unknown keys {sorted(unknown)}", stacklevel=3)
    if not isinstance(config["banks"], list):
        raise BankSetFormatError(f"{path}: banks must be a list, got {config['banks']!r:.80}")
    if config["fingerprint"] is not None and not isinstance(config["fingerprint"], dict):
        raise BankSetFormatError(f"{path}: fingerprint must be an object or null, got "
                                 f"{config['fingerprint']!r:.80}")
    if not _is_number(config["gamma"]) or not isinstance(config["size_normalize"], bool):
        raise BankSetFormatError(f"{path}: gamma must be a number and size_normalize true or "
                                 f"false, got {config['gamma']!r:.40} and "
                                 f"{config['size_normalize']!r:.40}")
    return config
