"""The vLLM plugin's registry and request arguments: written and checked without vLLM.

(The plugin inside vLLM is tested in the vLLM environment, ``tests_vllm``.)
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from hf_memory import BankSet, MemoryBank
from hf_memory_vllm import (
    DEFAULT_MAX_SLOT_LAYERS,
    Registry,
    RegistryError,
    SteeringRequest,
    bank_set_size,
    cache_salt,
    parse_request,
    steering_args,
    write_registry,
)
from tests.tiny_models import tiny_model


def tiny_llama(seed: int = 0):
    return tiny_model("llama", seed=seed, dtype=torch.float32)


def _bank(model, seed: int, role: str = "target") -> MemoryBank:
    config = model.config
    shape = (config.num_hidden_layers, config.num_key_value_heads, 3, config.head_dim)
    generator = torch.Generator().manual_seed(seed)
    return MemoryBank.from_tensors(torch.randn(shape, generator=generator),
                                   torch.randn(shape, generator=generator), name="b", role=role)


@pytest.fixture
def registry(tmp_path):
    model = tiny_llama()
    BankSet([_bank(model, 0)], model=model).save_pretrained(tmp_path / "up")
    path = write_registry(tmp_path / "registry.json", model, {"up": tmp_path / "up"})
    return Registry.load(path), tmp_path


def test_requests_parse_to_what_they_ask_for():
    assert parse_request(None) is None
    assert parse_request({"top_k_other_plugin": 3}) is None
    assert parse_request(steering_args("up")) == SteeringRequest("up")
    assert parse_request(steering_args("up", selector="s", scale=0.5)) == (
        SteeringRequest("up", "s", 0.5))
    # over HTTP vllm_xargs values may arrive as strings
    assert parse_request({"memory_bank_set": "up", "memory_scale": "2"}).scale == 2.0


@pytest.mark.parametrize("args, message", [
    ({"memory_bank_set": ""}, "must name a registered bank set"),
    ({"memory_bank_set": 3}, "must name a registered bank set"),
    ({"memory_selector": "s"}, "must name a registered bank set"),
    ({"memory_bank_set": "up", "memory_scale": 0}, "finite number > 0"),
    ({"memory_bank_set": "up", "memory_scale": math.nan}, "finite number > 0"),
    ({"memory_bank_set": "up", "memory_scale": True}, "finite number > 0"),
    ({"memory_bank_set": "up", "memory_scale": "loud"}, "must be a number"),
    ({"memory_bank_set": "up", "memory_selector": ""}, "must name a registered selector"),
    ({"memory_bank_set": "up", "memory_gain": 2}, r"unknown steering arguments \['memory_gain'\]"),
    (["memory_bank_set"], "must be a mapping"),
])
def test_malformed_requests_get_one_clear_error(args, message):
    with pytest.raises(RegistryError, match=message):
        parse_request(args)


def test_cache_salts_separate_steerings_from_plain_and_from_each_other():
    salts = {cache_salt(args) for args in (steering_args("a"), steering_args("b"),
                                           steering_args("a", scale=0.5),
                                           steering_args("a", selector="s"))}
    assert len(salts) == 4 and cache_salt(None) is None


def test_registry_serves_its_bank_sets_and_names_the_rest(registry):
    loaded, _ = registry
    loaded.validate(SteeringRequest("up"))
    with pytest.raises(RegistryError, match=r"unknown bank set 'down'; registered: \['up'\]"):
        loaded.validate(SteeringRequest("down"))
    with pytest.raises(RegistryError, match="unknown selector 'n'"):
        loaded.validate(SteeringRequest("up", "n"))


def test_bank_sets_for_another_model_are_refused(registry, tmp_path):
    loaded, root = registry
    other = tiny_llama(seed=1)
    BankSet([_bank(other, 1)], model=other).save_pretrained(root / "other")
    record = json.loads(loaded.path.read_text())
    record["bank_sets"]["other"] = {"banks": str(root / "other"), "selector": None}
    (tmp_path / "edited.json").write_text(json.dumps(record))
    with pytest.raises(RegistryError, match="'other'.*different model.*weights_digest"):
        Registry.load(tmp_path / "edited.json").validate(SteeringRequest("other"))
    with pytest.raises(ValueError, match="different model"):  # and never written in the first
        write_registry(tmp_path / "r.json", tiny_llama(), {"other": root / "other"})
    assert not (tmp_path / "r.json").exists()


def test_a_corrupted_bank_file_is_refused_per_request(registry):
    loaded, root = registry
    weights = root / "up" / "banks.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])
    with pytest.raises(RegistryError, match="'up'"):
        Registry.load(loaded.path).validate(SteeringRequest("up"))


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("[]", "does not hold a registry"),
    ('{"kind": "something_else"}', "is not a version 1 hf-memory vLLM registry"),
    ('{"kind": "hf_memory_vllm_registry", "format_version": 1, "model": {}}', "lacks"),
])
def test_broken_registry_files_get_one_clear_error(tmp_path, content, message):
    (tmp_path / "registry.json").write_text(content)
    with pytest.raises(RegistryError, match=message):
        Registry.load(tmp_path / "registry.json")
    with pytest.raises(RegistryError, match="no registry at"):
        Registry.load(tmp_path / "missing.json")


def test_contrast_bank_sets_are_refused_by_name_when_written(tmp_path):
    model = tiny_llama()
    reference = dataclasses.replace(_bank(model, 1, role="reference"), name="r")
    banks = BankSet([_bank(model, 0), reference], model=model, contrast=True)
    banks.save_pretrained(tmp_path / "c")
    with pytest.raises(RegistryError, match="'c' is a contrast set .* hf_memory.steer"):
        write_registry(tmp_path / "registry.json", model, {"c": tmp_path / "c"})
    assert not (tmp_path / "registry.json").exists()


def test_bank_sets_past_the_size_limit_are_refused_when_written_and_when_requested(registry,
                                                                                    tmp_path):
    loaded, root = registry
    model = tiny_llama()
    size = bank_set_size(BankSet.from_pretrained(root / "up"))
    assert size == (3 * 3, 3 * 2 * 3 * 16 * 4 * 2)  # 3 slots x 3 layers; k and v, float32
    record = json.loads(loaded.path.read_text())
    assert record["limits"] == {"max_slot_layers": DEFAULT_MAX_SLOT_LAYERS}
    assert (record["bank_sets"]["up"]["slot_layers"], record["bank_sets"]["up"]["bytes"]) == size
    with pytest.raises(RegistryError, match=r"'up' holds 9 slot-layers .* limit of 8"):
        write_registry(tmp_path / "small.json", model, {"up": root / "up"}, max_slot_layers=8)
    assert not (tmp_path / "small.json").exists()
    write_registry(tmp_path / "fits.json", model, {"up": root / "up"}, max_slot_layers=9)
    record["limits"]["max_slot_layers"] = 8  # the files changed or the limit was lowered
    (tmp_path / "edited.json").write_text(json.dumps(record))
    with pytest.raises(RegistryError, match="past the limit of 8"):
        Registry.load(tmp_path / "edited.json").validate(SteeringRequest("up"))
    for bad in (0, -1, True, 2.5, "9"):
        with pytest.raises(RegistryError, match="max_slot_layers must be a positive integer"):
            write_registry(tmp_path / "bad.json", model, {"up": root / "up"},
                           max_slot_layers=bad)
        record["limits"]["max_slot_layers"] = bad
        (tmp_path / "edited.json").write_text(json.dumps(record))
        with pytest.raises(RegistryError, match="max_slot_layers must be a positive integer"):
            Registry.load(tmp_path / "edited.json")
