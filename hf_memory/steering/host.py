"""What steering installs on a shared model, once for every handle on it.

The first handle on a model switches it to the steered attention implementation and hooks the
pre-RoPE query of every layer; the hooks are inert without an active steering in the running
call. The last handle released restores the model exactly.
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch
from torch import nn

from hf_memory.steering.attention import (
    BASE_IMPLEMENTATIONS,
    IMPL_PREFIX,
    ROTARY_KWARG,
    STEERING_KWARG,
    running_steering,
)

__all__ = ["ModelHost", "acquire_host", "release_host"]


class ModelHost:
    """What steering installs on one shared model, for every handle on it: the steered attention
    implementation and inert hooks (pre-RoPE query capture at every layer, the forward pre-hook
    that audits a steered call and hands its steering down as a keyword argument, and one per
    attention layer that hands the layer's rotary embedding to a steered call's attention).
    Each hook asks the running call's live steering what to do; without one it does nothing."""

    def __init__(self, model: nn.Module, adapter) -> None:
        self.model, self.users = model, 0
        self.original = model.config._attn_implementation
        if self.original not in BASE_IMPLEMENTATIONS:
            raise ValueError(
                f"steering wraps the 'sdpa' or 'eager' attention; this model uses "
                f"{self.original!r}. Call model.set_attn_implementation('sdpa').")
        self.passes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD
                                 for p in inspect.signature(model.forward).parameters.values())
        self.hooks = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        for layer in range(model.config.num_hidden_layers):
            attention = adapter.attention(model, layer)

            def capture(_module, _args, output, _attention=attention):
                if torch.compiler.is_compiling():
                    return  # traced: the attention recovers the query from its rotary
                handle = running_steering()
                if handle is not None:
                    handle._capture(_attention, output)

            self.hooks.append(getattr(attention, adapter.query_module)
                              .register_forward_hook(capture))
            self.hooks.append(attention.register_forward_pre_hook(_pass_rotary,
                                                                  with_kwargs=True))
        model.set_attn_implementation(IMPL_PREFIX + self.original)

    def _on_forward(self, module, args, kwargs):
        handle = running_steering()
        if handle is None or handle.model is not module:
            return None
        handle._on_forward(args, kwargs)
        return (args, {**kwargs, STEERING_KWARG: handle}) if self.passes_kwargs else None

    def uninstall(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.model.set_attn_implementation(self.original)


def _pass_rotary(_attention, args, kwargs):
    """A steered call's attention layer: its rotary ``(cos, sin)`` goes on to the attention
    function too."""
    if kwargs.get(STEERING_KWARG) is not None and "position_embeddings" in kwargs:
        return args, {**kwargs, ROTARY_KWARG: kwargs["position_embeddings"]}
    return None


_HOSTS: weakref.WeakKeyDictionary[nn.Module, ModelHost] = weakref.WeakKeyDictionary()
_HOSTS_LOCK = threading.Lock()


def acquire_host(model: nn.Module, adapter) -> ModelHost:
    with _HOSTS_LOCK:
        host = _HOSTS.get(model)
        if host is None:
            host = _HOSTS[model] = ModelHost(model, adapter)
        host.users += 1
        return host


def release_host(host: ModelHost) -> None:
    with _HOSTS_LOCK:
        host.users -= 1
        if host.users == 0:
            del _HOSTS[host.model]
            host.uninstall()
