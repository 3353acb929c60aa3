"""The AIR authors' HRM-style checkpoints convert into AIRSolver, weight for weight."""

from __future__ import annotations

import pytest
import torch

import hf_memory_cli as cli
from modeling.air import AIRSolver
from modeling.air.convert_air import AuthorsCheckpointError, from_authors_state_dict

D, HEADS, LAYERS, VOCAB, SEQ, FF = 32, 2, 2, 6, 16, 256  # FF: 2/3 * 4 * 32 rounded up to 256


def authors_state(levels=("f_level",), extra=(), seed=0, prefix="_orig_mod.model.inner.") -> dict:
    """Random tensors under the authors' names and shapes (bfloat16, as they train)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    state = {"embed_tokens.embedding_weight": rand(VOCAB, D), "puzzle_emb.weights": rand(3, D),
             "lm_head.weight": rand(VOCAB, D), "q_head.weight": rand(2, D),
             "q_head.bias": rand(2), "H_init": rand(D), "L_init": rand(D)}
    for level in levels:
        for i in range(LAYERS):
            p = f"{level}.layers.{i}."
            state |= {p + "self_attn.qkv_proj.weight": rand(3 * D, D),
                      p + "self_attn.o_proj.weight": rand(D, D),
                      p + "mlp.gate_up_proj.weight": rand(2 * FF, D),
                      p + "mlp.down_proj.weight": rand(D, FF)}
    for name in extra:
        state[name] = rand(D, D) if name == "g_input.weight" else rand(D)
    return {prefix + k: v for k, v in state.items()}


ARCH = {"name": "air.air_1net_Lx_H@AIR", "hidden_size": D, "num_heads": HEADS, "expansion": 4,
        "H_cycles": 2, "L_cycles": 2, "H_layers": LAYERS, "L_layers": LAYERS,
        "halt_max_steps": 4, "halt_exploration_prob": 0.1, "pos_encodings": "rope"}


def _source(state: dict, name: str) -> torch.Tensor:
    return state["_orig_mod.model.inner." + name].float()


@pytest.mark.parametrize("name, levels, extra, expect", [
    ("air.air_1net_Lx_H@AIR", ("f_level",), (), {"injection": "Lx_H"}),
    ("air.air_1net_L2x_H2x@AIR", ("f_level",), (), {"injection": "L2x_H2x"}),
    ("air.air_1net_gx_non_linear@AIR", ("f_level",), ("g_input.weight",),
     {"input_operator": "nonlinear"}),
    ("air.air_1net_had_prod@AIR", ("f_level",), (), {"input_operator": "hadamard"}),
    ("air.air_1net_L2x_H2x_input_token_addition@AIR", ("f_level",),
     ("input_token_L", "input_token_H"), {"level_token": "addition", "injection": "L2x_H2x"}),
    ("hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1", ("H_level", "L_level"), (),
     {"share_weights": False}),
])
def test_every_authors_tensor_lands_in_its_place(name, levels, extra, expect):
    state = authors_state(levels, extra)
    model = from_authors_state_dict(state, {**ARCH, "name": name}, seq_len=SEQ)
    config = model.config
    assert {k: getattr(config, k) for k in expect} == expect
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size,
            config.seq_len, config.num_puzzle_identifiers, config.puzzle_emb_len) == (
        D, LAYERS, FF, SEQ, 3, 1)
    ours = model.state_dict()
    assert torch.equal(ours["embed_tokens.weight"], _source(state, "embed_tokens.embedding_weight"))
    assert torch.equal(ours["puzzle_emb.weight"], _source(state, "puzzle_emb.weights"))
    for key in ("lm_head.weight", "q_head.weight", "q_head.bias", "H_init", "L_init"):
        assert torch.equal(ours[key], _source(state, key)), key
    blocks = {"f_level": "block", "H_level": "H_block", "L_level": "L_block"}
    for level in levels:
        for i in range(LAYERS):
            for rest in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                         "mlp.gate_up_proj.weight", "mlp.down_proj.weight"):
                assert torch.equal(ours[f"{blocks[level]}.layers.{i}.{rest}"],
                                   _source(state, f"{level}.layers.{i}.{rest}"))
    if "g_input.weight" in extra:
        assert torch.equal(ours["input_proj.weight"], _source(state, "g_input.weight"))
    if "input_token_L" in extra:
        assert torch.equal(ours["level_emb"][0], _source(state, "input_token_L"))
        assert torch.equal(ours["level_emb"][1], _source(state, "input_token_H"))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_a_narrow_puzzle_embedding_is_zero_padded_to_a_whole_position():
    state = authors_state(prefix="")
    state["puzzle_emb.weights"] = state["puzzle_emb.weights"][:, :20]
    weight = from_authors_state_dict(state, ARCH, seq_len=SEQ).state_dict()["puzzle_emb.weight"]
    assert torch.equal(weight[:, :20], state["puzzle_emb.weights"].float())
    assert torch.equal(weight[:, 20:], torch.zeros(3, D - 20))


@pytest.mark.parametrize("arch, state_change, message", [
    ({"name": "air.air_1net_L2x_H2x_input_token_prepend@AIR"}, None, "is not converted"),
    ({"pos_encodings": "learned"}, None, "RoPE only"),
    ({"name": "air.air_1net_Lx_H@AIR"}, lambda s: s.pop("lm_head.weight"), "missing"),
    ({"name": "air.air_1net_Lx_H@AIR"}, lambda s: s.update(stray=torch.zeros(1)), "unexpected"),
    ({"name": "air.air_1net_Lz_H@AIR"}, None, "unknown AIR variant"),
    ({"hidden_size": 64}, None, "hidden_size 64 in the config, 32 in the weights"),
])
def test_checkpoints_we_cannot_reproduce_are_refused(arch, state_change, message):
    state = authors_state(prefix="")
    if state_change:
        state_change(state)
    with pytest.raises(AuthorsCheckpointError, match=message):
        from_authors_state_dict(state, {**ARCH, **arch}, seq_len=SEQ)


def test_cli_converts_with_the_authors_yaml(tmp_path, capsys):
    state = authors_state()
    torch.save(state, tmp_path / "step_1000")
    (tmp_path / "all_config.yaml").write_text(
        "arch:\n" + "".join(f"  {k}: {v}\n" for k, v in ARCH.items()))
    out = tmp_path / "converted"
    assert cli.main(["convert", "air", str(tmp_path / "step_1000"), str(out), "--config",
                     str(tmp_path / "all_config.yaml"), "--seq-len", str(SEQ)]) == 0
    assert "AIRSolver Lx_H" in capsys.readouterr().out
    loaded = AIRSolver.from_pretrained(out)
    assert torch.equal(loaded.state_dict()["block.layers.1.mlp.down_proj.weight"],
                       _source(state, "f_level.layers.1.mlp.down_proj.weight"))
    assert cli.main(["convert", "air", str(tmp_path / "step_1000"), str(out)]) == 2
    assert "needs --config" in capsys.readouterr().err
    assert cli.main(["convert", "air", str(tmp_path / "step_1000"), str(out), "--config",
                     str(tmp_path / "all_config.yaml")]) == 2
    assert "pass seq_len" in capsys.readouterr().err
