"""The stock attention over the history, with the log-sum-exp that merges the banks into it.

A steered layer's mixture is one softmax over [history ; bank slots]; its history part is what
the model's own attention computes, and :func:`hf_memory.steering.mixture.bank_mixture_by_lse`
merges
the banks into that output through the history's log-sum-exp. This module runs that attention in
the model's dtype with the same fused kernel ``torch.nn.functional.scaled_dot_product_attention``
dispatches to, asking it for the log-sum-exp it already computes: on the CPU
``aten._scaled_dot_product_flash_attention_for_cpu`` (the public function discards its second
output). Grouped-query heads are handled as transformers' SDPA path does: a single query token
packs a KV group's heads as rows (no copy of the cache), longer queries read the KV heads
gathered per query head.

Where no such kernel is available (CUDA, for now: its LSE-returning kernels are not yet measured
or tested on a GPU here), :func:`lse_kernel_available` says so and steering recomputes the
history beside the stock call (:func:`hf_memory.steering.mixture.bank_mixture`), as before.
"""

from __future__ import annotations

import torch

__all__ = ["attention_with_lse", "lse_kernel_available"]

_CPU_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def lse_kernel_available(query: torch.Tensor) -> bool:
    """Whether :func:`attention_with_lse` has a kernel for ``query``'s device and dtype."""
    return query.device.type == "cpu" and query.dtype in _KERNEL_DTYPES


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    *,
    scaling: float,
    kv_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``query`` over the visible history, and its log-sum-exp.

    Args:
        query: ``[B, Hs, T, D]`` post-RoPE queries of the steered heads (all heads or a subset).
        key, value: the history ``[B, KVH, S, D]`` (the cache as the layer holds it).
        visible: boolean ``[B|1, 1|Hs, T, S]`` (True: attended), or None for causal attention
            without padding: every key visible to a single query (decoding), or a query as long
            as the history seeing its prefix (a prefill from an empty cache).
        scaling: the score scale.
        kv_index: ``[Hs]`` the KV head of each query head; None: every query head in order
            (head h reads KV head h // (H / KVH)).

    Returns:
        ``(output [B, Hs, T, D]`` in the query's dtype, ``lse [B, Hs, T]`` in float32, or
        float64 for float64 queries). A row that sees no key gets output 0 and lse −inf.
    """
    b, heads, t, d = query.shape
    kv_heads = key.shape[1]
    mask = None if visible is None else _additive(visible, query.dtype)
    if kv_index is None and t == 1 and heads != kv_heads:
        # one token: a KV group's query heads are the rows of one query (no copy of the cache)
        group = heads // kv_heads
        if mask is not None:
            mask = mask.reshape(mask.shape[0], kv_heads if mask.shape[1] != 1 else 1, -1,
                                mask.shape[-1])
        output, lse = _CPU_KERNEL(query.reshape(b, kv_heads, group, d), key, value, 0.0, False,
                                  attn_mask=mask, scale=scaling)
        output, lse = output.reshape(b, heads, 1, d), lse.reshape(b, heads, 1)
    else:
        if kv_index is not None:
            key, value = key[:, kv_index], value[:, kv_index]
        elif heads != kv_heads:
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        causal = mask is None and t > 1
        if causal and key.shape[2] != t:
            raise ValueError("attention_with_lse: a multi-token query over a longer history "
                             "needs its visibility mask")
        output, lse = _CPU_KERNEL(query, key, value, 0.0, causal, attn_mask=mask, scale=scaling)
    if visible is not None:
        lse = lse.masked_fill(~visible.any(-1), float("-inf"))
    return output, lse


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean visibility as the additive mask the fused kernel takes (0 / −inf)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf"))
