"""The authors' TransformerLens checkpoints convert into ArithTransformer with identical logits."""

from __future__ import annotations

import math

import pytest
import torch

import hf_memory_cli as cli
from modeling.arith import ArithTransformer
from modeling.arith.convert_arith import CheckpointConversionError, from_transformer_lens

N, V, T, D, H, E, M = 7, 3, 10, 16, 2, 8, 24  # modulus, variables, positions, d, heads, d_head, mlp
VOCAB = N + 3 + V


def tl_state(vocab_out: int = N, zero_first_mlp: bool = True, seed: int = 0) -> dict:
    """A TransformerLens-layout state dict with the paper's structure (random weights)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(D)

    state = {"embed.W_E": rand(VOCAB, D), "pos_embed.W_pos": rand(T, D),
             "unembed.W_U": rand(D, vocab_out), "unembed.b_U": torch.zeros(vocab_out,
                                                                           dtype=torch.float64)}
    for i in range(2):
        p = f"blocks.{i}."
        for name in "QKV":
            state[p + f"attn.W_{name}"] = rand(H, D, E)
            state[p + f"attn.b_{name}"] = torch.zeros(H, E, dtype=torch.float64)
        state[p + "attn.W_O"] = rand(H, E, D)
        state[p + "attn.b_O"] = torch.zeros(D, dtype=torch.float64)
        state[p + "attn.mask"] = torch.tril(torch.ones(T, T, dtype=torch.bool))
        state[p + "attn.IGNORE"] = torch.tensor(-torch.inf)
        zero = zero_first_mlp and i == 0
        state[p + "mlp.W_in"] = torch.zeros(D, M, dtype=torch.float64) if zero else rand(D, M)
        state[p + "mlp.b_in"] = torch.zeros(M, dtype=torch.float64)
        state[p + "mlp.W_out"] = torch.zeros(M, D, dtype=torch.float64) if zero else rand(M, D)
        state[p + "mlp.b_out"] = torch.zeros(D, dtype=torch.float64)
    return state


def tl_forward(state: dict, tokens: torch.Tensor) -> torch.Tensor:
    """TransformerLens's forward written from its documented conventions (no LayerNorm)."""
    t = tokens.shape[1]
    x = state["embed.W_E"][tokens] + state["pos_embed.W_pos"][:t]
    for i in range(2):
        p = f"blocks.{i}."
        q, k, v = (torch.einsum("btd,hde->bthe", x, state[p + f"attn.W_{n}"])
                   + state[p + f"attn.b_{n}"] for n in "QKV")
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(E)
        scores = scores.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), -torch.inf)
        z = torch.einsum("bhqk,bkhe->bqhe", scores.softmax(-1), v)
        x = x + torch.einsum("bqhe,hed->bqd", z, state[p + "attn.W_O"]) + state[p + "attn.b_O"]
        pre = x @ state[p + "mlp.W_in"] + state[p + "mlp.b_in"]
        x = x + pre.relu() @ state[p + "mlp.W_out"] + state[p + "mlp.b_out"]
    return x @ state["unembed.W_U"] + state["unembed.b_U"]


def tokens(rows: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("vocab_out", [N, VOCAB])
@pytest.mark.parametrize("zero_first_mlp", [True, False])
def test_converted_model_gives_the_transformer_lens_logits(vocab_out, zero_first_mlp):
    state = tl_state(vocab_out, zero_first_mlp)
    model = from_transformer_lens(state, num_variables=V)
    assert model.config.mlp_layers == ([1] if zero_first_mlp else [0, 1])
    assert (model.config.modulus, model.config.num_attention_heads) == (N, H)
    ids = tokens()
    with torch.no_grad():
        ours = model(ids).logits
    torch.testing.assert_close(ours, tl_forward(state, ids)[..., :N], rtol=0, atol=1e-12)


def test_cli_writes_a_folder_that_loads_with_the_same_logits(tmp_path, capsys):
    state = tl_state()
    torch.save(state, tmp_path / "model.pth")
    out = tmp_path / "converted"
    assert cli.main(["convert", "arith", str(tmp_path / "model.pth"), str(out),
                     "--num-variables", str(V)]) == 0
    assert "MLP after layers [1]" in capsys.readouterr().out
    loaded = ArithTransformer.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens()).logits, tl_forward(state, tokens())[..., :N],
                                   rtol=0, atol=1e-12)


@pytest.mark.parametrize("change, message", [
    (lambda s: s["blocks.1.attn.b_Q"].add_(0.1), "non-zero biases ['blocks.1.attn.b_Q']"),
    (lambda s: s.update({"blocks.0.ln1.w": torch.ones(D)}), "unexpected keys"),
    (lambda s: s.pop("unembed.W_U"), "missing ['unembed.W_U']"),
    (lambda s: s.pop("blocks.1.attn.W_O"), "missing ['blocks.1.attn.W_O']"),
    (lambda s: s.update({"unembed.W_U": torch.zeros(D, 5)}), "unembed.W_U has 5 outputs"),
])
def test_checkpoints_we_cannot_reproduce_are_refused(change, message):
    state = tl_state()
    change(state)
    with pytest.raises(CheckpointConversionError) as error:
        from_transformer_lens(state, num_variables=V)
    assert message in str(error.value)


class NotATensor:
    pass


def test_only_tensors_are_unpickled_and_bad_files_are_one_line_errors(tmp_path, capsys):
    torch.save({"embed.W_E": NotATensor()}, tmp_path / "evil.pth")
    (tmp_path / "cut.pth").write_bytes(b"PK\x03\x04 truncated")
    out = str(tmp_path / "o")
    for name, message in (("evil.pth", "not a tensors-only"), ("cut.pth", "tensors-only"),
                          ("none.pth", "no checkpoint")):
        assert cli.main(["convert", "arith", str(tmp_path / name), out]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "o").exists()
