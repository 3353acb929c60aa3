"""ASMForCausalLM: Addressed State Attention language model (see README.md beside this file)."""

from __future__ import annotations

from .asm_kernels import (
    ScanState,
    asa_attend,
    asa_attend_chunked,
    asa_attend_ref,
    asa_attend_step,
    causal_linear_attention,
    causal_linear_attention_chunked,
    causal_linear_attention_ref,
    causal_linear_attention_step,
    slot_states_ref,
)
from .configuration_asm import ASMConfig
from .modeling_asm import (
    INTERVENTION_MODES,
    ASAAttention,
    ASMCache,
    ASMCausalLMOutput,
    ASMForCausalLM,
    ASMModel,
    ASMModelOutput,
    RefinementStats,
)

__all__ = [
    "INTERVENTION_MODES",
    "ASAAttention",
    "ASMCache",
    "ASMCausalLMOutput",
    "ASMConfig",
    "ASMForCausalLM",
    "ASMModel",
    "ASMModelOutput",
    "RefinementStats",
    "ScanState",
    "asa_attend",
    "asa_attend_chunked",
    "asa_attend_ref",
    "asa_attend_step",
    "causal_linear_attention",
    "causal_linear_attention_chunked",
    "causal_linear_attention_ref",
    "causal_linear_attention_step",
    "slot_states_ref",
]
