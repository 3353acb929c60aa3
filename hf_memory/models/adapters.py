"""Architecture facts for the stock decoders memory inception can steer.

One adapter per ``model_type`` says where the decoder layers live and where the pre-RoPE query,
key and value are observable:

- ``llama``, ``qwen2``: ``q_proj`` / ``k_proj`` / ``v_proj`` outputs, flat ``[B, T, H*D]``.
- ``qwen3``, ``qwen3_moe``: ``q_norm`` / ``k_norm`` outputs ``[B, T, H, D]`` (per-head RMSNorm
  sits between the projection and RoPE), ``v_proj`` flat.
- ``mistral``, ``mixtral`` (its experts sit outside attention): as llama; the sliding window
  reaches the mixture through the attention mask the stock model builds, so history beyond the
  window is masked while bank slots, which have no position, stay visible.
- ``granite``: as llama; its score scale (``attention_multiplier``) is the ``scaling`` the stock
  attention passes, which the mixture uses for history and bank columns alike; the attention
  output joins the residual stream times ``residual_multiplier``.
- ``olmo2``: ``q_norm`` / ``k_norm`` outputs, flat ``[B, T, H*D]`` (RMSNorm over the whole
  projection width, before the head split).
- ``gemma2``: as llama for the observables; its scores are scaled by ``query_pre_attn_scalar``
  (the ``scaling`` passed) and soft-capped (the ``softcap`` passed), and the mixture caps bank
  scores the same way; sliding and global layers reach it through the mask. Its eager
  attention is the one that caps (SDPA does not).
- ``phi3``: one fused ``qkv_proj``; the pre-RoPE query, key and value are its column blocks
  ``[H*D | KVH*D | KVH*D]``.
- ``gemma3_text``: ``q_norm`` / ``k_norm`` outputs ``[B, H, T, D]`` (per-head RMSNorm after the
  head transpose), scale ``query_pre_attn_scalar``; local and global layers have their own
  rotary map (``rotary(model, layer)``) and reach the mixture's mask as in gemma2.

The protocol an adapter fulfils: the decoder layers and each layer's attention module; modules
whose outputs are the pre-RoPE query, key and value (flat or per head); the rotary map of each
layer; where the residual stream right after attention can be read and written (CAA: OLMo-2 and
Gemma put a norm on the attention output before the residual add, so the write point is that
norm and the read point the next module);
and a stock attention function that receives the post-RoPE query, the cache's keys and values,
the mask (causal, padding, window) and the score scale, so that the mixture scores banks and
history alike.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "SUPPORTED_MODEL_TYPES", "ArchAdapter", "UnsupportedModelError", "get_adapter", "head_dim",
]


class UnsupportedModelError(ValueError):
    """The model's architecture has no memory-inception adapter."""


def head_dim(config) -> int:
    """Per-head width ``D`` of a decoder config."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class ArchAdapter:
    """Where to find attention internals in one decoder family."""

    model_type: str
    query_module: str
    key_module: str
    value_module: str = "v_proj"
    fused_qkv: bool = False  # one projection's output holds [query | key | value] columns
    heads_first: bool = False  # query/key modules output [B, H, T, D] (norm after the transpose)
    # a norm sits on the attention output before it joins the residual (OLMo-2, Gemma 2/3)
    post_norm: bool = False
    # the decoder-layer module whose input is the residual stream right after attention
    residual_reader: str = "post_attention_layernorm"
    # branches join the residual stream multiplied by this config field (Granite)
    residual_multiplier: str | None = None

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layers (``model.model.layers`` for a ``*ForCausalLM``)."""
        base = getattr(model, "model", model)
        return base.layers

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        return self.layers(model)[layer].self_attn

    def rotary(self, model: nn.Module, layer: int) -> Callable:
        """Layer ``layer``'s rotary map ``(x, position_ids) -> (cos, sin)``."""
        module = getattr(model, "model", model).rotary_emb
        layer_types = getattr(model.config, "layer_types", None)
        if "layer_type" in inspect.signature(module.forward).parameters and layer_types:
            return functools.partial(module, layer_type=layer_types[layer])  # local / global
        return module

    def residual_read(self, model: nn.Module, layer: int) -> nn.Module:
        """The module whose first input is the residual stream right after attention."""
        return getattr(self.layers(model)[layer], self.residual_reader)

    def residual_write(self, model: nn.Module, layer: int) -> nn.Module:
        """The module whose output joins the residual stream right after attention: the
        attention itself, or the norm on its output in a post-norm layer."""
        if self.post_norm:
            return self.layers(model)[layer].post_attention_layernorm
        return self.attention(model, layer)

    def residual_gain(self, model: nn.Module) -> float:
        """What the output of :meth:`residual_write` is multiplied by as it joins the stream."""
        return 1.0 if self.residual_multiplier is None else float(
            getattr(model.config, self.residual_multiplier))

    def submodule(self, model: nn.Module, layer: int, name: str) -> nn.Module:
        return getattr(self.attention(model, layer), name)

    @staticmethod
    def heads(captured: torch.Tensor, head_dim: int) -> torch.Tensor:
        """``[B, T, H*D]`` or ``[B, T, H, D]`` → ``[B, H, T, D]``."""
        if captured.dim() == 3:
            captured = captured.view(*captured.shape[:2], -1, head_dim)
        return captured.transpose(1, 2)

    @staticmethod
    def _fused_columns(config, part: int) -> slice:
        """Columns of part ``part`` (0 query, 1 key, 2 value) in a fused ``[q | k | v]``."""
        width = head_dim(config)
        q, kv = config.num_attention_heads * width, config.num_key_value_heads * width
        return (slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv))[part]

    def _part(self, captured: torch.Tensor, config, part: int) -> torch.Tensor:
        """Part ``part`` (0 query, 1 key, 2 value) of a captured output as ``[B, H, T, D]``."""
        if self.heads_first and part < 2:
            return captured
        if self.fused_qkv:
            captured = captured[..., self._fused_columns(config, part)]
        return self.heads(captured, head_dim(config))

    def key_weight(self, model: nn.Module, layer: int) -> torch.Tensor:
        """The key projection's weight ``[KVH*D, hidden]`` (the key rows of a fused one)."""
        attention = self.attention(model, layer)
        if not self.fused_qkv:
            return attention.k_proj.weight
        return attention.qkv_proj.weight[self._fused_columns(model.config, 1)]

    def query(self, captured: torch.Tensor, config) -> torch.Tensor:
        """The pre-RoPE query ``[B, H, T, D]`` from the output of ``query_module``."""
        return self._part(captured, config, 0)

    def key(self, captured: torch.Tensor, config) -> torch.Tensor:
        """The pre-RoPE key ``[B, KVH, T, D]`` from the output of ``key_module``."""
        return self._part(captured, config, 1)

    def value(self, captured: torch.Tensor, config) -> torch.Tensor:
        """The value ``[B, KVH, T, D]`` from the output of ``value_module``."""
        return self._part(captured, config, 2)


_ADAPTERS = {
    "llama": ArchAdapter("llama", query_module="q_proj", key_module="k_proj"),
    "qwen2": ArchAdapter("qwen2", query_module="q_proj", key_module="k_proj"),
    "qwen3": ArchAdapter("qwen3", query_module="q_norm", key_module="k_norm"),
    "qwen3_moe": ArchAdapter("qwen3_moe", query_module="q_norm", key_module="k_norm"),
    "mistral": ArchAdapter("mistral", query_module="q_proj", key_module="k_proj"),
    "mixtral": ArchAdapter("mixtral", query_module="q_proj", key_module="k_proj"),
    "granite": ArchAdapter("granite", query_module="q_proj", key_module="k_proj",
                           residual_multiplier="residual_multiplier"),
    "olmo2": ArchAdapter("olmo2", query_module="q_norm", key_module="k_norm", post_norm=True,
                         residual_reader="mlp"),
    "gemma2": ArchAdapter("gemma2", query_module="q_proj", key_module="k_proj", post_norm=True,
                          residual_reader="pre_feedforward_layernorm"),
    "phi3": ArchAdapter("phi3", query_module="qkv_proj", key_module="qkv_proj",
                        value_module="qkv_proj", fused_qkv=True),
    "gemma3_text": ArchAdapter("gemma3_text", query_module="q_norm", key_module="k_norm",
                               heads_first=True, post_norm=True,
                               residual_reader="pre_feedforward_layernorm"),
}
SUPPORTED_MODEL_TYPES = tuple(_ADAPTERS)


def get_adapter(model_or_type: nn.Module | str) -> ArchAdapter:
    """The adapter for a model (or a ``model_type`` string); a clear error for anything else."""
    model_type = (model_or_type if isinstance(model_or_type, str)
                  else getattr(getattr(model_or_type, "config", None), "model_type", None))
    if model_type not in _ADAPTERS:
        raise UnsupportedModelError(
            f"memory inception does not support model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return _ADAPTERS[model_type]
