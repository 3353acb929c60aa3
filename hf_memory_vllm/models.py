"""vLLM's own Llama, Qwen2, Qwen3, Qwen3-MoE, Granite, Phi-3, Mistral, Mixtral, Gemma 2 and
Gemma 3 (text) classes with memory-inception steering attached.

Each class subclasses vLLM's implementation unchanged and only adds a
:class:`~hf_memory_vllm.worker.WorkerSteering` (hooks on the layers some registered bank set
covers; none when no registry is configured) and its weight check after loading.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.granite import GraniteForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.phi3 import Phi3ForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from . import SERVED_ARCHITECTURES
from .worker import WorkerSteering

__all__ = ["ARCHITECTURES", "SteeredGemma2ForCausalLM", "SteeredGemma3ForCausalLM",
           "SteeredGraniteForCausalLM",
           "SteeredLlamaForCausalLM", "SteeredMistralForCausalLM", "SteeredMixtralForCausalLM",
           "SteeredPhi3ForCausalLM", "SteeredQwen2ForCausalLM", "SteeredQwen3ForCausalLM",
           "SteeredQwen3MoeForCausalLM"]


class _Steered:
    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.memory_steering = WorkerSteering(self, vllm_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        self.memory_steering.bind()
        return loaded


class SteeredLlamaForCausalLM(_Steered, LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM`` with memory-inception steering."""


class SteeredQwen2ForCausalLM(_Steered, Qwen2ForCausalLM):
    """vLLM's ``Qwen2ForCausalLM`` with memory-inception steering."""


class SteeredQwen3ForCausalLM(_Steered, Qwen3ForCausalLM):
    """vLLM's ``Qwen3ForCausalLM`` with memory-inception steering."""


class SteeredQwen3MoeForCausalLM(_Steered, Qwen3MoeForCausalLM):
    """vLLM's ``Qwen3MoeForCausalLM`` with memory-inception steering."""


class SteeredGraniteForCausalLM(_Steered, GraniteForCausalLM):
    """vLLM's ``GraniteForCausalLM`` with memory-inception steering."""


class SteeredMistralForCausalLM(_Steered, MistralForCausalLM):
    """vLLM's ``MistralForCausalLM`` with memory-inception steering (its sliding window kept)."""


class SteeredMixtralForCausalLM(_Steered, MixtralForCausalLM):
    """vLLM's ``MixtralForCausalLM`` with memory-inception steering (its sliding window kept)."""


class SteeredGemma2ForCausalLM(_Steered, Gemma2ForCausalLM):
    """vLLM's ``Gemma2ForCausalLM`` with memory-inception steering (soft-cap and windows kept)."""


class SteeredGemma3ForCausalLM(_Steered, Gemma3ForCausalLM):
    """vLLM's ``Gemma3ForCausalLM`` (text) with memory-inception steering (local and global
    rotary per layer, windows kept)."""


class SteeredPhi3ForCausalLM(_Steered, Phi3ForCausalLM):
    """vLLM's ``Phi3ForCausalLM`` with memory-inception steering."""


ARCHITECTURES = {"LlamaForCausalLM": SteeredLlamaForCausalLM,
                 "Gemma2ForCausalLM": SteeredGemma2ForCausalLM,
                 "Gemma3ForCausalLM": SteeredGemma3ForCausalLM,
                 "GraniteForCausalLM": SteeredGraniteForCausalLM,
                 "MistralForCausalLM": SteeredMistralForCausalLM,
                 "MixtralForCausalLM": SteeredMixtralForCausalLM,
                 "Phi3ForCausalLM": SteeredPhi3ForCausalLM,
                 "Qwen2ForCausalLM": SteeredQwen2ForCausalLM,
                 "Qwen3ForCausalLM": SteeredQwen3ForCausalLM,
                 "Qwen3MoeForCausalLM": SteeredQwen3MoeForCausalLM}
assert set(ARCHITECTURES) == set(SERVED_ARCHITECTURES), "register() and ARCHITECTURES disagree"
