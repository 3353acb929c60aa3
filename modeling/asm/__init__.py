"""ASMForCausalLM: Addressed State Attention language model (see README.md beside this file)."""

from __future__ import annotations

from .asm_chunk_autograd import asa_attend_chunk_autograd, causal_linear_attention_chunk_autograd
from .asm_common import ScanState
from .asm_naive import asa_attend_naive, causal_linear_attention_naive, slot_states_naive
from .asm_ops import asa_attend, causal_linear_attention
from .asm_recurrent import asa_attend_step, causal_linear_attention_step
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
    "asa_attend_chunk_autograd",
    "asa_attend_naive",
    "asa_attend_step",
    "causal_linear_attention",
    "causal_linear_attention_chunk_autograd",
    "causal_linear_attention_naive",
    "causal_linear_attention_step",
    "slot_states_naive",
]
