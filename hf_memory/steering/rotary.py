"""The rotary map in transformers' half-split convention, forward and inverse, with partial
rotary (only the first ``R`` of ``D`` dimensions turn): bank keys are placed by the forward map,
and a traced call recovers the pre-RoPE query by the inverse."""

from __future__ import annotations

import torch

__all__ = ["pre_rope_query", "rotate", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) → (−x2, x1)`` over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` turned by ``(cos, sin)`` (broadcast against it) in its first ``cos.shape[-1]``
    dimensions, the rest kept."""
    turned, kept = x[..., :cos.shape[-1]], x[..., cos.shape[-1]:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, kept], dim=-1)


def pre_rope_query(query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The pre-RoPE query ``[B, H, T, D]`` from the post-RoPE one and the layer's ``(cos, sin)``
    ``[B, T, R]`` (R ≤ D rotated dimensions): the inverse rotation, divided by cos² + sin² (the
    rotary's attention scaling squared)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    turned, kept = query[..., :cos.shape[-1]], query[..., cos.shape[-1]:]
    back = turned * cos - rotate_half(turned) * sin
    return torch.cat([back / (cos * cos + sin * sin), kept], dim=-1)
