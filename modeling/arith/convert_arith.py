"""The authors' checkpoints: TransformerLens state dicts of *Assign and Add* → ArithTransformer.

The authors trained with TransformerLens (``normalization_type=None``, ReLU MLPs, learned
absolute positions) and saved plain state dicts. TransformerLens stores each head's maps
separately: ``W_Q/W_K/W_V [H, D, d_head]`` (``q = x W_Q[h]``), ``W_O [H, d_head, D]``,
``W_in [D, d_mlp]``, ``W_out [d_mlp, D]``, ``W_U [D, vocab_out]``, with a bias beside each. Our
linear maps hold the same numbers transposed and with the heads stacked, and have no biases,
so a checkpoint converts exactly when its biases are zero; an all-zero MLP (the paper's layer 0)
is dropped, which changes nothing. Read the file with ``torch.load(path, weights_only=True)``
(``hf-memory convert arith`` does), so nothing but tensors is unpickled.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .configuration_arith import ArithConfig
from .modeling_arith import ArithTransformer

__all__ = ["CheckpointConversionError", "from_transformer_lens"]

_BUFFERS = re.compile(r"blocks\.\d+\.attn\.(mask|IGNORE)$")
_BLOCK = re.compile(r"blocks\.(\d+)\.(attn\.(W_[QKVO]|b_[QKVO])|mlp\.(W_in|b_in|W_out|b_out))$")
_TOP = {"embed.W_E", "pos_embed.W_pos", "unembed.W_U", "unembed.b_U"}


class CheckpointConversionError(ValueError):
    """The state dict is not one this model can reproduce exactly."""


def from_transformer_lens(state: Mapping[str, torch.Tensor],
                          num_variables: int = 12) -> ArithTransformer:
    """An :class:`ArithTransformer` computing exactly what the TransformerLens model computes
    (logits over the number tokens; a wider unembedding keeps its first ``modulus`` columns)."""
    state = {k: v for k, v in state.items() if not _BUFFERS.search(k)}
    unknown = sorted(k for k in state if k not in _TOP and not _BLOCK.fullmatch(k))
    if unknown:
        raise CheckpointConversionError(
            f"unexpected keys {unknown[:4]}{' …' if len(unknown) > 4 else ''}: the paper's model "
            "has no LayerNorm and no other parameters")
    missing = sorted({"embed.W_E", "pos_embed.W_pos", "unembed.W_U"} - set(state))
    if missing:
        raise CheckpointConversionError(f"not a TransformerLens state dict: missing {missing}")
    nonzero_biases = sorted(k for k, v in state.items() if ".b_" in k and bool(v.any()))
    if nonzero_biases:
        raise CheckpointConversionError(
            f"non-zero biases {nonzero_biases[:4]}: ArithTransformer has no biases, so this "
            "checkpoint cannot be reproduced exactly")
    layers = sorted({int(_BLOCK.fullmatch(k).group(1)) for k in state if k.startswith("blocks.")})
    if not layers or layers != list(range(len(layers))):
        raise CheckpointConversionError(f"blocks must be numbered 0..L-1, got {layers}")
    missing = sorted(f"blocks.{i}.attn.W_{n}" for i in layers for n in "QKVO"
                     if f"blocks.{i}.attn.W_{n}" not in state)
    if missing:
        raise CheckpointConversionError(f"not a TransformerLens state dict: missing {missing[:4]}")
    embed = state["embed.W_E"]
    heads, hidden, head_dim = state["blocks.0.attn.W_Q"].shape
    mlp_layers = [i for i in layers if f"blocks.{i}.mlp.W_in" in state
                  and (state[f"blocks.{i}.mlp.W_in"].any() or state[f"blocks.{i}.mlp.W_out"].any())]
    sizes = [state[f"blocks.{i}.mlp.W_in"].shape[1] for i in mlp_layers] or [4 * hidden]
    modulus = embed.shape[0] - 3 - num_variables
    unembed = state["unembed.W_U"]
    if unembed.shape[1] not in (modulus, embed.shape[0]):
        raise CheckpointConversionError(
            f"unembed.W_U has {unembed.shape[1]} outputs; expected {modulus} (the numbers) or "
            f"{embed.shape[0]} (the whole vocabulary) for {num_variables} variables")
    try:
        config = ArithConfig(modulus=modulus, num_variables=num_variables,
                             hidden_size=hidden, num_hidden_layers=len(layers),
                             num_attention_heads=heads, head_dim=head_dim,
                             intermediate_size=sizes[0], mlp_layers=mlp_layers,
                             max_position_embeddings=state["pos_embed.W_pos"].shape[0])
    except ValueError as error:
        raise CheckpointConversionError(f"sizes do not form an ArithConfig: {error}") from None
    weights = {"embed_tokens.weight": embed, "embed_positions.weight": state["pos_embed.W_pos"],
               "lm_head.weight": unembed[:, :modulus].T}
    for i in layers:
        prefix = f"blocks.{i}.attn."
        for name in "QKV":
            stacked = state[prefix + f"W_{name}"].permute(0, 2, 1).reshape(heads * head_dim, -1)
            weights[f"layers.{i}.self_attn.{name.lower()}_proj.weight"] = stacked
        weights[f"layers.{i}.self_attn.o_proj.weight"] = (
            state[prefix + "W_O"].reshape(heads * head_dim, hidden).T)
        if i in mlp_layers:
            weights[f"layers.{i}.mlp.up_proj.weight"] = state[f"blocks.{i}.mlp.W_in"].T
            weights[f"layers.{i}.mlp.down_proj.weight"] = state[f"blocks.{i}.mlp.W_out"].T
    model = ArithTransformer(config).to(embed.dtype)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    if got != expected:
        wrong = sorted(k for k in expected if got.get(k) != expected[k])
        raise CheckpointConversionError(f"inconsistent shapes for {wrong[:4]}")
    model.load_state_dict({k: v.contiguous() for k, v in weights.items()})
    return model.eval()
