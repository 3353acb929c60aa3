"""The matched Transformer baseline of an ASM: a stock transformers Llama of the same shape.

Same width, depth, head count, vocabulary, tied embeddings and context; the MLP width (SwiGLU,
three matrices) is chosen so the parameter count is the closest to the ASM's, within 5 % — the
comparison the paper's first version lacked (its Transformer-42M was not matched).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .configuration_asm import ASMConfig
from .modeling_asm import ASMForCausalLM

__all__ = ["count_parameters", "matched_llama_config"]

MATCH_TOLERANCE = 0.05


def count_parameters(model) -> int:
    """Distinct trainable-or-not parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _llama(config: ASMConfig, intermediate_size: int, **overrides) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None),
        pad_token_id=getattr(config, "pad_token_id", None),
        initializer_range=config.initializer_range, **overrides)


def matched_llama_config(config: ASMConfig, **overrides) -> LlamaConfig:
    """A ``LlamaConfig`` with ``config``'s shape and the ASM's parameter count (±5 %).

    Raises:
        ValueError: no MLP width brings the count within 5 % (a shape where attention alone
            outweighs the ASM).
    """
    with torch.device("meta"):
        target = count_parameters(ASMForCausalLM(config))
        fixed = count_parameters(LlamaForCausalLM(_llama(config, 1, **overrides)))
    per_unit = 3 * config.hidden_size * config.num_hidden_layers
    width = max(1, round((target - fixed) / per_unit) + 1)
    llama = _llama(config, width, **overrides)
    with torch.device("meta"):
        count = count_parameters(LlamaForCausalLM(llama))
    if abs(count - target) > MATCH_TOLERANCE * target:
        raise ValueError(f"no Llama MLP width matches the ASM's {target:,} parameters within 5 % "
                         f"(closest: {count:,} at intermediate_size {width})")
    return llama

