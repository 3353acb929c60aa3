"""Logit lens: read any vector of the residual stream through the final norm and unembedding.

``lens(h) = unembedding(final_norm(h))`` and ``top(h) = argmax lens(h)`` (the paper's
``top(h) = argmax(h E)``, with the final norm that our models apply before ``E``). For the
model's last block output this is exactly the model's logits. For a single value vector ``v``
with RMSNorm, ``lens(v) = E (g ⊙ v) / rms(v)``: the final-norm gain ``g`` is applied and the
positive ``1/rms`` does not change the ranking, so the ranking is the one of ``E (g ⊙ v)``.
"""

from __future__ import annotations

import torch

from .mlp_adapter import FFNAdapter

__all__ = ["logit_lens", "top_tokens"]


@torch.no_grad()
def logit_lens(adapter: FFNAdapter, hidden: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` residual-stream vectors -> ``[..., V]`` logits."""
    return adapter.unembedding(adapter.final_norm(hidden))


@torch.no_grad()
def top_tokens(adapter: FFNAdapter, hidden: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """``[..., d]`` -> ``[...]`` int64 top token of each vector, ``chunk`` rows at a time."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    tops = [logit_lens(adapter, flat[i: i + chunk]).argmax(-1) for i in range(0, len(flat), chunk)]
    out = torch.cat(tops) if tops else torch.empty(0, dtype=torch.int64)
    return out.reshape(hidden.shape[:-1])
