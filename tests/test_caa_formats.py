"""CAA vectors that travel: the block-output site, llama.cpp control-vector GGUF files both ways,
and lm-eval's ``steered`` file — each exact against what the other tool does."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hf_memory import (
    CAAVectors,
    ControlVectorFormatError,
    FingerprintMismatchError,
    apply_caa,
    export_control_vector,
    export_lm_eval_steer,
    load_control_vector,
)
from hf_memory.baselines.caa_lm_eval import lm_eval_steer_config
from hf_memory.models.adapters import get_adapter
from hf_memory.models.fingerprint import model_fingerprint
from tests.test_memory_inception import token_ids
from tests.tiny_models import tiny_model

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers

FAMILIES = ["llama", "qwen3", "mistral", "granite", "phi3", "olmo2", "gemma2", "gemma3_text"]
TEXTS = [("I am so worried about everything.", "I am so calm about everything."),
         ("My heart races with fear.", "My heart is steady and at ease.")]


class _Tokenizer:
    """Characters as token ids (mod a tiny vocabulary): enough to extract from text."""

    def __call__(self, text, return_tensors="pt", add_special_tokens=False):
        ids = torch.tensor([[ord(c) % 97 for c in text]])
        return type("Encoding", (), {"input_ids": ids})()


@pytest.mark.parametrize("family", FAMILIES)
def test_block_output_site_reads_and_moves_the_layers_output(family):
    """At ``site="block_output"`` CAA reads the decoder layer's output (the hidden state the next
    layer receives) and steering moves exactly that stream by scale · v from the start on."""
    model = tiny_model(family)
    layer, ids = 1, token_ids(1, 8)
    vectors = CAAVectors.extract(model, _Tokenizer(), TEXTS, layers=[layer],
                                 site="block_output")
    with torch.no_grad():
        states = [[model(_Tokenizer()(t).input_ids, output_hidden_states=True)
                   .hidden_states[layer + 1][0].mean(0) for t in pair] for pair in TEXTS]
    expected = sum(p - n for p, n in states) / len(TEXTS)
    torch.testing.assert_close(vectors.vectors[layer], expected, rtol=1e-12, atol=1e-12)

    vector = torch.randn(model.config.hidden_size, dtype=torch.float64)
    received: list[torch.Tensor] = []  # what the next layer receives
    hook = get_adapter(model).layers(model)[layer + 1].register_forward_pre_hook(
        lambda _m, args, kwargs: received.append(args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
            with apply_caa(model, CAAVectors({layer: vector}, scale=1.5, site="block_output"),
                           start_position=3):
                model(ids)
    finally:
        hook.remove()
    plain, steered = received
    torch.testing.assert_close(steered[:, :3], plain[:, :3], rtol=0, atol=0)
    torch.testing.assert_close(steered[:, 3:], plain[:, 3:] + 1.5 * vector, rtol=1e-12,
                               atol=1e-12)


def test_the_site_is_saved_and_version_one_readers_would_refuse_it(tmp_path):
    """Post-attention folders stay version 1 byte for byte (the artifact-compatibility test);
    block-output folders are version 2, which a version-1 reader refuses."""
    import json

    CAAVectors({1: torch.ones(4)}, site="block_output").save_pretrained(tmp_path / "block")
    CAAVectors({1: torch.ones(4)}).save_pretrained(tmp_path / "post")
    records = {name: json.loads((tmp_path / name / "config.json").read_text())
               for name in ("block", "post")}
    assert (records["block"]["format_version"], records["block"]["site"]) == (2, "block_output")
    assert records["post"]["format_version"] == 1 and "site" not in records["post"]
    assert CAAVectors.from_pretrained(tmp_path / "block").site == "block_output"
    assert CAAVectors.from_pretrained(tmp_path / "post").site == "post_attention"
    records["block"]["site"] = "mlp"
    (tmp_path / "block" / "config.json").write_text(json.dumps(records["block"]))
    _strip_weights_metadata(tmp_path / "block")  # config.json alone describes the vectors
    with pytest.raises(ValueError, match="site must be one of"):
        CAAVectors.from_pretrained(tmp_path / "block")


def _strip_weights_metadata(folder) -> None:
    """The weights as a folder saved before they carried a content hash and their config."""
    from safetensors.torch import load_file, save_file

    path = folder / "caa_vectors.safetensors"
    save_file(load_file(path), path)


def _block_vectors(model, layers=(1, 2), scale=2.5) -> CAAVectors:
    return CAAVectors.extract(model, _Tokenizer(), TEXTS, layers=list(layers), scale=scale,
                              site="block_output")


def test_control_vector_round_trip_is_bit_exact_and_steers_the_same(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    vectors = _block_vectors(model)
    path = export_control_vector(vectors, tmp_path / "v.gguf")
    loaded = load_control_vector(path, model=model)
    assert loaded.site == "block_output" and loaded.scale == 1.0 and loaded.layers == [1, 2]
    for layer in (1, 2):
        assert loaded.vectors[layer].dtype == torch.float32
        assert torch.equal(loaded.vectors[layer], 2.5 * vectors.vectors[layer])
    assert loaded.fingerprint == vectors.fingerprint == model_fingerprint(model)
    assert loaded.provenance["pairs"] == vectors.provenance["pairs"]
    again = gguf.GGUFReader(export_control_vector(loaded, tmp_path / "again.gguf"))
    first = gguf.GGUFReader(path)
    assert [(t.name, t.data.tobytes()) for t in again.tensors] == [
        (t.name, t.data.tobytes()) for t in first.tensors]
    # CAAVectors.from_pretrained reads the file too, and steering is identical, bit for bit
    assert torch.equal(CAAVectors.from_pretrained(path).vectors[2], loaded.vectors[2])
    ids = token_ids(2, 9)
    with torch.no_grad(), apply_caa(model, vectors):
        ours = model(ids).logits
    with torch.no_grad(), apply_caa(model, loaded):
        theirs = model(ids).logits
    assert torch.equal(ours, theirs)


def test_the_file_is_what_llama_cpp_reads(tmp_path):
    """llama.cpp's loader: ``direction.<n>`` tensors, n >= 1, F32, one dimension of n_embd; the
    architecture ``controlvector`` and repeng's ``model_hint`` / ``layer_count`` keys."""
    model = tiny_model("llama", dtype=torch.float32)
    path = export_control_vector(_block_vectors(model, scale=1.0), tmp_path / "v.gguf")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "controlvector"
    assert reader.fields["controlvector.model_hint"].contents() == "llama"
    assert reader.fields["controlvector.layer_count"].contents() == 2
    assert sorted(t.name for t in reader.tensors) == ["direction.1", "direction.2"]
    for tensor in reader.tensors:
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        assert [int(d) for d in tensor.shape] == [model.config.hidden_size]


def _write(path, tensors: dict, architecture: str = "controlvector", **strings) -> None:
    writer = gguf.GGUFWriter(path, architecture)
    for key, value in strings.items():
        writer.add_string(key.replace("__", "."), value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_cpp_file_without_our_metadata_loads_and_sums_repeated_layers(tmp_path):
    """As llama.cpp's loader does, two tensors naming one layer add up."""
    width = 64
    a, b, c = (np.random.default_rng(i).standard_normal(width).astype(np.float32)
               for i in range(3))
    _write(tmp_path / "cv.gguf", {"direction.1": a, "direction.01": b, "direction.2": c})
    vectors = load_control_vector(tmp_path / "cv.gguf", model=tiny_model("llama"),
                                  strength=0.5)
    assert vectors.fingerprint is None and vectors.scale == 0.5
    assert np.array_equal(vectors.vectors[1].numpy(), a + b)
    assert np.array_equal(vectors.vectors[2].numpy(), c)
    assert len(vectors.provenance["control_vector"]["sha256"]) == 64


@pytest.mark.parametrize(("tensors", "architecture", "message"), [
    ({"direction.0": np.ones(64, np.float32)}, "controlvector", "direction.0 is invalid"),
    ({"direction.1": np.ones(64, np.float16)}, "controlvector", "not F32"),
    ({"direction.1": np.ones((2, 32), np.float32)}, "controlvector", "not one vector"),
    ({"direction.1": np.ones(64, np.float32), "direction.2": np.ones(32, np.float32)},
     "controlvector", "has 32 entries"),
    ({"direction.1": np.full(64, np.nan, np.float32)}, "controlvector", "NaN or infinity"),
    ({"direction.1x": np.ones(64, np.float32)}, "controlvector", "not direction.<layer>"),
    ({"token_embd.weight": np.ones(64, np.float32)}, "llama", "not a control vector"),
    ({}, "controlvector", "no direction tensors"),
    ({"direction.1": np.ones(32, np.float32)}, "controlvector", "width 64"),
    ({"direction.7": np.ones(64, np.float32)}, "controlvector", "3 layers"),
])
def test_bad_control_vector_files_are_refused_by_name(tmp_path, tensors, architecture, message):
    _write(tmp_path / "bad.gguf", tensors, architecture)
    with pytest.raises(ControlVectorFormatError, match=message):
        load_control_vector(tmp_path / "bad.gguf", model=tiny_model("llama"))


def test_cut_or_missing_files_and_foreign_models_are_refused(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    path = export_control_vector(_block_vectors(model), tmp_path / "v.gguf")
    data = path.read_bytes()
    for cut in (0, 3, 24, len(data) // 2, len(data) - 1):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ControlVectorFormatError):
            load_control_vector(tmp_path / "cut.gguf")
    with pytest.raises(ControlVectorFormatError, match="cannot read"):
        load_control_vector(tmp_path / "absent.gguf")
    _write(tmp_path / "junk.gguf", {"direction.1": np.ones(64, np.float32)},
           hf_memory__fingerprint="{not json")
    with pytest.raises(ControlVectorFormatError, match="not JSON"):
        load_control_vector(tmp_path / "junk.gguf")
    with pytest.raises(FingerprintMismatchError):
        load_control_vector(path, model=tiny_model("llama", dtype=torch.float32, seed=1))


def test_export_refuses_what_llama_cpp_cannot_apply(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    post = CAAVectors.extract(model, _Tokenizer(), TEXTS, layers=[1])
    with pytest.raises(ControlVectorFormatError, match="site='block_output'"):
        export_control_vector(post, tmp_path / "v.gguf")
    with pytest.raises(ControlVectorFormatError, match="layer 0"):
        export_control_vector(_block_vectors(model, layers=(0, 1)), tmp_path / "v.gguf")
    with pytest.raises(ControlVectorFormatError, match=r"\.gguf file"):
        export_control_vector(_block_vectors(model), tmp_path / "v.bin")
    assert list(tmp_path.iterdir()) == []  # nothing half written


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("site", ["post_attention", "block_output"])
def test_lm_evals_steered_hooks_on_our_file_equal_our_caa(family, site, tmp_path):
    """lm-eval's own ``steer`` hooks, reading the file we write, give the logits our handle gives
    (every position, as lm-eval steers): post-norm layers and Granite's residual multiplier
    included."""
    from lm_eval.models.hf_steered import SteeredModel, steer

    model = tiny_model(family)
    vectors = CAAVectors.extract(model, _Tokenizer(), TEXTS, layers=[1, 2], scale=1.7,
                                 site=site)
    path = export_lm_eval_steer(vectors, model, tmp_path / "steer.pt")
    config = torch.load(path, weights_only=True)
    assert config.keys() == lm_eval_steer_config(vectors, model).keys()
    hooks = {hookpoint: (lambda x, info=info: SteeredModel.add(
        x, vector=info["steering_vector"] * info["steering_coefficient"], head_index=None))
        for hookpoint, info in config.items()}
    ids = token_ids(2, 7)
    with torch.no_grad():
        with apply_caa(model, vectors):
            ours = model(ids).logits
        with steer(model, hooks):
            theirs = model(ids).logits
        plain = model(ids).logits
    assert not torch.equal(ours, plain)
    torch.testing.assert_close(theirs, ours, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"\.pt or \.pth"):
        export_lm_eval_steer(vectors, model, tmp_path / "steer.json")


@pytest.mark.slow
def test_the_command_line_extracts_exports_and_the_vectors_steer_generate(default_model,
                                                                          tmp_path, capsys):
    """``caa extract --site block_output`` → ``caa export control-vector`` → the file read back
    steers ``generate()`` exactly as the folder it came from; ``caa export lm-eval-steer``
    names the decoder layers."""
    import hf_memory_cli as cli
    from hf_memory.selection.pairs import write_pairs

    model, tokenizer = default_model
    pairs = [(f"Question {i}: how was your day?", "It was wonderful, truly joyful!",
              "It was awful, truly miserable.") for i in range(8)]
    write_pairs(tmp_path / "pairs.jsonl", pairs)
    assert cli.main(["caa", "extract", "--pairs", str(tmp_path / "pairs.jsonl"), "--layers",
                     "10,20", "--site", "block_output", "--scale", "4", "--out",
                     str(tmp_path / "vectors")]) in (0, None)
    assert cli.main(["caa", "export", "control-vector", "--vectors", str(tmp_path / "vectors"),
                     "--out", str(tmp_path / "joy.gguf")]) in (0, None)
    assert cli.main(["caa", "export", "lm-eval-steer", "--vectors", str(tmp_path / "joy.gguf"),
                     "--out", str(tmp_path / "steer.pt")]) in (0, None)
    out = capsys.readouterr().out
    assert "directions at layers [10, 20], scale 4.0 baked in" in out
    assert list(torch.load(tmp_path / "steer.pt", weights_only=True)) == ["layers.10",
                                                                           "layers.20"]
    folder = CAAVectors.from_pretrained(tmp_path / "vectors", model=model)
    imported = CAAVectors.from_pretrained(tmp_path / "joy.gguf", model=model)
    ids = tokenizer("How do you feel today?", return_tensors="pt").input_ids
    replies = []
    for vectors in (folder, imported):
        with apply_caa(model, vectors):
            replies.append(model.generate(ids, max_new_tokens=12, do_sample=False))
    assert torch.equal(*replies)
    assert not torch.equal(replies[0], model.generate(ids, max_new_tokens=12, do_sample=False))
    assert cli.main(["caa", "export", "control-vector", "--vectors", str(tmp_path / "joy.gguf"),
                     "--out", str(tmp_path / "again.gguf")]) in (0, None)
    post = CAAVectors({10: torch.ones(model.config.hidden_size)})
    post.save_pretrained(tmp_path / "post")
    assert cli.main(["caa", "export", "control-vector", "--vectors", str(tmp_path / "post"),
                     "--out", str(tmp_path / "post.gguf")]) == 2
    assert "site='block_output'" in capsys.readouterr().err


def test_edited_or_corrupt_caa_folders_are_refused_by_name(tmp_path):
    """What steers (vectors, scale, site) is checked against the hash the weights file records;
    the fuzzers' finds (float8 vectors, a missing weights file) are one ValueError each."""
    import json

    from safetensors.torch import load_file, save_file

    vectors = CAAVectors({1: torch.randn(64), 2: torch.randn(64)}, scale=2.0,
                         site="block_output")
    folder = vectors.save_pretrained(tmp_path / "v")
    config, weights = folder / "config.json", folder / "caa_vectors.safetensors"
    record, data = json.loads(config.read_text()), weights.read_bytes()

    config.write_text(json.dumps({**record, "scale": 20.0}))  # what the weights vouch for wins
    with pytest.warns(UserWarning, match="older than the vectors"):
        assert CAAVectors.from_pretrained(folder).scale == 2.0
    config.write_text(json.dumps(record))
    flipped = bytearray(data)
    flipped[-3] ^= 0x40  # inside layer 2's vector
    weights.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="content hash mismatch"):
        CAAVectors.from_pretrained(folder)
    tensors = load_file(tmp_path / "v" / "caa_vectors.safetensors")
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in tensors.items()}, weights)
    with pytest.raises(ValueError, match="float16, bfloat16, float32 or float64"):
        CAAVectors.from_pretrained(folder)
    weights.unlink()
    with pytest.raises(ValueError, match="lacks caa_vectors.safetensors"):
        CAAVectors.from_pretrained(folder)
    for bad, message in (({**record, "layers": "12"}, "list of integers"),
                         ({**record, "scale": "2.0"}, "finite number"),
                         ({**record, "fingerprint": [1]}, "fingerprint must be a mapping"),
                         ([record], "is not version")):
        weights.write_bytes(data)
        _strip_weights_metadata(folder)
        config.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            CAAVectors.from_pretrained(folder)


def test_an_edited_control_vector_we_wrote_is_refused(tmp_path):
    model = tiny_model("llama", dtype=torch.float32)
    path = export_control_vector(_block_vectors(model), tmp_path / "v.gguf")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # inside the last direction
    path.write_bytes(bytes(data))
    with pytest.raises(ControlVectorFormatError, match="content hash mismatch"):
        load_control_vector(path)


def test_a_save_killed_between_its_two_files_loads_the_new_vectors(tmp_path):
    """The weights are renamed in first and carry their config: beside the old config.json (a
    kill before it was replaced) the folder loads as the new vectors, with a warning."""
    import shutil

    old = CAAVectors({1: torch.randn(64)}, scale=1.0)
    new = CAAVectors({1: torch.randn(64), 2: torch.randn(64)}, scale=3.0, site="block_output")
    old.save_pretrained(tmp_path / "old")
    new.save_pretrained(tmp_path / "new")
    shutil.copy(tmp_path / "old" / "config.json", tmp_path / "new" / "config.json")
    with pytest.warns(UserWarning, match="older than the vectors"):
        loaded = CAAVectors.from_pretrained(tmp_path / "new")
    assert (loaded.site, loaded.scale, loaded.layers) == ("block_output", 3.0, [1, 2])
    assert all(torch.equal(loaded.vectors[i], new.vectors[i]) for i in (1, 2))
