"""The stock attention over the history, with the log-sum-exp that merges the banks into it.

A steered layer's mixture is one softmax over [history ; bank slots]; its history part is what
the model's own attention computes, and :func:`hf_memory.steering.mixture.bank_mixture_by_lse`
merges the banks into that output through the history's log-sum-exp. This module runs that
attention in the model's dtype with the fused kernel ``torch.nn.functional.
scaled_dot_product_attention`` dispatches to, asking it for the log-sum-exp it computes anyway
(the public function discards it):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (float32/64, bf16, fp16);
* CUDA: ``aten._scaled_dot_product_flash_attention`` for bf16/fp16 without a mask (SDPA's own
  choice there), ``aten._scaled_dot_product_efficient_attention`` with a mask or in float32
  (SDPA's choice with a mask; it reads the mask in rows aligned to 16 elements, so one that is
  not is copied into such rows, as SDPA does). Measured against the alternatives (cuDNN's
  kernel, flex attention's ``return_lse``) by ``benchmarks/gpu_lse_kernels.py``.

Grouped-query heads are handled as transformers' SDPA path does: a single query token packs a
KV group's heads as rows (no copy of the cache), longer queries read the KV heads gathered per
query head. Where no kernel applies (float64 on CUDA, other devices), :func:`lse_kernel_available`
says so and steering recomputes the history beside the stock call
(:func:`hf_memory.steering.mixture.bank_mixture`), as before.
"""

from __future__ import annotations

import torch

__all__ = ["attention_with_lse", "lse_kernel_available"]

_CPU_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CUDA_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_CUDA_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_KERNEL_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}
_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_BIAS_ALIGNMENT = 16  # elements per row of the memory-efficient kernel's bias


def lse_kernel_available(query: torch.Tensor) -> bool:
    """Whether :func:`attention_with_lse` has a kernel for ``query``'s device and dtype."""
    return query.dtype in _KERNEL_DTYPES.get(query.device.type, ())


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
        output, lse = _fused(query.reshape(b, kv_heads, group, d), key, value, mask, False,
                             scaling)
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
        output, lse = _fused(query, key, value, mask, causal, scaling)
    if visible is not None:
        blind = ~visible.any(-1)
        lse = lse.masked_fill(blind, float("-inf"))
        if query.device.type != "cpu":  # (the CUDA kernels leave such a row undefined)
            output = output.masked_fill(blind[..., None], 0.0)
    return output, lse


def _fused(query, key, value, mask, causal: bool, scaling: float):
    """``(output, lse [B, H, T])`` from the fused kernel for ``query``'s device (module
    docstring); ``mask`` additive, broadcastable to ``[B, H, T, S]``."""
    if query.device.type == "cpu":
        return _CPU_KERNEL(query, key, value, 0.0, causal, attn_mask=mask, scale=scaling)
    if mask is None and query.dtype in _FLASH_DTYPES:
        output, lse, *_ = _CUDA_FLASH(query, key, value, 0.0, causal, False, scale=scaling)
        return output, lse
    if mask is not None:
        mask = _aligned(mask).expand(*query.shape[:3], key.shape[2])
    output, lse, *_ = _CUDA_EFFICIENT(query, key, value, mask, True, 0.0, causal, scale=scaling)
    return output, lse[..., :query.shape[2]]  # (its lse is padded to a multiple of 32 rows)


def _aligned(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` itself if its rows start at multiples of 16 elements, else a copy laid out so
    (the memory-efficient kernel's requirement; SDPA copies the same way)."""
    if all(stride % _BIAS_ALIGNMENT == 0 for stride in mask.stride()[:-1]):
        return mask
    width = -(-mask.shape[-1] // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    rows = mask.new_empty(*mask.shape[:-1], width)[..., :mask.shape[-1]]
    return rows.copy_(mask)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean visibility as the additive mask the fused kernel takes (0 / −inf)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf"))
