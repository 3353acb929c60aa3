"""ArithConfig / ArithTransformer: architecture, validation, causality, save/load, Auto classes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModel

import modeling
from modeling.arith import ArithConfig, ArithTransformer
from tests.remote_code import assert_remote_code_load_is_exact

pytestmark = pytest.mark.compat  # also run on the oldest supported transformers


def tiny_config(**overrides) -> ArithConfig:
    sizes = dict(hidden_size=24, head_dim=8, num_attention_heads=3, intermediate_size=40)
    return ArithConfig(**{**sizes, **overrides})


def test_defaults_are_the_papers_model():
    config = ArithConfig()
    assert (config.num_hidden_layers, config.num_attention_heads) == (2, 1)
    assert (config.hidden_size, config.head_dim, config.intermediate_size) == (128, 128, 512)
    assert config.hidden_act == "relu" and config.max_position_embeddings == 16
    assert config.mlp_layers == [1]
    assert (config.modulus, config.num_variables, config.vocab_size) == (59, 12, 74)
    assert config.model_type == "arith"


def test_parameters_are_exactly_the_stated_ones():
    config = ArithConfig()
    model = ArithTransformer(config)
    d, v, t, n, m = 128, 74, 16, 59, 512
    expected = {
        "embed_tokens.weight": (v, d),
        "embed_positions.weight": (t, d),
        "lm_head.weight": (n, d),
        "layers.1.mlp.up_proj.weight": (m, d),
        "layers.1.mlp.down_proj.weight": (d, m),
    }
    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            expected[f"layers.{layer}.self_attn.{proj}.weight"] = (d, d)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == expected
    assert sum(p.numel() for p in model.parameters()) == sum(
        a * b for a, b in expected.values())
    assert model.layers[0].mlp is None
    assert not any(isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) for mod in model.modules())
    assert all(mod.bias is None for mod in model.modules() if isinstance(mod, nn.Linear))
    assert not any(name.endswith("bias") for name, _ in model.named_buffers())


@pytest.mark.parametrize(
    "field, value",
    [("modulus", 1), ("num_variables", 0), ("vocab_size", 70), ("hidden_size", 0),
     ("num_hidden_layers", 0), ("num_attention_heads", -1), ("head_dim", 0),
     ("intermediate_size", 0), ("max_position_embeddings", 0), ("mlp_layers", [2]),
     ("mlp_layers", [0, 0]), ("hidden_act", "tanh"), ("initializer_range", 0.0),
     ("hidden_size", 1.5)],
)
def test_invalid_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"ArithConfig.{field}"):
        ArithConfig(**{field: value})


def test_config_forwards_kwargs_and_sizes_are_configurable():
    config = ArithConfig(num_hidden_layers=3, mlp_layers=[0, 2], hidden_act="gelu",
                         output_attentions=False, id2label=None, custom_field=7)
    assert config.custom_field == 7
    model = ArithTransformer(config)
    assert [layer.mlp is not None for layer in model.layers] == [True, False, True]


def test_causal_and_last_position_logits_match_full_forward():
    model = ArithTransformer(tiny_config()).eval()
    ids = torch.randint(0, 74, (5, 16))
    full = model(ids).logits
    assert full.shape == (5, 16, 59)
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (5, 1, 59)
    torch.testing.assert_close(last[:, 0], full[:, -1])
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 74
    torch.testing.assert_close(model(changed).logits[:, :9], full[:, :9], rtol=0, atol=0)
    assert not torch.allclose(model(changed).logits[:, 9:], full[:, 9:])


def test_attentions_hidden_states_and_loss():
    model = ArithTransformer(tiny_config()).eval()
    ids = torch.randint(0, 74, (4, 16))
    labels = torch.randint(0, 59, (4,))
    out = model(ids, labels=labels, output_attentions=True, output_hidden_states=True)
    assert [a.shape for a in out.attentions] == [(4, 3, 16, 16)] * 2
    for a in out.attentions:
        torch.testing.assert_close(a.sum(-1), torch.ones(4, 3, 16))
        assert torch.all(a.triu(1) == 0)
    # embeddings, after attention 0, after attention 1, after MLP 1
    assert len(out.hidden_states) == 4
    torch.testing.assert_close(out.hidden_states[-1] @ model.lm_head.weight.T, out.logits)
    expected = nn.functional.cross_entropy(out.logits[:, -1], labels)
    torch.testing.assert_close(out.loss, expected)
    assert isinstance(model(ids, return_dict=False), tuple)


def test_too_long_input_is_a_clear_error():
    model = ArithTransformer(tiny_config(max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_registered_with_auto_classes():
    assert "ArithConfig" in modeling.__all__ and "ArithTransformer" in modeling.__all__
    config = AutoConfig.for_model("arith", hidden_size=16, head_dim=4, intermediate_size=8)
    assert isinstance(config, ArithConfig)
    assert isinstance(AutoModel.from_config(config), ArithTransformer)


def test_save_pretrained_round_trip_is_bit_exact(tmp_path):
    model = ArithTransformer(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == {"AutoConfig": "configuration_arith.ArithConfig",
                                 "AutoModel": "modeling_arith.ArithTransformer"}
    assert {"configuration_arith.py", "modeling_arith.py", "model.safetensors"} <= {
        p.name for p in tmp_path.iterdir()}
    loaded = ArithTransformer.from_pretrained(tmp_path).eval()
    assert loaded.config.to_diff_dict() == model.config.to_diff_dict()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 74, (3, 16))
    assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.slow
def test_auto_model_with_remote_code_offline_in_a_subprocess(tmp_path):
    model = ArithTransformer(tiny_config()).eval()
    ids = torch.randint(0, 74, (3, 16))
    assert assert_remote_code_load_is_exact(model, ids, tmp_path) == "ArithTransformer"
