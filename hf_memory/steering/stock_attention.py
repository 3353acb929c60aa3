"""The stock attention over the history, with the log-sum-exp that merges the banks into it.

A steered layer's mixture is one softmax over [history ; bank slots]; its history part is what
the model's own attention computes, and :func:`hf_memory.steering.mixture.bank_mixture_by_lse`
merges the banks into that output through the history's log-sum-exp. This module runs that
attention in the model's dtype with the fused kernel ``torch.nn.functional.
scaled_dot_product_attention`` dispatches to, asking it for the log-sum-exp it computes anyway
(the public function discards it). Chosen by ``benchmarks/gpu/lse_kernels.py`` (H200, bf16,
Llama-1B heads; BENCHMARKS.md "The history through the stock kernel on a GPU"):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (float32/64, bf16, fp16);
* CUDA, bf16/fp16 without a mask: ``aten._scaled_dot_product_flash_attention``, grouped-query
  heads in the kernel (SDPA's own choice there);
* CUDA, bf16/fp16 with a mask: cuDNN's attention (``aten._scaled_dot_product_cudnn_attention``,
  what SDPA runs there on Hopper; the memory-efficient kernel measured 1.2-5x slower);
* CUDA otherwise (float32, or cuDNN's attention unavailable):
  ``aten._scaled_dot_product_efficient_attention``.

The kernels that take a mask read it in rows aligned to 16 elements; one that is not is copied
into such rows, as SDPA does. Grouped-query heads elsewhere (:func:`_by_groups`): a single query
token packs a KV group's heads as rows (no copy of the cache), longer queries read the KV heads
repeated per query head, as transformers' SDPA path does. Where no kernel applies (float64 on CUDA,
other devices), :func:`lse_kernel_available` says so and steering recomputes the history beside
the stock call (:func:`hf_memory.steering.mixture.bank_mixture`), as before.
"""

from __future__ import annotations

import torch

__all__ = ["attention_with_lse", "lse_kernel_available"]

_CPU_KERNEL = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CUDA_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_CUDA_CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention
_CUDA_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_KERNEL_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_BIAS_ALIGNMENT = 16  # elements per row of a fused kernel's bias


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
    t = query.shape[2]
    causal = visible is None and t > 1
    if causal and key.shape[2] != t:
        raise ValueError("attention_with_lse: a multi-token query over a longer history "
                         "needs its visibility mask")
    if kv_index is not None:  # a subset of heads: their KV heads gathered, one per query head
        key, value = key[:, kv_index], value[:, kv_index]
    hidden = None if visible is None else ~visible
    mask = None if hidden is None else _additive(hidden, query.dtype)
    output, lse = _kernel_for(query, mask)(query, key, value, mask, causal, scaling)
    if hidden is not None:
        blind = hidden.all(-1)
        lse = lse.masked_fill(blind, float("-inf"))
        if query.device.type != "cpu":  # (the CUDA kernels leave such a row undefined)
            output = output.masked_fill(blind[..., None], 0.0)
    return output, lse


def _kernel_for(query: torch.Tensor, mask: torch.Tensor | None):
    """The fused kernel for ``query``'s device, dtype and mask (module docstring)."""
    if query.device.type == "cpu":
        return _GROUPED_CPU
    if query.dtype in _HALF_DTYPES:
        if mask is None:
            return _flash  # (grouped-query heads in the kernel)
        head_dim = query.shape[-1]
        if head_dim % 8 == 0 and head_dim <= 128 and _cudnn_attention_on(query.device):
            return _GROUPED_CUDNN
    return _GROUPED_EFFICIENT


@torch.compiler.assume_constant_result
def _cudnn_attention_on(device: torch.device) -> bool:
    """Whether cuDNN's attention is built, enabled and runs on ``device`` (Hopper or newer).

    A constant to ``torch.compile``: Dynamo cannot trace these backend queries (each one broke
    the graph at every steered layer), so a compiled graph keeps the answer it was traced with
    (``torch.backends.cuda.enable_cudnn_sdp`` toggled later is not seen by it)."""
    return (torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _by_groups(kernel):
    """``kernel`` (as many KV heads as query heads) on grouped-query heads: a single query token
    packs a KV group's query heads as the rows of one query (no copy of the cache; on the H200
    cuDNN's attention ran so 1.4x faster than on repeated KV heads at batch 32, not counting
    the copy), a longer query reads the KV heads repeated (transformers' ``repeat_kv``)."""
    def grouped(query, key, value, mask, causal: bool, scaling: float):
        b, heads, t, d = query.shape
        kv_heads = key.shape[1]
        if heads == kv_heads:
            return kernel(query, key, value, mask, causal, scaling)
        group = heads // kv_heads
        if t > 1:
            key, value = (x.repeat_interleave(group, dim=1) for x in (key, value))
            return kernel(query, key, value, mask, causal, scaling)
        if mask is not None:
            mask = mask.reshape(mask.shape[0], kv_heads if mask.shape[1] != 1 else 1, -1,
                                mask.shape[-1])
        output, lse = kernel(query.reshape(b, kv_heads, group, d), key, value, mask, False,
                             scaling)
        return output.reshape(b, heads, 1, d), lse.reshape(b, heads, 1)

    return grouped


def _on_cpu(query, key, value, mask, causal: bool, scaling: float):
    return _CPU_KERNEL(query, key, value, 0.0, causal, attn_mask=mask, scale=scaling)


def _flash(query, key, value, mask, causal: bool, scaling: float):
    output, lse, *_ = _CUDA_FLASH(query, key, value, 0.0, causal, False, scale=scaling)
    return output, lse


def _cudnn(query, key, value, mask, causal: bool, scaling: float):
    output, lse, *_ = _CUDA_CUDNN(query, key, value, _bias(mask, query, key), True, 0.0,
                                  causal, False, scale=scaling)
    return output, lse.reshape(query.shape[:3])


def _efficient(query, key, value, mask, causal: bool, scaling: float):
    output, lse, *_ = _CUDA_EFFICIENT(query, key, value, _bias(mask, query, key), True, 0.0,
                                      causal, scale=scaling)
    return output, lse[..., :query.shape[2]]  # (its lse is padded to a multiple of 32 rows)


_GROUPED_CPU, _GROUPED_CUDNN, _GROUPED_EFFICIENT = map(_by_groups, (_on_cpu, _cudnn, _efficient))


def _bias(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor):
    """The additive mask as a CUDA kernel's bias: aligned rows, broadcast to ``[B, H, T, S]``."""
    if mask is None:
        return None
    return _aligned(mask).expand(*query.shape[:3], key.shape[2])


def _aligned(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` itself if its rows start at multiples of 16 elements, else a copy laid out so
    (the fused kernels' requirement; SDPA copies the same way)."""
    if all(stride % _BIAS_ALIGNMENT == 0 for stride in mask.stride()[:-1]):
        return mask
    width = -(-mask.shape[-1] // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    rows = mask.new_empty(*mask.shape[:-1], width)[..., :mask.shape[-1]]
    return rows.copy_(mask)


def _additive(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask of hidden keys as the additive mask the fused kernels take (0 / −inf)."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(
        hidden, float("-inf"))
