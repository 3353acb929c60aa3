"""Bank-set artifacts: bit-exact round trips, fingerprints, corrupt files, offline Hub cache."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_memory import BankSet, BankSetFormatError, FingerprintMismatchError, MemoryBank, steer
from tests.test_memory_inception import random_bank, token_ids
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers


def text_provenance_bank() -> MemoryBank:
    bank = random_bank("persona", "target", 4, gain=1.5)
    return MemoryBank.from_tensors(bank.keys, bank.values, name="persona", layers=bank.layers,
                                   gain=1.5, provenance={
                                       "source": "text", "text": "I worry about everything.",
                                       "text_sha256": "ab" * 32, "keep": "descriptor",
                                       "variants": [{"template": "{text}", "token_ids": [1, 2],
                                                     "kept_positions": [0, 1]}]})


@pytest.fixture
def model():
    return tiny_model("llama")


@pytest.fixture
def bank_set(model):
    return BankSet([text_provenance_bank(),
                    random_bank("calm", "reference", 3, gain=0.5, seed=4,
                                phases=torch.arange(3, dtype=torch.float64)),
                    random_bank("facts", "auxiliary", 2, layers=(1,), seed=5,
                                positions=torch.tensor([3, 9]))],
                   model=model, gamma=2.5, size_normalize=False)


def test_round_trip_is_bit_exact(model, bank_set, tmp_path):
    bank_set.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md", "banks.safetensors", "config.json"]
    loaded = BankSet.from_pretrained(tmp_path, model=model)
    assert (loaded.gamma, loaded.size_normalize) == (2.5, False)
    assert loaded.fingerprint == bank_set.fingerprint
    for before, after in zip(bank_set.banks, loaded.banks, strict=True):
        assert (before.name, before.role, before.gain, before.layers) == (
            after.name, after.role, after.gain, after.layers)
        assert after.provenance == before.provenance
        for field in ("keys", "values", "phases", "positions"):
            a, b = getattr(before, field), getattr(after, field)
            assert (a is None and b is None) or (torch.equal(a, b) and a.dtype == b.dtype)
        assert after.content_hash() == before.content_hash()
    ids = token_ids()
    with steer(model, bank_set):
        expected = model(ids).logits
    with steer(model, loaded):
        assert torch.equal(model(ids).logits, expected)


def test_config_is_sorted_json_and_the_card_discloses_the_text(bank_set, tmp_path):
    bank_set.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    config = json.loads(text)
    assert text == json.dumps(config, indent=2, sort_keys=True) + "\n"
    assert config["format_version"] == 1
    assert config["fingerprint"]["model_type"] == "llama"
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: hf-memory")
    assert "I worry about everything." in card
    assert "persona** (target, gain 1.5)" in card


def test_a_different_model_is_refused(bank_set, tmp_path):
    bank_set.save_pretrained(tmp_path)
    with pytest.raises(FingerprintMismatchError, match="weights_digest"):
        BankSet.from_pretrained(tmp_path, model=tiny_model("llama", seed=1))
    with pytest.raises(FingerprintMismatchError, match="model_type"):
        BankSet.from_pretrained(tmp_path, model=tiny_model("qwen2"))
    with pytest.raises(FingerprintMismatchError):
        steer(tiny_model("llama", seed=1), bank_set)


def test_the_same_weights_under_another_name_are_the_same_model(bank_set, tmp_path):
    """A local copy of the checkpoint (a path where the artifact recorded a Hub id) loads; a
    different name with different weights is still refused, and names the weights."""
    bank_set.save_pretrained(tmp_path)
    copy = tiny_model("llama")
    copy.config.name_or_path = "/some/local/snapshot"
    assert BankSet.from_pretrained(tmp_path, model=copy).fingerprint == bank_set.fingerprint
    other = tiny_model("llama", seed=1)
    other.config.name_or_path = "/some/local/snapshot"
    with pytest.raises(FingerprintMismatchError, match="weights_digest"):
        BankSet.from_pretrained(tmp_path, model=other)


def test_a_dtype_change_only_warns(bank_set, tmp_path):
    bank_set.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="made in float64"):
        BankSet.from_pretrained(tmp_path, model=tiny_model("llama", dtype=torch.float32))


def test_truncated_weights_are_a_format_error(bank_set, model, tmp_path):
    bank_set.save_pretrained(tmp_path)
    weights = tmp_path / "banks.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(BankSetFormatError, match="unreadable"):
        BankSet.from_pretrained(tmp_path, model=model)


def test_edited_weights_fail_the_content_hash(bank_set, model, tmp_path):
    bank_set.save_pretrained(tmp_path)
    weights = tmp_path / "banks.safetensors"
    tensors = load_file(weights)
    tensors["0.values"][0, 0, 0, 0] += 1.0
    save_file(tensors, weights)
    with pytest.raises(BankSetFormatError, match="content hash"):
        BankSet.from_pretrained(tmp_path, model=model)


@pytest.mark.parametrize("damage, message", [
    (lambda c: "{not json", "not valid JSON"),
    (lambda c: json.dumps({**json.loads(c), "format_version": 99}), "format version 99"),
    (lambda c: json.dumps({k: v for k, v in json.loads(c).items() if k != "banks"}), "lacks"),
], ids=["bad-json", "future-version", "missing-banks"])
def test_damaged_config_is_a_format_error(bank_set, model, tmp_path, damage, message):
    bank_set.save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(damage(config.read_text()))
    with pytest.raises(BankSetFormatError, match=message):
        BankSet.from_pretrained(tmp_path, model=model)


def test_missing_directory_contents_are_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BankSetFormatError, match="holds no config.json"):
        BankSet.from_pretrained(tmp_path / "empty")


def test_unknown_config_keys_warn(bank_set, model, tmp_path):
    bank_set.save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "shiny_new_field": 1}))
    with pytest.warns(UserWarning, match="shiny_new_field"):
        BankSet.from_pretrained(tmp_path, model=model)


def test_loads_by_repo_id_from_the_offline_hub_cache(bank_set, model, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--someone--anxious-bank"
    bank_set.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    loaded = BankSet.from_pretrained("someone/anxious-bank", model=model,
                                     cache_dir=tmp_path / "cache")
    assert [b.content_hash() for b in loaded] == [b.content_hash() for b in bank_set]
