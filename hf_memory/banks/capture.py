"""Record keys and values exactly as a stock model computes them, via forward hooks."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn

from hf_memory.models.adapters import get_adapter

__all__ = ["capture_kv", "capture_outputs"]


@contextmanager
def capture_outputs(modules: dict[str, nn.Module]):
    """Within the block, ``store[name]`` holds the latest output of ``modules[name]``."""
    store: dict[str, torch.Tensor] = {}
    handles = []
    try:
        for name, module in modules.items():
            def hook(_module, _args, output, _name=name):
                store[_name] = output.detach()
            handles.append(module.register_forward_hook(hook))
        yield store
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def capture_kv(
    model: nn.Module,
    input_ids: torch.Tensor,
    layers: Sequence[int],
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-RoPE keys and values of ``input_ids`` at ``layers``.

    Keys are k = W_K·Norm(h) (after ``k_norm`` on Qwen3), before the rotary map; values are
    v = W_V·Norm(h). Returns ``(keys, values)``, each ``[len(layers), B, KVH, T, D]``.
    """
    adapter = get_adapter(model)
    modules = {}
    for layer in layers:
        modules[f"k{layer}"] = adapter.submodule(model, layer, adapter.key_module)
        modules[f"v{layer}"] = adapter.submodule(model, layer, adapter.value_module)
    with capture_outputs(modules) as store:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    keys = torch.stack([adapter.key(store[f"k{layer}"], model.config) for layer in layers])
    values = torch.stack([adapter.value(store[f"v{layer}"], model.config) for layer in layers])
    return keys, values
