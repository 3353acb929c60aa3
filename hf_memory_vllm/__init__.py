"""Memory inception served by stock vLLM: a plugin, not a fork.

Installed with ``pip install hf-memory[vllm]`` (or ``make vllm-env``), it registers through two
entry points that vLLM loads in every process:

- ``vllm.general_plugins`` → :func:`register`: vLLM's Llama, Qwen2, Qwen3, Qwen3-MoE, Granite
  and Phi-3 classes, subclassed with steering hooks (:mod:`hf_memory_vllm.models`), replace the
  built-in ones;
- ``vllm.logits_processors`` → :class:`~hf_memory_vllm.requests.MemorySteeringRequests`, which
  validates each request's steering arguments and tells the workers which request steers how.

A server steers with the bank sets of a registry (:func:`write_registry`) named by
``$HF_MEMORY_VLLM_REGISTRY``; each request picks one with :func:`steering_args` in
``SamplingParams.extra_args`` (``vllm_xargs`` over HTTP) and should carry :func:`cache_salt`
as its prompt's ``cache_salt``. Without a registry the plugin does nothing.
"""

from __future__ import annotations

from .registry import (
    DEFAULT_MAX_SLOT_LAYERS,
    REGISTRY_ENV,
    Registry,
    RegistryError,
    SteeringRequest,
    bank_set_size,
    cache_salt,
    parse_request,
    steering_args,
    write_registry,
)

__all__ = ["DEFAULT_MAX_SLOT_LAYERS", "REGISTRY_ENV", "Registry", "RegistryError",
           "SERVED_ARCHITECTURES", "SteeringRequest", "bank_set_size", "cache_salt",
           "parse_request", "register", "steering_args", "write_registry"]


# the vLLM architectures served steered (:data:`hf_memory_vllm.models.ARCHITECTURES`)
SERVED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "Qwen3MoeForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM",
                        "MistralForCausalLM", "MixtralForCausalLM", "Gemma2ForCausalLM",
                        "Gemma3ForCausalLM")


def register() -> None:
    """vLLM general plugin: serve the supported architectures with steering hooks."""
    from vllm import ModelRegistry

    for architecture in SERVED_ARCHITECTURES:
        ModelRegistry.register_model(
            architecture, f"hf_memory_vllm.models:Steered{architecture}")
