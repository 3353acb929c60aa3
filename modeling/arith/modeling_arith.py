"""ArithTransformer: the paper's attention-only-then-MLP transformer for assign-and-add.

Token + learned absolute position embeddings, then ``num_hidden_layers`` blocks of causal
multi-head attention (no biases, no LayerNorm), an MLP only in ``config.mlp_layers`` (default:
the last layer), and an unembedding onto the ``modulus`` number tokens. The answer is read at the
last position (the ``=`` token). See README.md beside this file for the maths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_arith import ArithConfig

__all__ = ["ArithAttention", "ArithMLP", "ArithOutput", "ArithTransformer"]


@dataclass
class ArithOutput(ModelOutput):
    """Outputs of :class:`ArithTransformer`.

    Attributes:
        loss: cross-entropy of the last position's logits against ``labels`` (scalar).
        logits: ``[B, K, modulus]`` for the last ``K`` positions (``K = T`` unless
            ``logits_to_keep`` is set).
        hidden_states: the residual stream ``[B, T, D]`` after the embeddings, after every
            attention sub-layer and after every MLP (when ``output_hidden_states``).
        attentions: per layer ``[B, H, K_l, T]`` attention probabilities (when
            ``output_attentions``).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class ArithAttention(nn.Module):
    """Causal multi-head attention without biases; queries may cover only the last positions."""

    def __init__(self, config: ArithConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [B, T, D]`` -> ``(out [B, K, D], probs [B, H, K, T])``, last K queries."""
        b, t, _ = hidden.shape
        k_len = num_queries
        q = self.q_proj(hidden[:, t - k_len:]).view(b, k_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(b, t, self.num_heads, self.head_dim)
        v = self.v_proj(hidden).view(b, t, self.num_heads, self.head_dim)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        query_pos = torch.arange(t - k_len, t, device=hidden.device)
        future = torch.arange(t, device=hidden.device)[None, :] > query_pos[:, None]
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1)
        z = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, k_len, -1)
        return self.o_proj(z), probs


class ArithMLP(nn.Module):
    """``W_out act(W_in x)``, no biases."""

    def __init__(self, config: ArithConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = nn.ReLU() if config.hidden_act == "relu" else nn.GELU()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(hidden)))


class ArithLayer(nn.Module):
    """Residual attention, then (optionally) a residual MLP."""

    def __init__(self, config: ArithConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = ArithAttention(config)
        self.mlp = ArithMLP(config) if layer_idx in config.mlp_layers else None


class ArithTransformer(PreTrainedModel):
    """The paper's model: predicts ``(lhs + rhs) mod N`` at the last position.

    ``forward(input_ids [B, T], labels [B] | None)``; ``labels`` are the answers (numbers in
    ``[0, N)``) and the loss is the cross-entropy of the last position's logits. With
    ``logits_to_keep = k > 0`` the last layer computes queries, MLP and logits for the last ``k``
    positions only (exact for those positions, ~2x cheaper training).
    """

    config_class = ArithConfig
    base_model_prefix = "arith"
    main_input_name = "input_ids"
    _no_split_modules = ["ArithLayer"]

    def __init__(self, config: ArithConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(ArithLayer(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.modulus, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ArithOutput | tuple:
        b, t = input_ids.shape
        if t > self.config.max_position_embeddings:
            raise ValueError(
                f"input has {t} positions; the model has max_position_embeddings = "
                f"{self.config.max_position_embeddings}"
            )
        positions = torch.arange(t, device=input_ids.device)
        hidden = self.embed_tokens(input_ids) + self.embed_positions(positions)[None]
        states: list[torch.Tensor] = [hidden]
        attentions: list[torch.Tensor] = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            keep = logits_to_keep if (i == last and 0 < logits_to_keep <= t) else t
            out, probs = layer.self_attn(hidden, keep)
            hidden = hidden[:, t - keep:] + out
            states.append(hidden)
            attentions.append(probs)
            if layer.mlp is not None:
                hidden = hidden + layer.mlp(hidden)
                states.append(hidden)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, -1].float(), labels.to(logits.device))
        output = ArithOutput(
            loss=loss,
            logits=logits,
            hidden_states=tuple(states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
        return output if return_dict is not False else output.to_tuple()


ArithConfig.register_for_auto_class()
ArithTransformer.register_for_auto_class("AutoModel")
