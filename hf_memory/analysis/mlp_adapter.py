"""Where a model keeps its feed-forward memories: one adapter for gated and for ReLU MLPs.

Geva et al. write a feed-forward layer as ``FF(x) = f(x Kᵀ) V``: the rows of ``K`` are keys, the
rows of ``V`` values and ``m = f(x Kᵀ)`` the memory coefficients (the hidden layer). We use:

``gated`` (SwiGLU: Llama, Qwen2, Qwen3; ``gate_proj`` / ``up_proj`` / ``down_proj``)
    key i = the pair (row i of ``gate_proj``, row i of ``up_proj``);
    coefficient ``m_i = act(gate_i·x) · (up_i·x)``, i.e. exactly the input of ``down_proj``;
    value ``v_i`` = column i of ``down_proj.weight``. ``m_i`` is **signed**: ``m_i < 0`` writes
    ``-v_i``, so each memory has two polarities, (i, +) writing ``+v_i`` and (i, -) writing
    ``-v_i``.
``relu`` (our own models: ``fc_in`` -> ReLU -> ``fc_out``)
    key i = row i of ``fc_in``; ``m_i = ReLU(k_i·x + b_i) >= 0``; value ``v_i`` = column i of
    ``fc_out.weight``. Only the + polarity exists, as in the paper.

In both cases the coefficients are captured with a forward pre-hook on the output projection, so
they are what the model computes, not a re-derivation. ``x`` is the normalised residual
(the output of the norm in front of the MLP); ``r`` is that norm's input, ``y`` the MLP's output
and ``o = r + y`` the block output. Biases of the output projection (``b^l``) are not memories.

Layout expected (stock Llama / Qwen2 / Qwen3 and our own models follow it): decoder layers at
``model.model.layers``, each with ``post_attention_layernorm`` and ``mlp``; final norm at
``model.model.norm``; unembedding ``model.get_output_embeddings()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

__all__ = ["FFNAdapter", "FFNLayer", "MLPKind", "ffn_adapter"]

MLPKind = Literal["gated", "relu"]
SUPPORTED = (
    "gated MLPs with gate_proj/up_proj/down_proj (llama, qwen2, qwen3) and "
    "ReLU MLPs with fc_in/fc_out and a ReLU activation"
)


@dataclass(frozen=True)
class FFNLayer:
    """One feed-forward block: its input norm (input ``r``), the MLP, its output projection."""

    index: int
    norm: nn.Module
    mlp: nn.Module
    out_proj: nn.Linear

    @property
    def values(self) -> torch.Tensor:
        """Value vectors as rows, ``[M, d]`` (row i = column i of the output projection)."""
        return self.out_proj.weight.detach().T


@dataclass(frozen=True)
class FFNAdapter:
    """The feed-forward memories of a causal LM and what is needed to read them."""

    kind: MLPKind
    layers: tuple[FFNLayer, ...]
    final_norm: nn.Module
    unembedding: nn.Module

    @property
    def signed(self) -> bool:
        """Whether coefficients can be negative (gated: yes; ReLU: no)."""
        return self.kind == "gated"

    @property
    def num_memories(self) -> int:
        return self.layers[0].out_proj.in_features

    def check_layers(self, layers: list[int] | tuple[int, ...] | None) -> list[int]:
        """Validate layer indices (negative ones count from the end); ``None`` means all."""
        count = len(self.layers)
        if layers is None:
            return list(range(count))
        if len(layers) == 0:
            raise ValueError("layers is empty; pass None for all layers")
        checked = []
        for layer in layers:
            if not isinstance(layer, int) or not -count <= layer < count:
                raise ValueError(
                    f"unknown layer index {layer!r}: the model has {count} layers (0..{count - 1})"
                )
            checked.append(layer % count)
        if len(set(checked)) != len(checked):
            raise ValueError(f"duplicate layer indices in {list(layers)}")
        return sorted(checked)


def _mlp_kind(mlp: nn.Module, index: int) -> tuple[MLPKind, nn.Linear]:
    names = {"gate_proj", "up_proj", "down_proj"}
    if all(isinstance(getattr(mlp, n, None), nn.Linear) for n in names):
        return "gated", mlp.down_proj
    act = getattr(mlp, "act_fn", getattr(mlp, "act", None))
    if (
        isinstance(getattr(mlp, "fc_in", None), nn.Linear)
        and isinstance(getattr(mlp, "fc_out", None), nn.Linear)
        and isinstance(act, nn.ReLU)
    ):
        return "relu", mlp.fc_out
    raise ValueError(
        f"unsupported MLP {type(mlp).__name__} in layer {index}; supported: {SUPPORTED}"
    )


def ffn_adapter(model: nn.Module) -> FFNAdapter:
    """Find the feed-forward memories of ``model`` (see the module docstring for the layout).

    Raises:
        ValueError: the layout is not found or an MLP is neither gated nor ReLU (e.g. a
            mixture-of-experts block), naming the supported kinds.
    """
    base = getattr(model, "model", None)
    decoder_layers = getattr(base, "layers", None)
    final_norm = getattr(base, "norm", None)
    unembedding = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder_layers is None or final_norm is None or unembedding is None:
        raise ValueError(
            f"{type(model).__name__} does not have the expected layout (model.model.layers, "
            "model.model.norm, get_output_embeddings()); supported: " + SUPPORTED
        )
    layers, kinds = [], set()
    for index, block in enumerate(decoder_layers):
        norm = getattr(block, "post_attention_layernorm", None)
        mlp = getattr(block, "mlp", None)
        if norm is None or mlp is None:
            raise ValueError(f"layer {index} has no post_attention_layernorm / mlp")
        kind, out_proj = _mlp_kind(mlp, index)
        kinds.add(kind)
        layers.append(FFNLayer(index, norm, mlp, out_proj))
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers")
    if len(kinds) != 1:
        raise ValueError(f"mixed MLP kinds {sorted(kinds)} are not supported")
    return FFNAdapter(kinds.pop(), tuple(layers), final_norm, unembedding)
