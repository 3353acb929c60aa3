"""What steering installs on a shared model, once for every handle on it.

The first handle on a model switches it to the steered attention implementation and hooks the
pre-RoPE query of every layer; the hooks are inert without an active steering in the running
call. The last handle released restores the model exactly.
"""

from __future__ import annotations

import threading
import weakref

from torch import nn

from hf_memory.steering.attention import BASE_IMPLEMENTATIONS, IMPL_PREFIX, running_steering

__all__ = ["ModelHost", "acquire_host", "release_host"]


class ModelHost:
    """What steering installs on one shared model, for every handle on it: the steered attention
    implementation and inert hooks (pre-RoPE query capture at every layer, the audit pre-hook).
    Each hook asks the running call's active handle what to do; without one it does nothing."""

    def __init__(self, model: nn.Module, adapter) -> None:
        self.model, self.users = model, 0
        self.original = model.config._attn_implementation
        if self.original not in BASE_IMPLEMENTATIONS:
            raise ValueError(
                f"steering wraps the 'sdpa' or 'eager' attention; this model uses "
                f"{self.original!r}. Call model.set_attn_implementation('sdpa').")
        self.hooks = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        for layer in range(model.config.num_hidden_layers):
            attention = adapter.attention(model, layer)

            def capture(_module, _args, output, _attention=attention):
                handle = running_steering()
                if handle is not None:
                    handle._capture(_attention, output)

            self.hooks.append(getattr(attention, adapter.query_module)
                              .register_forward_hook(capture))
        model.set_attn_implementation(IMPL_PREFIX + self.original)

    def _on_forward(self, module, args, kwargs) -> None:
        handle = running_steering()
        if handle is not None and handle.model is module:
            handle._on_forward(args, kwargs)

    def uninstall(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.model.set_attn_implementation(self.original)


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
