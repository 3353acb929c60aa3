"""Tiny randomly initialised stock decoders, built in code the way transformers tests itself."""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, pad_token_id=0)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "experts_implementation": "eager"}),  # grouped_mm has no float64
    # a window shorter than the tests' prompts: the history beyond it is masked, banks are not
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 5}),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                {"sliding_window": 5, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "experts_implementation": "eager"}),
    # the score scale is attention_multiplier, not 1/sqrt(D); embedding, residual and logit
    # multipliers sit outside attention
    "granite": (GraniteConfig, GraniteForCausalLM,
                {"attention_multiplier": 0.3, "embedding_multiplier": 2.0,
                 "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    # q/k RMSNorm over the whole projection width, before the head split
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {}),
    # logit soft-capping (tight, so that it bites), query_pre_attn_scalar as the score scale,
    # sliding and global layers alternating
    "gemma2": (Gemma2Config, Gemma2ForCausalLM,
               {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0,
                "query_pre_attn_scalar": 24, "sliding_window": 5}),
    # one fused qkv projection; partial rotary (half of each head rotated)
    "phi3": (Phi3Config, Phi3ForCausalLM, {"partial_rotary_factor": 0.5}),
    # per-head q/k norm after the head transpose; local (sliding) and global layers with their
    # own rotary maps
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM,
                    {"query_pre_attn_scalar": 24, "sliding_window": 5,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
}
# the stock attention that honours each family's score transformation (SDPA has no soft-cap)
DEFAULT_ATTENTION = {"gemma2": "eager"}


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float64,
               attn: str | None = None, **overrides):
    """A tiny ``family`` model in eval mode: 3 layers, 4 query heads, 2 KV heads, head_dim 16."""
    config_class, model_class, extra = FAMILIES[family]
    config = config_class(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).to(dtype).eval()
    model.set_attn_implementation(attn or DEFAULT_ATTENTION.get(family, "sdpa"))
    return model
