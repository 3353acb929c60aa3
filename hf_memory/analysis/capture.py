"""Hooks that record, per feed-forward layer, the residual r, coefficients m and output y.

``r`` [B, T, d] is the input of the norm in front of the MLP (forward pre-hook), ``m`` [B, T, M]
the input of the output projection (forward pre-hook) and ``y`` [B, T, d] the MLP's output
(forward hook); the block output is ``o = r + y``, bit-for-bit what the decoder layer returns.
``final`` [B, T, d] is the output of the final norm, i.e. what the unembedding sees.
Every hook is removed on exit, also on exceptions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .mlp_adapter import FFNAdapter

__all__ = ["FFNRecord", "capture_ffn", "ffn_streams"]


@dataclass
class FFNRecord:
    """Tensors of the last forward pass, keyed by layer index (detached, not cloned)."""

    residual: dict[int, torch.Tensor] = field(default_factory=dict)
    coefficients: dict[int, torch.Tensor] = field(default_factory=dict)
    ffn_output: dict[int, torch.Tensor] = field(default_factory=dict)
    final: torch.Tensor | None = None

    def block_output(self, layer: int) -> torch.Tensor:
        """``o = r + y`` [B, T, d] of ``layer``."""
        return self.residual[layer] + self.ffn_output[layer]


@contextmanager
def capture_ffn(adapter: FFNAdapter, layers: list[int] | None = None) -> Iterator[FFNRecord]:
    """Record r, m, y of ``layers`` (default all) and the final-norm output while active."""
    record = FFNRecord()
    handles = []

    def keep(store: dict[int, torch.Tensor], index: int, from_input: bool):
        def hook(module, args, output=None):
            store[index] = (args[0] if from_input else output).detach()
        return hook

    def keep_final(module, args, output):
        record.final = output.detach()

    try:
        for index in adapter.check_layers(layers):
            layer = adapter.layers[index]
            handles.append(layer.norm.register_forward_pre_hook(
                keep(record.residual, index, True)))
            handles.append(layer.out_proj.register_forward_pre_hook(
                keep(record.coefficients, index, True)))
            handles.append(layer.mlp.register_forward_hook(
                keep(record.ffn_output, index, False)))
        handles.append(adapter.final_norm.register_forward_hook(keep_final))
        yield record
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def ffn_streams(model: torch.nn.Module, adapter: FFNAdapter, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, layers: list[int] | None = None
                ) -> FFNRecord:
    """One forward pass of ``input_ids`` [B, T], returning the recorded streams."""
    with capture_ffn(adapter, layers) as record:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return record
