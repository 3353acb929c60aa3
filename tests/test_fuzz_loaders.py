"""Every loader fuzzed (issue 80): mutated artifacts and eval-set files end in one documented
error, never an unrelated exception, a hang or a silently accepted corrupt artifact.

The cases and the oracle are in :mod:`tests.loader_fuzz`. The default run tries a few hundred
cases per loader (about a minute in all on one core); ``HF_MEMORY_FUZZ=nightly`` tries 20 times
as many. ``experiments/fuzz_loaders.py`` runs the same fuzzers for N cases and tabulates them.
The regression tests below pin the bugs the fuzzers found, one case each.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tests import loader_fuzz
from tests.loader_fuzz import LOADERS, OTHER_MODEL_LOADERS, mutated, run_case

NIGHTLY = os.environ.get("HF_MEMORY_FUZZ") == "nightly"
# cases per loader: the slower folder loaders get fewer in the default run
EXAMPLES = {"BankSet.from_pretrained": 400, "BankSet.from_pretrained (legacy folder)": 400,
            "Selector.from_pretrained": 500,
            "PersonaSteering.from_pretrained": 250, "vllm Registry.load + validate": 250,
            "CAAVectors.from_pretrained": 250, "load_control_vector (.gguf)": 250}
DEFAULT_EXAMPLES, OTHER_MODEL_EXAMPLES = 400, 25


def fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples * (20 if NIGHTLY else 1), deadline=5_000,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    loader_fuzz.remove_case_dirs()
    loader_fuzz.clear_registry_caches()


def _fuzz(loader, examples: int) -> None:
    @fuzz_settings(examples)
    @given(st.data())
    def case(data):
        run_case(loader, data.draw(mutated(loader), label="files"))

    case()
    if loader.cleanup is not None:
        loader.cleanup()


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_mutated_files_end_in_one_documented_error(name):
    loader = LOADERS[name]
    assert run_case(loader, loader.files()).loaded  # the unmutated artifact loads
    _fuzz(loader, EXAMPLES.get(name, DEFAULT_EXAMPLES))


@pytest.mark.parametrize("loader", OTHER_MODEL_LOADERS, ids=lambda loader: loader.name)
def test_a_bank_set_for_another_model_is_refused(loader):
    outcome = run_case(loader, loader.files())
    assert not outcome.loaded and outcome.error in ("FingerprintMismatchError", "ValueError")
    _fuzz(loader, OTHER_MODEL_EXAMPLES)


# -- regression tests: one per bug the fuzzers found (each failed before its fix)


def _case(loader_name: str, edit) -> loader_fuzz.Outcome:
    """The valid files of a loader with ``edit(files)`` applied, run as a fuzz case."""
    files = dict(LOADERS[loader_name].files())
    edit(files)
    return run_case(LOADERS[loader_name], files)


def _json(files, name, change) -> None:
    document = json.loads(files[name])
    change(document)
    files[name] = json.dumps(document, allow_nan=True).encode()


def _tensors(files, name, change) -> None:
    from safetensors.torch import load, save

    tensors = dict(load(files[name]))
    change(tensors)
    files[name] = save(tensors, metadata={"format": "pt"})


# config.json alone describes a legacy folder's banks (newer weights carry their config too)
BANKS, CONFIG = "BankSet.from_pretrained (legacy folder)", "config.json"


@pytest.mark.parametrize("change, message", [
    (lambda c: c["banks"][0].pop("content_hash"), "lacks 'content_hash'"),
    (lambda c: c.update(banks={"0": c["banks"][0]}), "banks must be a list"),
    (lambda c: c["banks"].__setitem__(0, "persona"), "is not a JSON object"),
    (lambda c: c.update(fingerprint=[1, 2]), "fingerprint must be an object"),
    (lambda c: c.update(gamma="2.0"), "gamma must be a number"),
    (lambda c: c.update(size_normalize="false"), "size_normalize true or false"),
    (lambda c: c.update(gamma=10**400), "too large"),
    (lambda c: c["banks"][0].update(gain=10**400), "too large"),
    (lambda c: c["banks"][0].update(layers="012"), "layers must be a non-empty list"),
    (lambda c: c.update(gamma=float("nan")), "gamma must be finite"),
])
def test_malformed_bank_config_entries_raise_the_format_error(change, message):
    outcome = _case(BANKS, lambda files: _json(files, CONFIG, change))
    assert outcome.error == "BankSetFormatError" and message in outcome.message


@pytest.mark.parametrize("change, message", [
    (lambda t: t["0.keys"].view(-1).__setitem__(0, float("nan")), "NaN or inf"),
    (lambda t: t.update({"0.keys": t["0.keys"].to(torch.int32)}), "not a float type"),
    (lambda t: t.update({"0.keys": t["0.keys"].to(torch.float8_e4m3fn)}), "not a float type"),
    (lambda t: t.update({"0.keys": t["0.keys"][:, :, :2].contiguous()}), "keys and values"),
])
def test_bad_bank_tensors_raise_the_format_error(change, message):
    outcome = _case(BANKS, lambda files: _tensors(files, "banks.safetensors", change))
    assert outcome.error == "BankSetFormatError" and message in outcome.message


def test_positions_relabelled_as_floats_are_refused():
    """The content hash covers the positions' bytes, not their dtype: the same eight bytes a
    slot read as float64 instead of int64 hashed the same and loaded as other positions."""
    def relabel(files):
        data = files["banks.safetensors"]
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
        header["0.positions"]["dtype"] = "F64"
        raw = json.dumps(header).encode()
        files["banks.safetensors"] = struct.pack("<Q", len(raw)) + raw + data[8 + size:]

    outcome = _case(BANKS, relabel)
    assert outcome.error == "BankSetFormatError" and "positions are torch.float64" in (
        outcome.message)


def test_deeply_nested_json_is_a_format_error_in_every_loader(tmp_path):
    deep = b"[" * 200_000 + b"]" * 200_000
    checks = [
        (BANKS, CONFIG, "BankSetFormatError"),
        ("Selector.from_pretrained", "selector.json", "SelectorFormatError"),
        ("PersonaSteering.from_pretrained", "persona.json", "PersonaFormatError"),
        ("vllm Registry.load + validate", "registry.json", "RegistryError"),
        ("read_pairs (--pairs)", "pairs.jsonl", "PairsFileError"),
        ("load_problems (.json)", "problems.json", "ValueError"),
        ("load_cases (--cases)", "cases.json", "ValueError"),
        ("load_persona_set (persona-ab)", "persona_prompts.json", "ValueError"),
        ("CLI --prompts", "prompts.txt", "CLIError"),
    ]
    for loader, name, error in checks:
        outcome = _case(loader, lambda files, name=name: files.__setitem__(
            name, b"{" + deep if name == "prompts.txt" else deep))
        assert outcome.error == error, loader


def test_a_config_json_that_is_a_folder_is_a_format_error(tmp_path):
    from hf_memory import BankSet, BankSetFormatError

    (tmp_path / CONFIG).mkdir()
    with pytest.raises(BankSetFormatError, match="unreadable"):
        BankSet.from_pretrained(tmp_path)


SELECTOR = "Selector.from_pretrained"


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(layer_gains={"0": float("nan"), "2": 0.5}), "finite number"),
    (lambda r: r.update(layer_gains={"0": 10**400, "2": 0.5}), "too large"),
    (lambda r: r.update(units={"0": "1", "2": [0, 1]}), "units of layer 0"),
    (lambda r: r.update(unit_type="kv_groups"), "unit_type must be"),
    (lambda r: r.update(layers=[0, 7], units={"0": [1], "7": [0]},
                        layer_gains={"0": 1.0, "7": 1.0}), "reach past the model's 3"),
    (lambda r: r.update(units={"0": [1], "2": [0, 5]}), "reach past the model's 2"),
    (lambda r: r.update(candidate_layers=[0, 1]), "one row per candidate layer"),
    (lambda r: r.update(config=[]), "config must be an object"),
    (lambda r: r.update(fingerprint="llama"), "fingerprint must be an object"),
])
def test_malformed_selector_entries_raise_the_format_error(change, message):
    outcome = _case(SELECTOR, lambda files: _json(files, "selector.json", change))
    assert outcome.error == "SelectorFormatError" and message in outcome.message


def test_a_selector_record_that_is_a_list_is_a_format_error():
    outcome = _case(SELECTOR, lambda files: files.update(
        {"selector.json": b"[" + files["selector.json"] + b"]"}))
    assert outcome.error == "SelectorFormatError"


PERSONA = "PersonaSteering.from_pretrained"


@pytest.mark.parametrize("edit, message", [
    (lambda files: files.pop("persona.json"), "unreadable"),
    (lambda files: files.update({"persona.json": b'["prompt_like"]'}), "not a persona report"),
    (lambda files: files.update({"persona.json": b'{"trials": []}'}), "not a persona report"),
    (lambda files: files.update({"persona.json": b'{"recipe": "prompt_like", "trials": {}}'}),
     "trials must be a list"),
    (lambda files: files.update({"persona.json": b'{"recipe": "prompt_lika", "trials": []}'}),
     "its recipe must be one of"),
    (lambda files: files.update({"persona.json": b'{"recipe": "prompt_like"'}), "not valid JSON"),
])
def test_a_broken_persona_json_raises_the_persona_format_error(edit, message):
    outcome = _case(PERSONA, edit)
    assert outcome.error == "PersonaFormatError" and message in outcome.message


REGISTRY = "vllm Registry.load + validate"


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(limits=[]), "limits must be an object"),
    (lambda r: r.update(model=["llama"]), "model must be a fingerprint object"),
    (lambda r: r["bank_sets"]["up"].pop("banks"), "bank_sets must map ids"),
    (lambda r: r["bank_sets"].update(up=["/x"]), "bank_sets must map ids"),
    (lambda r: r["bank_sets"]["up"].update(banks=7), "bank_sets must map ids"),
    (lambda r: r.update(selectors={"alt": None}), "selectors must map ids"),
    (lambda r: r["bank_sets"]["up"].update(banks="someone/else"), "is not a directory"),
])
def test_malformed_registries_raise_the_registry_error(change, message):
    outcome = _case(REGISTRY, lambda files: _json(files, "registry.json", change))
    assert outcome.error == "RegistryError" and message in outcome.message


@pytest.mark.parametrize("scale", [10**400, -(10**400), 2**1023], ids=["1e400", "-1e400", "2^1023"])
def test_a_huge_integer_scale_is_a_registry_error(scale):
    from hf_memory_vllm import RegistryError, parse_request

    with pytest.raises(RegistryError, match="must be a finite number > 0"):
        parse_request({"memory_bank_set": "up", "memory_scale": scale})


REQUEST_VALUES = (st.none() | st.booleans() | st.integers(-(2**1100), 2**1100) | st.floats()
                  | st.text(max_size=10) | st.sampled_from(["1e999", "nan", "-0", "inf", "0.5"])
                  | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(), st.none()))
REQUEST_KEYS = st.sampled_from(["memory_bank_set", "memory_selector", "memory_scale",
                                "memory_other", "top_k", "memory_"]) | st.text(max_size=10)


@fuzz_settings(1500)
@given(st.dictionaries(REQUEST_KEYS, REQUEST_VALUES, max_size=4) | REQUEST_VALUES)
def test_request_arguments_parse_or_raise_the_registry_error(extra_args):
    import math

    from hf_memory_vllm import RegistryError, SteeringRequest, cache_salt, parse_request

    try:
        request = parse_request(extra_args)
    except RegistryError as error:
        assert str(error)
        return
    assert request is None or (
        isinstance(request, SteeringRequest) and isinstance(request.bank_set, str)
        and request.bank_set and math.isfinite(request.scale) and request.scale > 0)
    assert (cache_salt(extra_args) is None) == (request is None)


def test_a_non_integer_persona_answer_is_a_value_error(tmp_path):
    from eval_harness.persona_ab.task import load_persona_set

    files = dict(LOADERS["load_persona_set (persona-ab)"].files())
    files["agreeableness.jsonl.gz"] = gzip.compress(
        b'{"prompt": "Hi?", "positive": 1, "negative": "(A)"}\n')
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match="an item is") as raised:
        load_persona_set("agreeableness", tmp_path)
    assert type(raised.value) is ValueError


@pytest.mark.parametrize("field, value", [("user", 3), ("old_replies", None),
                                          ("new_replies", {"a": 1, "b": 2, "c": 3})])
def test_a_case_whose_texts_are_not_a_list_is_a_value_error(field, value):
    outcome = _case("load_cases (--cases)", lambda files: _json(
        files, "cases.json", lambda cases: cases[0].update({field: value})))
    assert outcome.error == "ValueError" and f"{field} must be 3 non-empty texts" in (
        outcome.message)


def test_a_prompts_file_that_is_not_utf8_is_a_cli_error(tmp_path):
    from hf_memory_cli.errors import CLIError
    from hf_memory_cli.steering import _prompts

    (tmp_path / "prompts.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(CLIError, match="not UTF-8"):
        _prompts(argparse.Namespace(prompt=None, prompts=str(tmp_path / "prompts.txt")))


def test_the_fuzzers_valid_artifacts_are_real_ones(tmp_path):
    """The unmutated files the fuzzers start from load into what they were built from (so the
    mutations corrupt real artifacts, not already-broken ones)."""
    from hf_memory import BankSet

    for name, data in LOADERS[BANKS].files().items():
        (tmp_path / name).write_bytes(data)
    loaded = BankSet.from_pretrained(tmp_path, model=loader_fuzz.base_model())
    loader_fuzz.check_bank_set(loaded)
    assert loaded.gamma == 2.0 and [b.name for b in loaded] == ["persona", "calm", "facts"]
    assert load_file(tmp_path / "banks.safetensors")["0.positions"].dtype == torch.int64
