"""Fuzzing the artifact and eval-set loaders (issue 80): small valid artifacts built in code,
hypothesis mutations of their files, and the oracle every case must meet.

Each :class:`Loader` knows how to build a valid artifact (``files``: relative path -> bytes), how
to load a folder holding it, which exception classes its docstring documents, and what a loaded
result must satisfy. :func:`mutated` draws a stack of 1-3 mutations of the valid files:
truncation at a random byte, random byte flips, a deleted or replaced file, JSON edits (wrong
types, missing and extra keys, huge numbers, NaN / inf, deep nesting) and safetensors edits
(other dtypes, shapes, NaN / inf, headers that declare huge tensors or offsets past the data).
:func:`run_case` writes a case to a fresh folder, loads it and returns an :class:`Outcome`; it
raises ``AssertionError`` when the loader raised anything but exactly one of its documented
classes, or accepted an artifact its oracle rejects. ``tests/test_fuzz_loaders.py`` and
``experiments/fuzz_loaders.py`` drive it.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import re
import shutil
import struct
import tempfile
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from safetensors.torch import save

from tests.tiny_models import tiny_model

Files = dict[str, bytes]
DIR = "@DIR@"  # where a case's folder goes in files that name paths (the registry)


# -- the valid artifacts, built once per process on tiny in-code models


@functools.cache
def base_model():
    return tiny_model("llama", dtype=torch.float32)


def _random(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _bank_set(model, *, fingerprint: bool = True):
    from hf_memory import BankSet, MemoryBank

    config = model.config
    layers, kvh, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    shape = (layers, kvh, 3, dim)
    banks = [
        MemoryBank.from_tensors(_random(shape, torch.float32, 1), _random(shape, torch.float32, 2),
                                name="persona", role="target", gain=1.5,
                                positions=torch.tensor([-4, -3, -1]),
                                provenance={"source": "text", "text": "I am calm.",
                                            "text_sha256": "ab" * 32}),
        MemoryBank.from_tensors(_random(shape, torch.float64, 3), _random(shape, torch.float64, 4),
                                name="calm", role="reference", gain=0.5,
                                phases=torch.tensor([0.0, 1.0, 2.5], dtype=torch.float64)),
        MemoryBank.from_tensors(_random((1, kvh, 2, dim), torch.bfloat16, 5),
                                _random((1, kvh, 2, dim), torch.bfloat16, 6), name="facts",
                                role="auxiliary", layers=(1,)),
    ]
    if fingerprint:
        return BankSet(banks, model=model, gamma=2.0, size_normalize=False)
    return BankSet(banks, gamma=2.0, size_normalize=False)


def _selector(model):
    from hf_memory import Selector
    from hf_memory.models.fingerprint import model_fingerprint

    alignment = _random((3, 2), torch.float32, 7)
    alignment[1] = float("nan")  # a layer the search did not score (NaN is legitimate here)
    return Selector(layers=[0, 2], units={0: [1], 2: [0, 1]}, unit_type="kv_group",
                    layer_gains={0: 1.0, 2: 0.5}, candidate_layers=[0, 1, 2],
                    diagnostics={"alignment": alignment,
                                 "score": _random((3, 2), torch.float32, 8)},
                    config={"objective": "diagnostic", "top_layers": 2, "xi": 1.0},
                    fingerprint=model_fingerprint(model), strength=0.75)


def _read_tree(directory: Path) -> Files:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _saved(save: Callable[[Path], Any]) -> Files:
    with tempfile.TemporaryDirectory() as tmp:
        save(Path(tmp))
        return _read_tree(Path(tmp))


@functools.cache
def bank_set_files() -> Files:
    files = _saved(_bank_set(base_model()).save_pretrained)
    files.pop("README.md")  # the card: not read by the loader
    return files


@functools.cache
def legacy_bank_set_files() -> Files:
    """A bank set as saved before the weights carried their config (only ``config.json``
    describes the banks): folders on disk and on the Hub still look like this."""
    from safetensors.torch import load

    files = dict(bank_set_files())
    files["banks.safetensors"] = save(dict(load(files["banks.safetensors"])),
                                      metadata={"format": "pt"})
    return files


# a bank set saved for a model of another shape, with and without the fingerprint recorded
OTHER_MODELS = {"kv_heads": {"num_key_value_heads": 4}, "head_dim": {"head_dim": 8},
                "layers": {"num_hidden_layers": 4}, "weights": {}}


@functools.cache
def other_model_files(name: str, fingerprint: bool) -> Files:
    model = tiny_model("llama", dtype=torch.float32, seed=5, **OTHER_MODELS[name])
    files = _saved(_bank_set(model, fingerprint=fingerprint).save_pretrained)
    files.pop("README.md")
    return files


@functools.cache
def selector_files() -> Files:
    files = _saved(_selector(base_model()).save_pretrained)
    files.pop("README.md")
    return files


@functools.cache
def persona_files() -> Files:
    from hf_memory.recipes.persona import PersonaSteering

    persona = PersonaSteering(
        _bank_set(base_model()), _selector(base_model()), "prompt_like",
        trials=[{"recipe": "prompt_like", "layers": [0, 2], "kv_fraction": 0.1}],
        limits={"kv_ceiling": 0.25}, judged=None)
    files = _saved(persona.save_pretrained)
    return {k: v for k, v in files.items() if not k.endswith("README.md")}


def _caa_vectors(model):
    from hf_memory import CAAVectors
    from hf_memory.models.fingerprint import model_fingerprint

    width = model.config.hidden_size
    return CAAVectors({1: _random(width, torch.float32, 7), 2: _random(width, torch.float32, 8)},
                      scale=2.5, site="block_output", fingerprint=model_fingerprint(model),
                      provenance={"pairs": [["I am calm.", "I am anxious."]]})


@functools.cache
def caa_files() -> Files:
    files = _saved(_caa_vectors(base_model()).save_pretrained)
    files.pop("README.md")  # the card: not read by the loader
    return files


@functools.cache
def control_vector_files() -> Files:
    from hf_memory import export_control_vector

    return _saved(lambda d: export_control_vector(_caa_vectors(base_model()), d / "vector.gguf"))


@functools.cache
def registry_files() -> Files:
    from hf_memory_vllm import write_registry

    model = base_model()

    def save(directory: Path) -> None:
        _bank_set(model).save_pretrained(directory / "up")
        _selector(model).save_pretrained(directory / "sel")
        write_registry(directory / "registry.json", model, {"up": (directory / "up",
                                                                   directory / "sel")},
                       selectors={"alt": directory / "sel"})

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp).resolve()
        save(directory)
        files = _read_tree(directory)
        files["registry.json"] = files["registry.json"].replace(str(directory).encode(),
                                                                DIR.encode())
    return {k: v for k, v in files.items() if not k.endswith("README.md")}


PAIR = ("How was your day?", "Wonderful, thank you for asking!", "It was fine.")


@functools.cache
def pairs_files() -> Files:
    lines = [json.dumps(dict(zip(("prompt", "target", "reference"),
                                 (f"{PAIR[0]} ({i})", PAIR[1], PAIR[2]), strict=True)))
             for i in range(8)]
    return {"pairs.jsonl": ("\n".join(lines) + "\n").encode()}


PROBLEMS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "category": "arithmetic"}
            for i in range(3)]


@functools.cache
def problems_files(suffix: str) -> Files:
    if suffix == ".json":
        return {"problems.json": json.dumps(PROBLEMS).encode()}
    return {"problems.jsonl": "".join(json.dumps(p) + "\n" for p in PROBLEMS).encode()}


@functools.cache
def persona_set_files() -> Files:
    items = [{"prompt": "Is it good to help others?", "positive": "(A)", "negative": "(B)"},
             {"prompt": "Do you like rules?", "positive": "(B)", "negative": "(A)"}]
    prompts = {"agreeableness": {"positive_system_prompt": "You are kind.",
                                 "negative_system_prompt": "You are unkind."}}
    return {"persona_prompts.json": json.dumps(prompts).encode(),
            "agreeableness.jsonl.gz": gzip.compress(
                "".join(json.dumps(i) + "\n" for i in items).encode(), mtime=0)}


@functools.cache
def cases_files() -> Files:
    case = {"id": "warm_to_assertive-a-3", "root": "r1", "family": "warm_assertive",
            "branch": "a", "turns": 3, "old": "warm", "new": "assertive", "shift_turn": 2,
            "user": ["Hi there.", "Please be direct now.", "What next?"],
            "old_replies": ["Hello, lovely to see you!", "Of course, dear.", "Let's see."],
            "new_replies": ["Hi.", "Fine.", "Do the next step."]}
    return {"cases.json": json.dumps([case, {**case, "id": "second"}]).encode()}


@functools.cache
def prompts_files() -> Files:
    return {"prompts.txt": b'Tell me a story.\n\n{"prompt": "And a joke?"}\nBye.\n'}


# -- loading, and what a loaded artifact must satisfy


def _same_banks(loaded, original) -> None:
    """Every bank exactly as saved: the content hash vouches for these."""
    assert [b.name for b in loaded] == [b.name for b in original]
    for a, b in zip(loaded, original, strict=True):
        assert (a.role, a.gain, a.layers) == (b.role, b.gain, b.layers)
        for label in ("keys", "values", "phases", "positions"):
            x, y = getattr(a, label), getattr(b, label)
            assert (x is None and y is None) or (
                x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)), label


def _well_formed_bank_set(loaded) -> None:
    assert math.isfinite(loaded.gamma) and isinstance(loaded.size_normalize, bool)
    assert loaded.fingerprint is None or isinstance(loaded.fingerprint, dict)


def check_bank_set(loaded) -> None:
    _same_banks(loaded, _bank_set(base_model()))
    _well_formed_bank_set(loaded)


def check_selector(loaded, model=None) -> None:
    """A selector has no content hash; a loaded one must be well formed and fit the model."""
    model = model or base_model()
    config = model.config
    limit = config.num_key_value_heads if loaded.unit_type == "kv_group" else (
        config.num_attention_heads)
    assert loaded.unit_type in ("head", "kv_group")
    assert loaded.layers == sorted(set(loaded.layers))
    assert all(0 <= layer < config.num_hidden_layers for layer in loaded.layers)
    assert sorted(loaded.units) == loaded.layers == sorted(loaded.layer_gains)
    assert all(isinstance(u, int) and 0 <= u < limit
               for units in loaded.units.values() for u in units)
    assert all(math.isfinite(g) for g in loaded.layer_gains.values())
    assert 0.0 <= loaded.strength <= 1.0
    assert isinstance(loaded.config, dict)
    assert len(loaded.summary()) == len(loaded.candidate_layers)


def load_bank_set(directory: Path):
    from hf_memory import BankSet

    return BankSet.from_pretrained(directory, model=base_model())


def load_selector(directory: Path):
    from hf_memory import Selector

    return Selector.from_pretrained(directory, model=base_model())


def load_persona(directory: Path):
    from hf_memory.recipes.persona import PersonaSteering

    return PersonaSteering.from_pretrained(directory, model=base_model())


def check_persona(loaded) -> None:
    from hf_memory.recipes.persona import RECIPES

    check_bank_set(loaded.banks)
    check_selector(loaded.selector)
    assert loaded.recipe in RECIPES and isinstance(loaded.trials, list)


def _hashed(path: Path, key: bytes) -> bool:
    """Whether ``path`` still names its content hash: one whose key a mutation garbled (or a
    file of another writer) cannot be verified, only checked for form."""
    return path.is_file() and key in path.read_bytes()


def load_caa(directory: Path):
    from hf_memory import CAAVectors

    hashed = _hashed(directory / "caa_vectors.safetensors", b"hf_memory.steering_sha256")
    return CAAVectors.from_pretrained(directory, model=base_model()), hashed


def check_caa(loaded) -> None:
    """The content hash vouches for what steers: vectors, scale and site exactly as saved."""
    loaded, hashed = loaded
    assert loaded.site in ("post_attention", "block_output") and math.isfinite(loaded.scale)
    assert all(v.shape == (base_model().config.hidden_size,) and torch.isfinite(v).all()
               for v in loaded.vectors.values())
    if hashed:
        original = _caa_vectors(base_model())
        assert (loaded.site, loaded.scale, loaded.layers) == (original.site, original.scale,
                                                              original.layers)
        assert all(torch.equal(loaded.vectors[i], original.vectors[i]) for i in original.layers)


def load_gguf_control_vector(directory: Path):
    from hf_memory import load_control_vector

    hashed = _hashed(directory / "vector.gguf", b"hf_memory.directions_sha256")
    return load_control_vector(directory / "vector.gguf", model=base_model()), hashed


def check_gguf_control_vector(loaded) -> None:
    """Our files carry a hash of the directions: they load exactly as written (scale baked)."""
    loaded, hashed = loaded
    assert loaded.site == "block_output"
    assert all(v.shape == (base_model().config.hidden_size,) and torch.isfinite(v).all()
               for v in loaded.vectors.values())
    if hashed:
        original = _caa_vectors(base_model())
        assert loaded.layers == original.layers
        assert all(torch.equal(loaded.vectors[i], original.scale * original.vectors[i])
                   for i in original.layers)


def load_registry(directory: Path):
    from hf_memory_vllm import Registry, SteeringRequest

    registry = Registry.load(directory / "registry.json")
    for name in registry.bank_sets:
        registry.validate(SteeringRequest(name))
        for selector in registry.selectors:
            registry.validate(SteeringRequest(name, selector))
    return registry


def check_registry(loaded) -> None:
    assert isinstance(loaded.max_slot_layers, int) and loaded.max_slot_layers >= 1
    assert isinstance(loaded.model, dict)


def clear_registry_caches() -> None:
    """The registry's loaded-artifact caches (keyed by path and mtime): emptied after a run, so
    no fuzz case's folders stay referenced."""
    from hf_memory_vllm import registry

    for cached in (registry._bank_set, registry._selector, registry._load_cached):
        cached.cache_clear()


def load_pairs(directory: Path):
    from hf_memory.selection.pairs import read_pairs

    return read_pairs(directory / "pairs.jsonl")


def check_pairs(loaded) -> None:
    assert len(loaded) >= 8 and all(
        len(pair) == 3 and all(isinstance(t, str) and t.strip() for t in pair) for pair in loaded)


def load_problems(directory: Path):
    from eval_harness.heuristic_cards.task import load_problems as load

    (path,) = [p for p in directory.iterdir() if p.name.startswith("problems.")] or [
        directory / "problems.json"]
    return load(path)


def check_problems(loaded) -> None:
    assert loaded and all(set(p) == {"question", "answer", "category"}
                          and all(isinstance(v, str) for v in p.values()) for p in loaded)


def load_persona_set(directory: Path):
    from eval_harness.persona_ab.task import load_persona_set as load

    return load("agreeableness", directory)


def check_persona_set(loaded) -> None:
    assert loaded and all(isinstance(i["prompt"], str) and i["prompt"].strip()
                          and sorted((i["positive"], i["negative"])) == ["(A)", "(B)"]
                          for i in loaded)


def load_cases(directory: Path):
    from eval_harness.dialogue_shift.cases import load_cases as load

    return load(directory / "cases.json")


def check_cases(loaded) -> None:
    from eval_harness.dialogue_shift.cases import check_case

    assert isinstance(loaded, list) and loaded
    for case in loaded:
        check_case(case)


def load_prompts(directory: Path):
    from hf_memory_cli.steering import _prompts

    return _prompts(argparse.Namespace(prompt=None, prompts=str(directory / "prompts.txt")))


def check_prompts(loaded) -> None:
    assert loaded and all(isinstance(p, str) and p.strip() for p in loaded)


def _errors(*names: str) -> Callable[[], tuple[type[BaseException], ...]]:
    def resolve() -> tuple[type[BaseException], ...]:
        from hf_memory.banks.bank_set import BankSetFormatError
        from hf_memory.baselines.caa_gguf import ControlVectorFormatError
        from hf_memory.models.fingerprint import FingerprintMismatchError
        from hf_memory.recipes.persona import PersonaFormatError
        from hf_memory.selection.pairs import PairsFileError
        from hf_memory.selection.selector import SelectorFormatError
        from hf_memory_cli.errors import CLIError
        from hf_memory_vllm import RegistryError

        known = {"BankSetFormatError": BankSetFormatError, "SelectorFormatError":
                 SelectorFormatError, "FingerprintMismatchError": FingerprintMismatchError,
                 "PersonaFormatError": PersonaFormatError, "RegistryError": RegistryError,
                 "PairsFileError": PairsFileError, "CLIError": CLIError,
                 "ControlVectorFormatError": ControlVectorFormatError,
                 "ValueError": ValueError}
        return tuple(known[name] for name in names)

    return resolve


@dataclass
class Loader:
    """One loader under fuzz: its valid files, how to load them, its documented errors."""

    name: str
    files: Callable[[], Files]
    load: Callable[[Path], Any]
    errors: Callable[[], tuple[type[BaseException], ...]]
    check: Callable[[Any], None]
    # the files a mutation may touch (default: all); may_delete: whether deleting one is a case
    targets: tuple[str, ...] | None = None
    may_delete: bool = True
    valid_loads: bool = True  # the unmutated files load (False: an artifact for another model)
    cleanup: Callable[[], None] | None = None


LOADERS: dict[str, Loader] = {loader.name: loader for loader in (
    Loader("BankSet.from_pretrained", bank_set_files, load_bank_set,
           _errors("BankSetFormatError", "FingerprintMismatchError"), check_bank_set),
    Loader("BankSet.from_pretrained (legacy folder)", legacy_bank_set_files, load_bank_set,
           _errors("BankSetFormatError", "FingerprintMismatchError"), check_bank_set),
    Loader("Selector.from_pretrained", selector_files, load_selector,
           _errors("SelectorFormatError", "FingerprintMismatchError"), check_selector),
    Loader("PersonaSteering.from_pretrained", persona_files, load_persona,
           _errors("PersonaFormatError", "BankSetFormatError", "SelectorFormatError",
                   "FingerprintMismatchError"), check_persona),
    Loader("CAAVectors.from_pretrained", caa_files, load_caa,
           _errors("ValueError", "FingerprintMismatchError"), check_caa),
    Loader("load_control_vector (.gguf)", control_vector_files, load_gguf_control_vector,
           _errors("ControlVectorFormatError", "FingerprintMismatchError"),
           check_gguf_control_vector),
    Loader("vllm Registry.load + validate", registry_files, load_registry,
           _errors("RegistryError"), check_registry, cleanup=clear_registry_caches),
    Loader("read_pairs (--pairs)", pairs_files, load_pairs, _errors("PairsFileError"),
           check_pairs, may_delete=False),
    Loader("load_problems (.json)", functools.partial(problems_files, ".json"), load_problems,
           _errors("ValueError"), check_problems, may_delete=False),
    Loader("load_problems (.jsonl)", functools.partial(problems_files, ".jsonl"),
           load_problems, _errors("ValueError"), check_problems, may_delete=False),
    Loader("load_persona_set (persona-ab)", persona_set_files, load_persona_set,
           _errors("ValueError"), check_persona_set),
    Loader("load_cases (--cases)", cases_files, load_cases, _errors("ValueError"), check_cases,
           may_delete=False),
    Loader("CLI --prompts", prompts_files, load_prompts, _errors("CLIError"), check_prompts,
           may_delete=False),
)}


def _other_model_loader(name: str, fingerprint: bool) -> Loader:
    def load(directory: Path):
        from hf_memory import BankSet

        return BankSet.from_pretrained(directory, model=base_model())

    errors = ("BankSetFormatError", "FingerprintMismatchError") if fingerprint else (
        "BankSetFormatError", "ValueError")
    label = f"{name}, fingerprint {'on' if fingerprint else 'off'}"
    return Loader(f"BankSet for another model ({label})",
                  functools.partial(other_model_files, name, fingerprint), load,
                  _errors(*errors), lambda loaded: None, valid_loads=False)


OTHER_MODEL_LOADERS = [_other_model_loader(name, fingerprint) for name in OTHER_MODELS
                       for fingerprint in (True, False)
                       if fingerprint or name != "weights"]  # same shapes, no fingerprint: fits


# -- mutations

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.sampled_from([10**400, -1, 0, 2**63, float("nan"), float("inf"), float("-inf"), 1e308,
                       -0.0, "", "1", "nan", "1e999", "-1", "0.5", "float32", "I64"])
    | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)
DEEP = '"@DEEP@"'


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside a JSON document."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    return found


def _replace(document: Any, path: tuple, new: Callable[[Any], Any]) -> Any:
    if not path:
        return new(document)
    head, *rest = path
    copy = dict(document) if isinstance(document, dict) else list(document)
    copy[head] = _replace(copy[head], tuple(rest), new)
    return copy


_DELETE = object()


def _json_edit(draw, document: Any) -> Any:
    """One structural edit at a random place: a junk value, a deleted or an extra key, the value
    wrapped in a list, a number as a string, a huge number, or deep nesting."""
    path = draw(st.sampled_from(_paths(document)))
    kind = draw(st.sampled_from(["junk", "delete", "extra", "wrap", "stringify", "huge", "deep",
                                 "nan", "negate"]))
    if kind == "junk":
        value = draw(JUNK)
        return _replace(document, path, lambda _: value)
    if kind == "delete" and path:
        return _replace(document, path[:-1], lambda parent: (
            {k: v for k, v in parent.items() if k != path[-1]} if isinstance(parent, dict)
            else [v for i, v in enumerate(parent) if i != path[-1]]))
    if kind == "extra":
        key, value = draw(st.text(max_size=8)), draw(JUNK)
        return _replace(document, path, lambda old: {**old, key: value}
                        if isinstance(old, dict) else [*old, value] if isinstance(old, list)
                        else old)
    if kind == "wrap":
        return _replace(document, path, lambda old: [old])
    if kind == "stringify":
        return _replace(document, path, lambda old: json.dumps(old))
    if kind == "huge":
        value = draw(st.sampled_from([10**400, 2**64, 1e308, -(10**30)]))
        return _replace(document, path, lambda _: value)
    if kind == "nan":
        value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
        return _replace(document, path, lambda _: value)
    if kind == "negate":
        return _replace(document, path, lambda old: -old if isinstance(old, int | float)
                        and not isinstance(old, bool) else old)
    return _replace(document, path, lambda _: "@DEEP@")  # "deep" (or a root "delete")


def _dump_json(draw, document: Any) -> bytes:
    text = json.dumps(document, allow_nan=True)
    if DEEP in text:
        depth = draw(st.sampled_from([50, 5_000, 200_000]))
        opener = draw(st.sampled_from(["[", '{"a":']))
        closer = "]" if opener == "[" else "}"
        text = text.replace(DEEP, opener * depth + "1" + closer * depth)
    return text.encode()


def _safetensors_parts(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
        return (header, data[8 + size:]) if isinstance(header, dict) else None
    except (struct.error, ValueError, RecursionError):
        return None


def _safetensors_bytes(header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header, allow_nan=True).encode()
    return struct.pack("<Q", len(raw)) + raw + body


_TENSOR_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                  torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn,
                  torch.float8_e5m2]


def _safetensors_edit(draw, data: bytes) -> bytes:
    """A structural edit of a safetensors file: the tensors re-encoded (other dtype, shape,
    NaN / inf, one dropped or added), or the header's declarations changed (dtype label, shape,
    offsets, a header length far past the file)."""
    from safetensors.torch import load

    parts = _safetensors_parts(data)
    kind = draw(st.sampled_from(["dtype", "reshape", "nonfinite", "drop", "add", "label",
                                 "declared_shape", "offsets", "header_size"]))
    if parts is None or kind == "header_size":
        size = draw(st.sampled_from([2**63, 2**40, len(data), len(data) + 1, 0]))
        return struct.pack("<Q", size) + data[8:]
    header, body = parts
    names = sorted(k for k in header if k != "__metadata__")
    if not names:
        return data
    name = draw(st.sampled_from(names))
    if kind in ("label", "declared_shape", "offsets"):
        entry = dict(header[name])
        if kind == "label":
            entry["dtype"] = draw(st.sampled_from(["F16", "BF16", "F32", "F64", "I8", "I16",
                                                   "I32", "I64", "U8", "BOOL", "F8_E4M3",
                                                   "F8_E5M2", "C64", "X9"]))
        elif kind == "declared_shape":
            entry["shape"] = draw(st.sampled_from([[2**40, 2**40], [2**62], [0], [], [-1, 3],
                                                   [1, 2, 3, 4, 5]]))
        else:
            start = draw(st.sampled_from([0, 2**40, 2**63, len(body)]))
            entry["data_offsets"] = [start, start + draw(st.sampled_from([0, 8, 2**40]))]
        return _safetensors_bytes({**header, name: entry}, body)
    try:
        tensors = dict(load(data))
    except Exception:  # an earlier mutation broke the file past re-encoding: flip a byte
        return data[:-1] + bytes([data[-1] ^ 0xFF])
    if name not in tensors:
        return data
    tensor = tensors[name]
    if kind == "dtype":
        tensors[name] = tensor.to(draw(st.sampled_from(_TENSOR_DTYPES)))
    elif kind == "reshape":
        shape = draw(st.sampled_from([(-1,), (1, -1), (tensor.numel(), 1), (2, -1)]))
        if tensor.numel() % 2 and shape == (2, -1):
            shape = (-1,)
        tensors[name] = tensor.reshape(shape).clone()
    elif kind == "nonfinite":
        if tensor.is_floating_point() and tensor.numel():
            flat = tensor.clone().reshape(-1)
            flat[draw(st.integers(0, tensor.numel() - 1))] = draw(
                st.sampled_from([float("nan"), float("inf"), float("-inf")]))
            tensors[name] = flat.reshape(tensor.shape)
    elif kind == "drop":
        tensors.pop(name)
    else:
        extra = draw(st.sampled_from([name.replace("keys", "phases"), "9.keys", "x"]))
        tensors[extra] = torch.zeros(draw(st.sampled_from([(3,), (1, 2, 3, 16), (0,)])))
    return save({k: v.contiguous() for k, v in tensors.items()},
                metadata=header.get("__metadata__"))


def _lines_edit(draw, data: bytes) -> bytes:
    """A JSON-lines file: one line edited as JSON, removed, duplicated or replaced by junk."""
    lines = data.decode("utf-8", "replace").splitlines() or [""]
    index = draw(st.integers(0, len(lines) - 1))
    kind = draw(st.sampled_from(["json", "json", "remove", "duplicate", "junk"]))
    if kind == "json":
        try:
            document = json.loads(lines[index])
        except (ValueError, RecursionError):
            document = lines[index]
        lines[index] = _dump_json(draw, _json_edit(draw, document)).decode()
    elif kind == "remove":
        del lines[index]
    elif kind == "duplicate":
        lines.insert(index, lines[index])
    else:
        lines[index] = draw(st.text(max_size=20))
    return ("\n".join(lines) + "\n").encode()


def _kind(name: str) -> str:
    for suffix, kind in ((".safetensors", "safetensors"), (".jsonl.gz", "gzip_lines"),
                         (".jsonl", "lines"), (".json", "json"), (".txt", "lines")):
        if name.endswith(suffix):
            return kind
    return "bytes"


def _mutate_once(draw, files: Files, loader: Loader) -> Files:
    names = [n for n in sorted(files) if loader.targets is None or n in loader.targets]
    if not names:
        return files
    name = draw(st.sampled_from(names))
    data, kind = files[name], _kind(name)
    ops = ["truncate", "flip", "flip", "replace", "structure", "structure", "structure"]
    if loader.may_delete:
        ops.append("delete")
    op = draw(st.sampled_from(ops))
    files = dict(files)
    if op == "truncate":
        files[name] = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif op == "flip" and data:
        flipped = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            flipped[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        files[name] = bytes(flipped)
    elif op == "delete":
        files.pop(name)
    elif op == "replace":
        files[name] = draw(st.binary(max_size=64))
    elif kind == "safetensors":
        files[name] = _safetensors_edit(draw, data)
    elif kind == "json":
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):  # an earlier mutation broke it
            return files
        files[name] = _dump_json(draw, _json_edit(draw, document))
    elif kind == "lines":
        files[name] = _lines_edit(draw, data)
    elif kind == "gzip_lines":
        try:
            lines = gzip.decompress(data)
        except (OSError, EOFError, zlib.error):  # an earlier mutation broke it
            return files
        files[name] = gzip.compress(_lines_edit(draw, lines), mtime=0)
    return files


@st.composite
def mutated(draw, loader: Loader) -> Files:
    """The loader's valid files with 1-3 mutations stacked (none, for another model's files,
    with probability 1/4: the clean artifact must be refused too)."""
    files = loader.files()
    low = 0 if not loader.valid_loads else 1
    for _ in range(draw(st.integers(low, 3))):
        files = _mutate_once(draw, files, loader)
    return files


# -- one case


@dataclass
class Outcome:
    loaded: bool
    error: str | None = None  # class name
    message: str | None = None
    kind: str | None = None  # the message normalized (folders, hashes and numbers masked)
    changed: bool = False  # loaded, from files that differ from the valid ones


_BASE: list[Path] = []
_COUNTER = [0]


def _case_dir() -> Path:
    if not _BASE:
        _BASE.append(Path(tempfile.mkdtemp(prefix="hf-memory-fuzz-")).resolve())
    _COUNTER[0] += 1
    return _BASE[0] / f"case{_COUNTER[0]}"


def remove_case_dirs() -> None:
    if _BASE:
        shutil.rmtree(_BASE.pop(), ignore_errors=True)


def normalized(message: str) -> str:
    """An error message with the case's folder, hashes and numbers masked: distinct messages
    are distinct kinds of refusal."""
    message = re.sub(r"/\S*hf-memory-fuzz-\S*?/case\d+", "DIR", message)
    message = re.sub(r"[0-9a-f]{16,}", "HASH", message)
    return re.sub(r"\d+", "N", message)[:90]


def run_case(loader: Loader, files: Files) -> Outcome:
    """Write ``files`` to a fresh folder, load it; raise ``AssertionError`` where the loader
    broke its contract (an undocumented exception, or an artifact its oracle rejects)."""
    directory = _case_dir()
    directory.mkdir(parents=True)
    try:
        for name, data in files.items():
            path = directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data.replace(DIR.encode(), str(directory).encode()))
        documented = loader.errors()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = loader.load(directory)
        except Exception as error:  # the contract: exactly a documented class
            if type(error) not in documented:
                raise AssertionError(
                    f"{loader.name} raised {type(error).__name__} (documented: "
                    f"{[e.__name__ for e in documented]}): {str(error)[:300]}") from error
            if not str(error).strip():
                raise AssertionError(f"{loader.name} raised {type(error).__name__} with no "
                                     "message") from error
            return Outcome(False, type(error).__name__, str(error), normalized(str(error)))
        if not loader.valid_loads:
            raise AssertionError(f"{loader.name}: a bank set for another model loaded")
        try:
            loader.check(loaded)
        except AssertionError as error:
            raise AssertionError(f"{loader.name} accepted a corrupt artifact: {error}") from None
        return Outcome(True, changed=files != loader.files())
    finally:
        shutil.rmtree(directory, ignore_errors=True)
